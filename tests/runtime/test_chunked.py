"""Chunked chain appends (runtime/chunked.py): the pass plan, forward_chunked == one forward (logits of every mode,
captured hidden rows, aux layers, input features), and drafts catching up in chunks propose exactly the same trees."""
from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import SpecShape
from draft_service.standalone import StandaloneProposer
from runtime.chunked import forward_chunked, plan_chunks
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from tests.eagle.heads import make_eagle3_head
from tests.eagle.test_eagle_lossless import speculative_greedy
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("chunk"))


def _runner(path: str, chunk: int | None = None) -> ModelRunner:
    return ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, block_size=4,
                                          chunked_prefill_size=chunk))


def test_plan_respects_the_limit_order_and_one_range_per_pass():
    rng = random.Random(0)
    for _ in range(200):
        lengths, limit = [rng.randrange(0, 40) for _ in range(rng.randrange(1, 6))], rng.randrange(1, 17)
        passes = plan_chunks(lengths, limit)
        assert all(sum(e - s for _, s, e in p) <= limit for p in passes)
        assert all(len({i for i, _, _ in p}) == len(p) for p in passes)
        for index, length in enumerate(lengths):
            ranges = [(s, e) for p in passes for i, s, e in p if i == index]
            assert [r for r in ranges if r[0] < r[1]] == ranges and (not ranges or ranges[0][0] == 0)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and sum(e - s for s, e in ranges) == length


@pytest.mark.parametrize("mode", ["last", "all", "none"])
def test_forward_chunked_equals_one_forward(llama, mode):
    rng = random.Random(1)
    prompts = {f"s{i}": [rng.randrange(3, 300) for _ in range(n)] for i, n in enumerate((23, 4, 17))}
    outs = []
    for chunk in (None, 5):
        runner = _runner(llama)
        for s in prompts:
            runner.add_seq(s)
        batch = [SeqForward(s, p, logits=mode, capture_hidden=True) for s, p in prompts.items()]
        outs.append(forward_chunked(runner, batch, chunk, capture_layers=[1]))
        assert [runner.kv_len(s) for s in prompts] == [len(p) for p in prompts.values()]
    (one, chunked) = outs
    for a, b in zip(one.logits, chunked.logits):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for a, b in zip(one.hidden, chunked.hidden):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for a, b in zip(one.features, chunked.features):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def test_tree_appends_are_refused(llama):
    runner = _runner(llama)
    runner.add_seq("s")
    with pytest.raises(ValueError, match="chain appends"):
        forward_chunked(runner, [SeqForward("s", [1, 2, 3, 4], parents=[-1, 0, 0, 1])], 2)


def test_standalone_draft_catching_up_in_chunks_proposes_the_same(llama):
    from draft_service.proposer import ProposeInput

    spec = SpecShape(num_steps=3, topk=2, num_draft_tokens=6)
    prompt = [random.Random(3).randrange(3, 300) for _ in range(29)]
    trees = []
    for chunk in (None, 4):
        proposer = StandaloneProposer(_runner(llama, chunk))
        proposer.prefill("s", prompt)
        [res] = proposer.propose([ProposeInput("s", len(prompt), [], spec)])
        trees.append((res.tree.token_ids, res.tree.parents))
    assert trees[0] == trees[1]


def test_eagle3_head_catching_up_in_chunks_decodes_the_same(tmp_path):
    target_path = make_tiny_model("llama", tmp_path / "target")
    head = make_eagle3_head(target_path, str(tmp_path / "eagle3"))
    spec = SpecShape(num_steps=3, topk=2, num_draft_tokens=5)
    prompt = [random.Random(4).randrange(3, 300) for _ in range(21)]
    results = []
    for chunk in (None, 4):
        config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048, block_size=4,
                              chunked_prefill_size=chunk)
        proposer = EagleProposer(target_path, head, config, algorithm="EAGLE3")
        target = ModelRunner(target_path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048,
                                                       block_size=4))
        results.append(speculative_greedy(target, proposer, prompt, 12, spec))
    assert results[0] == results[1]
