"""The `triton` attention backend gives the same logits as the `torch` backend through the real ModelRunner:
prefill, batched decode, tree verify, trees grown over several forwards next to plain decodes, compaction; and the
same greedy generation. Tiny fp32 models, so on CPU everything runs through the Triton interpreter."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from runtime.attention import get_backend
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from tests.tiny_models import make_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = make_tiny_model(family, tmp_path_factory.mktemp("tiny"))
        return cache[family]

    return get


def _runners(path: str, device: torch.device) -> tuple[ModelRunner, ModelRunner]:
    # Small blocks so every sequence spans several pages.
    return tuple(
        ModelRunner(path, EngineConfig(device=str(device), block_size=4, max_total_tokens=512, attention_backend=b))
        for b in ("torch", "triton")
    )


def _both(runners, steps):
    """Run the same list of SeqForward batches on both runners; compare every logits tensor."""
    for batch in steps:
        outs = [r.forward(batch) for r in runners]
        for want, got in zip(outs[0].logits, outs[1].logits):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def test_triton_backend_is_registered_lazily():
    code = ("import sys, runtime.attention, runtime.model_runner; "
            "assert 'triton' not in sys.modules and 'tandem_kernels.paged_attention' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert get_backend("triton").__name__ == "TritonAttentionBackend"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_decode_and_batching_match_torch_backend(family, tiny_path, device):
    runners = _runners(tiny_path(family), device)
    seqs = {"a": _tokens(11, 1), "b": _tokens(3, 2), "c": _tokens(6, 3)}
    for r in runners:
        for s in seqs:
            r.add_seq(s)
    _both(runners, [
        [SeqForward(s, ids, logits="all") for s, ids in seqs.items()],  # mixed-length prefill
        [SeqForward(s, [ids[0]]) for s, ids in seqs.items()],  # batched decode
        [SeqForward("a", [5]), SeqForward("b", _tokens(5, 4), logits="all")],  # decode next to a chain extend
    ])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_verify_then_compact_matches_torch_backend(family, tiny_path, device):
    runners = _runners(tiny_path(family), device)
    parents = [-1, -1, 0, 1, 3, 2, 4, 4, 0, 8]
    for r in runners:
        r.add_seq("t")
        r.add_seq("u")
    _both(runners, [
        [SeqForward("t", _tokens(7, 5), logits="none"), SeqForward("u", _tokens(9, 6), logits="none")],
        # A verify-style tree on one sequence while the other one decodes.
        [SeqForward("t", _tokens(10, 7), parents=parents, logits="all"), SeqForward("u", [9])],
    ])
    for r in runners:
        r.compact("t", [1, 3, 4, 7])
    _both(runners, [[SeqForward("t", [42, 43], logits="all"), SeqForward("u", [11], logits="all")]])


def test_tree_grown_over_several_forwards_matches_torch_backend(tiny_path, device):
    runners = _runners(tiny_path("llama"), device)
    for r in runners:
        r.add_seq("t")
        r.add_seq("other")
    steps = [[SeqForward("t", _tokens(5, 8), logits="none"), SeqForward("other", _tokens(3, 9), logits="none")]]
    # Draft-style expansion: 3 roots, then their children, then grandchildren; a plain decode rides along.
    for k, step_parents in enumerate([[-1, -1, -1], [0, 0, 2], [3, 5, 5, 4]]):
        steps.append([SeqForward("t", _tokens(len(step_parents), 10 + k), parents=step_parents, logits="all"),
                      SeqForward("other", [7 + k])])
    _both(runners, steps)


def test_greedy_generation_matches_torch_backend(tiny_path, device):
    runners = _runners(tiny_path("llama"), device)
    generated = []
    for r in runners:
        r.add_seq("g")
        next_id = int(r.forward([SeqForward("g", _tokens(6, 12))]).logits[0][-1].argmax())
        tokens = [next_id]
        for _ in range(10):
            next_id = int(r.forward([SeqForward("g", [next_id])]).logits[0][-1].argmax())
            tokens.append(next_id)
        generated.append(tokens)
    assert generated[0] == generated[1]
    assert len(set(generated[0])) > 2
