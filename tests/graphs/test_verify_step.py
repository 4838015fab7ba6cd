"""The static verify step (runtime/speculative/verify_step.py: forward, greedy tree walk, KV compaction and feature
gather as static device code, one CUDA graph per batch bucket on a GPU) gives exactly the eager TargetEngine's
tokens, accept counts, KV and EAGLE features, batch 1 and 6; batches it cannot take (sampling, other tree sizes)
keep the eager path. On CPU its device code runs eagerly with the triton backend through the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import SpecShape
from draft_service.standalone import StandaloneProposer
from runtime.model_runner import ModelRunner
from runtime.speculative import tree as tree_mod
from runtime.speculative.verify_step import ancestor_mask
from target_service.engine import TargetEngine
from tests.graphs.test_graph_paths import _config
from tests.tiny_models import make_tiny_model
from tools.spec_eval import Method, _generate

TREE = SpecShape(num_steps=3, topk=2, num_draft_tokens=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("verify_step"))


def test_ancestor_mask_matches_the_tree():
    from runtime.speculative.tree import DraftTree

    gen = random.Random(0)
    for _ in range(20):
        n = gen.randrange(1, 15)
        parents = [-1]
        for i in range(1, n + 1):
            parents.append(gen.randrange(0, i))
        tree = DraftTree([1] * n, [p - 1 for p in parents[1:]])
        want = tree_mod.ancestor_mask(tree)
        got = ancestor_mask(torch.tensor([parents]))[0].bool()
        assert torch.equal(got, want)


def _run(llama, static: bool, batch: int, spec: SpecShape, temperature: float = 0.0):
    target = ModelRunner(llama, _config(max_total_tokens=4096))
    engine = TargetEngine(target)
    if static:
        assert engine.enable_static_verify(spec.num_draft_tokens, max_bs=8)
    proposer = StandaloneProposer(ModelRunner(llama, _config(max_total_tokens=4096)))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(6 + i)] for i in range(batch)]
    committed: dict = {}
    steps, tokens = _generate(engine, proposer, Method("m", "STANDALONE", spec.num_steps, spec.topk,
                                                       spec.num_draft_tokens), prompts, 12, temperature, 0,
                              outputs=committed)
    return committed, steps, engine


@pytest.mark.parametrize("batch", [1, 6])
def test_static_verify_matches_eager(llama, batch):
    got, steps_s, engine = _run(llama, True, batch, TREE)
    want, steps_e, _ = _run(llama, False, batch, TREE)
    assert got == want and steps_s == steps_e
    assert engine._static_verify.num_replays >= 3  # every speculative step of the batch went through it


def test_sampled_batches_keep_the_eager_path(llama):
    _, _, engine = _run(llama, True, 2, TREE, temperature=1.0)
    assert engine._static_verify.num_replays == 0


def test_static_verify_eagle3_features_and_trees_match(tmp_path):
    from tests.eagle.heads import make_eagle3_head

    target_path = make_tiny_model("llama", tmp_path / "target")
    head = make_eagle3_head(target_path, str(tmp_path / "eagle3"))
    results = []
    for static in (True, False):
        proposer = EagleProposer(target_path, head, _config(max_total_tokens=1024), algorithm="EAGLE3")
        trees = []
        draft = proposer._draft

        def recording(inputs, draft=draft, trees=trees):
            out = draft(inputs)
            trees.append([(t.token_ids, t.parents) for t in out])
            return out

        proposer._draft = recording
        engine = TargetEngine(ModelRunner(target_path, _config(max_total_tokens=2048)),
                              feature_layers=proposer.target_capture_layers)
        if static:
            assert engine.enable_static_verify(TREE.num_draft_tokens, max_bs=4)
        committed: dict = {}
        _generate(engine, proposer, Method("m", "EAGLE3", TREE.num_steps, TREE.topk, TREE.num_draft_tokens),
                  [[5, 17, 42, 99, 7], [3, 8, 21, 55, 144, 33]], 10, 0.0, 0, outputs=committed)
        results.append((committed, trees))
        if static:
            assert engine._static_verify.num_replays > 0
    assert results[0] == results[1]  # same tokens, and the drafts saw the same features: the same trees


@pytest.mark.parametrize("algorithm,spec", [("EAGLE3", SpecShape(3, 2, 6)), ("STANDALONE", SpecShape(3, 1, 4)),
                                            ("NGRAM", SpecShape(1, 1, 6))])
async def test_static_steps_through_the_services_match_hf(tmp_path, algorithm, spec):
    """The real step path (gRPC servicers, wire features, scheduler) with both static steps on, as tandem serve runs
    them on a GPU: greedy output == HF generate, every step of the served shape through the static steps, no leak."""
    import transformers

    from tests.eagle.heads import make_eagle3_head
    from tests.stack import generate_ids, local_stack
    from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts

    path = make_tiny_model("llama", tmp_path / "target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    draft = {"EAGLE3": lambda: make_eagle3_head(path, str(tmp_path / "eagle3")), "STANDALONE": lambda: path,
             "NGRAM": lambda: None}[algorithm]()
    async with local_stack(path, algorithm=algorithm, draft_path=draft, num_steps=spec.num_steps, topk=spec.topk,
                           num_draft_tokens=spec.num_draft_tokens, static_steps=True,
                           ngram_kwargs={"max_bfs_breadth": 2} if algorithm == "NGRAM" else None) as scheduler:
        for i, prompt in enumerate(prompts(hf.config.vocab_size)[:2]):
            got, usage, _ = await generate_ids(scheduler, prompt, 12, request_id=f"s{i}")
            assert got == hf_greedy(hf, prompt, 12)
        assert scheduler.test_engine._static_verify.num_replays > 0
        if algorithm != "NGRAM":
            step = scheduler.test_proposer._static_steps[spec]
            assert step.num_replays > 0
        await _assert_no_kv_leak(scheduler)


@pytest.mark.parametrize("batch", [1, 6])
def test_one_readback_per_static_verify(llama, batch, monkeypatch):
    """A greedy Verify through the static step reads the device back once, whatever the batch."""
    from runtime.sampling import SamplingParams
    from runtime.speculative.tree import DraftTree
    from core.types import StopRule
    from target_service.engine import PrefillInput, VerifyInput
    from tests.graphs.test_draft_step import ReadbackCounter

    engine = TargetEngine(ModelRunner(llama, _config(max_total_tokens=4096)))
    assert engine.enable_static_verify(TREE.num_draft_tokens, max_bs=8)
    ids = [f"v{i}" for i in range(batch)]
    stop = StopRule(64, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    outs = engine.prefill([PrefillInput(s, [3 + i, 9, 27, 81, 200], True, greedy, stop) for i, s in
                           enumerate(ids)])
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 2])  # num_draft_tokens - 1 nodes
    inputs = [VerifyInput(o.seq_id, 6, o.token_ids[-1], tree, greedy, stop) for o in outs]
    counter = ReadbackCounter(monkeypatch)
    results = engine.verify(inputs)
    assert counter.count == 1
    monkeypatch.undo()
    assert all(r.token_ids for r in results) and engine._static_verify.num_replays == 1
