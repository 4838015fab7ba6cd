"""The `flashinfer` backend against the `torch` backend through ModelRunner on the GPU, with a dummy-weight model of
Llama-3.1-8B attention shape (32/8 heads, head_dim 128, bf16; two layers, small MLP and vocab to stay quick):
prefill, decode at bs 1 and 8, verify trees of 16 and 64 nodes at bs 1 and 4 over prefixes of a few hundred to ~4k
tokens, tree regions grown over several forwards, compaction; then the same through captured CUDA graphs (decode
and verify buckets with padding, and draft-style wide masks when the engine has them).

Skips without CUDA or without an importable FlashInfer (pip install flashinfer-python). FlashInfer compiles its
kernels on first use (JIT, needs nvcc): the first run takes minutes, later runs hit its cache."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil

import pytest

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()
flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is not installed (pip install flashinfer-python)")
if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME") or os.path.exists("/usr/local/cuda/bin/nvcc")):
    pytest.skip("FlashInfer JIT-compiles its kernels and needs nvcc (CUDA toolkit); none found",
                allow_module_level=True)

import torch  # noqa: E402

from runtime.config import EngineConfig, ModelConfig  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=4096, num_layers=2, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=1024, max_position_embeddings=8192,
                     rope_theta=500000.0)


def _runner(backend: str, graphs: bool = False, **kw) -> ModelRunner:
    cfg = dict(device="cuda", dtype="bfloat16", load_format="dummy", block_size=16, max_total_tokens=65536,
               attention_backend=backend, seed=0, disable_cuda_graph=not graphs, cuda_graph_max_bs=8)
    return ModelRunner(None, EngineConfig(**{**cfg, **kw}), CONFIG)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # bf16 end to end: compare against the logits' own scale; near-ties may flip a few greedy choices.
    assert torch.isfinite(got).all(), what
    err = (got - want).abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{what}: max |diff| {err:.4g} (scale {want.abs().max().item():.4g}), argmax agreement {agree:.3f}")
    assert err <= 0.05 * want.abs().max().item() + 1e-3, what
    # A greedy choice may only differ where the reference's own top-2 margin is within the measured error (a near-tie:
    # bf16 rounding order differs between kernels); a masking bug moves argmaxes off clear winners. (The earlier
    # "agreement >= 0.9" check failed on the H200 with 4 rows: 1 near-tie flip at max |diff| 0.055 of scale 5.25.)
    for row in (got.argmax(-1) != want.argmax(-1)).nonzero().flatten().tolist():
        margin = (want[row].max() - want[row, got[row].argmax()]).item()
        assert margin <= 2 * err + 1e-3, f"{what}: row {row} argmax moved off a clear winner (margin {margin:.4g})"


def _both(runners, batch, what: str):
    outs = [r.forward(batch) for r in runners]
    _close(torch.cat(outs[1].logits), torch.cat(outs[0].logits), what)
    return outs


def _tokens(rng: random.Random):
    return lambda n: [rng.randrange(3, 2048) for _ in range(n)]


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


def test_packed_mask_on_the_gpu_equals_the_host_layout():
    """pack_mask (index_add_ of cleared bits on the device) gives the bytes the CPU test checks bit by bit."""
    from runtime.attention.flashinfer_backend import pack_mask, page_tables
    from runtime.forward_batch import SeqAttention

    rng = random.Random(2)
    seqs, start = [], 0
    for i in range(6):
        t, prefix = rng.randrange(1, 65), rng.randrange(0, 4000)
        tail = t + rng.randrange(0, 8)
        rows = [rng.getrandbits(tail) | (1 << (tail - t + j)) for j in range(t)]
        seqs.append(SeqAttention(start, t, prefix + tail, prefix, list(range(-(-(prefix + tail) // 16))), 16,
                                 torch.device("cuda"), tree_rows=rows))
        start += t
    tables = page_tables(seqs, 16, masked=True, num_pad=2, pad_query_len=5)
    torch.testing.assert_close(pack_mask(tables, torch.device("cuda")).cpu(), pack_mask(tables, torch.device("cpu")),
                               rtol=0, atol=0)


@pytest.fixture(scope="module")
def eager():
    runners = [_runner("torch"), _runner("flashinfer")]
    # Same dummy weights in both runners: the loader seeds from EngineConfig.seed.
    torch.testing.assert_close(runners[0].model.lm_head.weight, runners[1].model.lm_head.weight)
    assert type(runners[1].attn_backend).__name__ == "FlashInferAttentionBackend"
    return runners


def test_prefill_and_decode_at_bs_1_and_8(eager):
    rng = random.Random(0)
    tok = _tokens(rng)
    seqs = [f"p{i}" for i in range(8)]
    prompt_lens = [4000, 1, 17, 1024, 2500, 64, 333, 3000]
    for r in eager:
        for s in seqs:
            r.add_seq(s)
    _both(eager, [SeqForward(seqs[0], tok(prompt_lens[0]), logits="all")], "prefill bs1 4000 tokens")
    _both(eager, [SeqForward(s, tok(n)) for s, n in zip(seqs[1:], prompt_lens[1:])], "prefill bs7 mixed")
    for step in range(3):
        _both(eager, [SeqForward(seqs[0], tok(1))], f"decode bs1 step {step}")
        _both(eager, [SeqForward(s, tok(1)) for s in seqs], f"decode bs8 step {step}")
    _both(eager, [SeqForward(seqs[0], tok(1)), SeqForward(seqs[1], tok(40), logits="all")], "decode + chain extend")
    for r in eager:
        for s in seqs:
            r.free_seq(s)


@pytest.mark.parametrize("num_nodes", [16, 64])
@pytest.mark.parametrize("bs", [1, 4])
def test_verify_trees_over_long_prefixes(eager, num_nodes, bs):
    rng = random.Random(num_nodes * 10 + bs)
    tok = _tokens(rng)
    seqs = [f"v{num_nodes}-{bs}-{i}" for i in range(bs)]
    prefixes = [300, 4000, 1500, 777][:bs]
    for r in eager:
        for s in seqs:
            r.add_seq(s)
    _both(eager, [SeqForward(s, tok(n)) for s, n in zip(seqs, prefixes)], f"prefixes {prefixes}")
    parents = [-1] + [rng.randrange(0, j) for j in range(1, num_nodes)]
    _both(eager, [SeqForward(s, tok(num_nodes), parents=parents, logits="all") for s in seqs],
          f"verify {num_nodes}-node trees bs{bs}")
    keep = _path(parents, num_nodes - 1)  # an accepted path, as the target keeps it
    for r in eager:
        for s in seqs:
            r.compact(s, keep)
    _both(eager, [SeqForward(s, tok(1)) for s in seqs], "decode after compaction")
    for r in eager:
        for s in seqs:
            r.free_seq(s)


def test_tree_region_over_several_forwards(eager):
    rng = random.Random(7)
    tok = _tokens(rng)
    for r in eager:
        r.add_seq("t")
        r.add_seq("o")
    _both(eager, [SeqForward("t", tok(900)), SeqForward("o", tok(250))], "prefixes")
    # Draft-style expansion: 4 roots, then children, then grandchildren (tails wider than the query); a plain
    # decode rides along in the same forwards.
    for k, step in enumerate([[-1, -1, -1, -1], [0, 0, 2, 3], [4, 5, 5, 7]]):
        _both(eager, [SeqForward("t", tok(len(step)), parents=step, logits="all"), SeqForward("o", tok(1))],
              f"region step {k}")
    for r in eager:
        r.compact("t", [1, 5, 9])
    _both(eager, [SeqForward("t", tok(1)), SeqForward("o", tok(1))], "decode after region compaction")


def _graph_kwargs(**kw) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in kw.items() if k in names}


def test_cuda_graph_replays_match_torch_backend():
    ndt = 16
    runners = [_runner("torch"), _runner("flashinfer", graphs=True, cuda_graph_max_bs=16,
                                         cuda_graph_num_draft_tokens=ndt)]
    gr = runners[1].graph_runner
    assert gr is not None and (16, 1) in gr.graphs and (16, ndt) in gr.graphs, "flashinfer graphs not captured"
    replays = []
    original = gr.replay

    def counting(key, *args, **kwargs):
        replays.append(key)
        return original(key, *args, **kwargs)

    gr.replay = counting
    rng = random.Random(3)
    tok = _tokens(rng)
    seqs = [f"g{i}" for i in range(11)]  # 11 sequences: the 16-bucket pads 5
    for r in runners:
        for s in seqs:
            r.add_seq(s)
    lens = [3000, 1, 500, 64, 2048, 17, 1200, 90, 4000, 256, 33]
    for first in range(0, 11, 4):
        _both(runners, [SeqForward(s, tok(n)) for s, n in zip(seqs[first:first + 4], lens[first:first + 4])],
              "prefill")
    assert not replays
    for step in range(3):
        _both(runners, [SeqForward(s, tok(1)) for s in seqs], f"graph decode bs11 (bucket 16) step {step}")
        _both(runners, [SeqForward(seqs[0], tok(1))], f"graph decode bs1 step {step}")
    assert replays.count((16, 1)) == 3 and replays.count((1, 1)) == 3, replays
    parents = [-1] + [rng.randrange(0, j) for j in range(1, ndt)]
    for bs, bucket in ((1, 1), (4, 4), (3, 3), (11, 16)):
        _both(runners, [SeqForward(s, tok(ndt), parents=parents, logits="all") for s in seqs[:bs]],
              f"graph verify {ndt}-node trees bs{bs}")
        assert replays[-1] == (bucket, ndt), replays
        for r in runners:
            for s in seqs[:bs]:
                r.compact(s, _path(parents, ndt - 1 - bs))
    _both(runners, [SeqForward(s, tok(1)) for s in seqs], "graph decode after compaction")


def test_cuda_graphs_with_wide_draft_masks():
    """A draft's tree steps (topk nodes per forward, tails up to num_steps * topk) in graphs, when the engine can
    capture them (EngineConfig.cuda_graph_mask_width)."""
    extra = _graph_kwargs(cuda_graph_mask_width=12, cuda_graph_num_draft_tokens=4)
    if "cuda_graph_mask_width" not in extra:
        pytest.skip("this engine has no cuda_graph_mask_width")
    runners = [_runner("torch"), _runner("flashinfer", graphs=True, **extra)]
    gr = runners[1].graph_runner
    replays = []
    original = gr.replay
    gr.replay = lambda key, *a, **k: (replays.append(key), original(key, *a, **k))[1]
    rng = random.Random(5)
    tok = _tokens(rng)
    seqs = ["d0", "d1", "d2"]
    for r in runners:
        for s in seqs:
            r.add_seq(s)
    _both(runners, [SeqForward(s, tok(n)) for s, n in zip(seqs, [700, 30, 1600])], "prefill")
    for k, step in enumerate([[-1, -1, -1, -1], [0, 0, 1, 3], [4, 4, 6, 7]]):
        _both(runners, [SeqForward(s, tok(4), parents=step, logits="all") for s in seqs], f"draft step {k}")
    for r in runners:  # drop the region; grow a new one a node per forward: decode-shaped graphs, tree tails
        for s in seqs:
            r.truncate(s, r.kv_len(s) - 12)
    for k, step in enumerate([[-1], [0], [1]]):
        _both(runners, [SeqForward(s, tok(1), parents=step, logits="all") for s in seqs], f"chain draft step {k}")
    assert replays, "no graph replayed"
