"""Host readbacks of a draft Propose do not grow with the batch: a tree step reads its nodes' tokens and parents back
in one copy for all sequences (runtime.speculative.tree.host_rows), not one per sequence. On a GPU every readback is a
device sync, so a per-sequence readback costs a sync per sequence per step at large batches. Counted on CPU by
wrapping Tensor.tolist / item / cpu during Propose; the trees are the same as drafting each sequence alone."""
from __future__ import annotations

import contextlib

import pytest
import torch

from draft_service.proposer import ProposeInput, SpecShape
from runtime.config import EngineConfig
from tests.stack import perturbed_copy
from tests.tiny_models import make_tiny_model


@contextlib.contextmanager
def count_readbacks():
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "cpu")}

    def wrap(fn):
        def counted(self, *args, **kwargs):
            counts["n"] += 1
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _proposer(kind: str, root):
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=8192)
    if kind == "STANDALONE":
        from draft_service.standalone import StandaloneProposer
        from runtime.model_runner import ModelRunner

        target = make_tiny_model("llama", root / "t")
        return StandaloneProposer(ModelRunner(perturbed_copy(target, root / "d", noise=0.05), config)), None
    from draft_service.eagle import EagleProposer
    from tests.eagle.heads import make_eagle3_head

    target = make_tiny_model("llama", root / "t", num_hidden_layers=4)
    proposer = EagleProposer(target, make_eagle3_head(target, str(root / "e3")), config, "EAGLE3")
    return proposer, proposer.feature_size


@pytest.mark.parametrize("kind", ["STANDALONE", "EAGLE3"])
def test_readbacks_per_propose_do_not_grow_with_the_batch(kind, tmp_path):
    proposer, feature_size = _proposer(kind, tmp_path)
    spec = SpecShape(num_steps=4, topk=3, num_draft_tokens=10)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (20 + 3 * i,), generator=gen).tolist() for i in range(6)]
    features = [None if feature_size is None else torch.randn(len(p) - 1, feature_size, generator=gen)
                for p in prompts]

    def propose(ids: list[str]):
        for seq_id in ids:
            proposer.prefill(seq_id, prompts[int(seq_id[1:])], features[int(seq_id[1:])])
        inputs = [ProposeInput(s, len(prompts[int(s[1:])]), [], spec,
                               None if feature_size is None else torch.empty(0, feature_size)) for s in ids]
        proposer.propose(inputs)  # the first Propose catches up the prompt; the second only drafts
        with count_readbacks() as counts:
            outs = proposer.propose(inputs)
        proposer.release(ids)
        return counts["n"], {o.seq_id: (o.tree.token_ids, o.tree.parents) for o in outs}

    alone = {}
    for i in range(6):
        n1, tree = propose([f"s{i}"])
        alone.update(tree)
    n6, together = propose([f"s{i}" for i in range(6)])
    assert n6 == n1, f"{kind}: {n1} readbacks per Propose at batch 1, {n6} at batch 6"
    assert together == alone and all(len(t) == 9 for t, _ in together.values())
