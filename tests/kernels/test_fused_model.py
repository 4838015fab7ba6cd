"""The fused elementwise path of runtime/models/llama.py (Triton RMSNorm, add + RMSNorm, RoPE, SiLU-mul) forced on
through the real ModelRunner gives the torch path's logits, aux hidden states and greedy tokens: tiny Llama (GQA,
untied), Qwen2 (qkv bias) and Qwen3 (q/k norm) checkpoints, fp32 and bf16. On CPU the kernels run in the Triton
interpreter. Also: auto mode keeps CPU on the torch path, and the switch never engages under autograd."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.models import llama
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = make_tiny_model(family, tmp_path_factory.mktemp("tiny"))
        return cache[family]

    return get


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


class _Pair:
    """Two runners over one checkpoint: [0] runs the torch path, [1] the fused kernels."""

    def __init__(self, path: str, device: torch.device, dtype: str) -> None:
        cfg = EngineConfig(device=str(device), dtype=dtype, block_size=4, max_total_tokens=512,
                           attention_backend="torch")
        self.runners = [ModelRunner(path, cfg), ModelRunner(path, cfg)]

    def forward(self, batch, **kw):
        outs = []
        for fused, r in zip((False, True), self.runners):
            with llama.fused_elementwise(fused):
                outs.append(r.forward(batch, **kw))
        return outs

    def add_seq(self, s: str) -> None:
        for r in self.runners:
            r.add_seq(s)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_path_matches_torch_path_fp32(family, tiny_path, device, monkeypatch):
    used: list[str] = []
    real = llama._k
    monkeypatch.setattr(llama, "_k", lambda name: used.append(name) or real(name))
    pair = _Pair(tiny_path(family), device, "float32")
    seqs = {"a": _tokens(9, 1), "b": _tokens(4, 2)}
    for s in seqs:
        pair.add_seq(s)
    for batch in ([SeqForward(s, ids, logits="all") for s, ids in seqs.items()],  # prefill
                  [SeqForward("a", [5]), SeqForward("b", [7])],  # decode
                  [SeqForward("a", _tokens(5, 3), parents=[-1, 0, 0, 1, 2], logits="all")]):  # tree verify
        want, got = pair.forward(batch, capture_layers=[0, 2, 3])  # 3 = after the last layer, before the norm
        for w, g in zip(want.logits + want.aux_hidden, got.logits + got.aux_hidden):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert set(used) == {"norm", "rope", "activation"}, "the forced run went through all three kernel modules"


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_fused_path_gives_the_same_greedy_tokens(family, dtype, tiny_path, device):
    pair = _Pair(tiny_path(family), device, dtype)
    pair.add_seq("g")
    generated = []
    for fused, r in zip((False, True), pair.runners):
        with llama.fused_elementwise(fused):
            next_id = int(r.forward([SeqForward("g", _tokens(6, 12))]).logits[0][-1].argmax())
            tokens = [next_id]
            for _ in range(8):
                next_id = int(r.forward([SeqForward("g", [next_id])]).logits[0][-1].argmax())
                tokens.append(next_id)
        generated.append(tokens)
    assert generated[0] == generated[1]
    assert len(set(generated[0])) > 2


def test_switch_auto_is_off_on_cpu_and_never_under_autograd():
    x = torch.zeros(2, 4)
    with llama.fused_elementwise(None):
        assert not llama.use_fused(x)
    with llama.fused_elementwise(True):
        with torch.no_grad():
            assert llama.use_fused(x)
        assert not llama.use_fused(x)  # grad mode on: the kernels have no backward
    with llama.fused_elementwise(False), torch.no_grad():
        assert not llama.use_fused(x)
