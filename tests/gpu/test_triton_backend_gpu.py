"""The `triton` backend against the `torch` backend through ModelRunner on the GPU, with a dummy-weight model of
Llama-3.1-8B attention shape (32/8 heads, head_dim 128, bf16; two layers, small MLP and vocab to stay quick):
long prefill, verify trees of 64 nodes over 8 sequences next to decodes, compaction and decode after it."""

from __future__ import annotations

import random

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import torch  # noqa: E402

from runtime.config import EngineConfig, ModelConfig  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=4096, num_layers=2, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=1024, max_position_embeddings=8192,
                     rope_theta=500000.0)


def _runners():
    return [ModelRunner(None, EngineConfig(device="cuda", dtype="bfloat16", load_format="dummy", block_size=16,
                                           max_total_tokens=65536, attention_backend=b, seed=0), CONFIG)
            for b in ("torch", "triton")]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 end to end: compare against the logits' own scale; near-ties may flip a few greedy choices.
    assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def _both(runners, batch):
    outs = [r.forward(batch) for r in runners]
    for want, got in zip(outs[0].logits, outs[1].logits):
        _close(got, want)


def test_triton_backend_matches_torch_backend_at_8b_attention_shapes():
    rng = random.Random(0)
    runners = _runners()
    # Same dummy weights in both runners: the loader seeds from EngineConfig.seed.
    torch.testing.assert_close(runners[0].model.lm_head.weight, runners[1].model.lm_head.weight)
    seqs = [f"s{i}" for i in range(8)]
    prompt_lens = [4000, 1, 17, 1024, 2500, 64, 333, 3000]
    for r in runners:
        for s in seqs:
            r.add_seq(s)
    tok = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    _both(runners, [SeqForward(s, tok(n), logits="last") for s, n in zip(seqs, prompt_lens)])
    _both(runners, [SeqForward(s, tok(1)) for s in seqs])
    parents = [-1] + [rng.randrange(0, j) for j in range(1, 64)]
    trees = [SeqForward(s, tok(64), parents=parents, logits="all") for s in seqs[:6]]
    _both(runners, trees + [SeqForward(s, tok(1)) for s in seqs[6:]])
    path, node = [], 63  # keep the root-to-node-63 path, as an accepted verify would
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    for r in runners:
        for s in seqs[:6]:
            r.compact(s, path)
    _both(runners, [SeqForward(s, tok(1)) for s in seqs])
