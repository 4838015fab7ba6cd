"""CUDA graphs through ModelRunner on the GPU: decode and verify batches replayed from captured graphs (padded to a
bucket) give the eager triton/torch logits and the same greedy tokens; batches that do not fit a graph fall back to
eager; the KV pool sized by --mem-fraction-static profiling; a fraction too small is a typed error."""

from __future__ import annotations

import random

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.config import EngineConfig, ModelConfig  # noqa: E402
from runtime.memory import OutOfDeviceMemory  # noqa: E402
from runtime.model_runner import ModelRunner, SeqForward  # noqa: E402

# Llama-3.1-8B attention shapes, two layers, small MLP and vocab: quick to capture. float32, so that graph vs eager
# differences (other cuBLAS kernels for the padded row count, other split-KV chunks) stay far below near-ties of the
# random-weight logits and greedy tokens can be compared exactly.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=4096, num_layers=2, num_heads=32,
                     num_kv_heads=8, head_dim=128, intermediate_size=1024, max_position_embeddings=8192,
                     rope_theta=500000.0)
NDT = 16


def _runner(backend: str, graphs: bool, **kw) -> ModelRunner:
    cfg = dict(device="cuda", dtype="float32", load_format="dummy", block_size=16, max_total_tokens=65536,
               attention_backend=backend, seed=0, disable_cuda_graph=not graphs, cuda_graph_max_bs=16,
               cuda_graph_num_draft_tokens=NDT)
    return ModelRunner(None, EngineConfig(**{**cfg, **kw}), CONFIG)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max() + 1e-5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.99


@pytest.fixture(scope="module")
def runners():
    graph = _runner("triton", graphs=True)
    assert graph.graph_runner is not None and (16, NDT) in graph.graph_runner.graphs
    return graph, _runner("triton", graphs=False), _runner("torch", graphs=False)


def _all(runners, batch, expect_graph: bool):
    graph_runner = runners[0].graph_runner
    replays = {key: 0 for key in graph_runner.graphs}
    original = graph_runner.replay

    def counting(key, fb, *args, **kwargs):
        replays[key] += 1
        return original(key, fb, *args, **kwargs)

    graph_runner.replay = counting
    try:
        outs = [r.forward(batch) for r in runners]
    finally:
        graph_runner.replay = original
    assert (sum(replays.values()) == 1) == expect_graph
    for other in outs[1:]:
        _close(torch.cat(outs[0].logits), torch.cat(other.logits))
    return outs


def test_graphs_match_eager_for_decode_and_verify_with_padding(runners):
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    seqs = [f"s{i}" for i in range(11)]  # 11 sequences: the 16-bucket pads 5
    for r in runners:
        for s in seqs:
            r.add_seq(s)
    prompt_lens = [rng.randrange(1, 3000) for _ in seqs]
    _all(runners, [SeqForward(s, tok(n)) for s, n in zip(seqs, prompt_lens)], expect_graph=False)  # prefill: eager
    for _ in range(3):
        _all(runners, [SeqForward(s, tok(1)) for s in seqs], expect_graph=True)  # decode
        _all(runners, [SeqForward(s, tok(1)) for s in seqs[:3]], expect_graph=True)  # bucket 3, no padding
    parents = [-1] + [rng.randrange(0, j) for j in range(1, NDT)]
    _all(runners, [SeqForward(s, tok(NDT), parents=parents, logits="all") for s in seqs], expect_graph=True)
    path, node = [], NDT - 1
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    for r in runners:
        for s in seqs:
            r.compact(s, path)
    # Greedy decode continues identically after compaction, from graphs and eager.
    next_ids = {s: rng.randrange(3, 2048) for s in seqs}
    for _ in range(4):
        outs = _all(runners, [SeqForward(s, [next_ids[s]]) for s in seqs], expect_graph=True)
        next_ids = {s: int(o[-1].argmax()) for s, o in zip(seqs, outs[0].logits)}
    # Mixed widths and oversize batches run eager.
    _all(runners, [SeqForward(seqs[0], tok(2), logits="all"), SeqForward(seqs[1], tok(1))], expect_graph=False)


def test_padding_rows_never_write_kv(runners):
    graph = runners[0]
    probes = [f"pad{i}" for i in range(9)]  # the 16-bucket: 7 padding sequences
    for s in probes:
        graph.add_seq(s)
    before = graph.kv_pool.kv.clone()
    graph.forward([SeqForward(s, [5 + i]) for i, s in enumerate(probes)])
    written = {slot for s in probes for slot in graph.block_manager.slots(s, 0, 1)}
    flat = (graph.kv_pool.kv != before).flatten(2, 3)  # (L, 2, slots, kvh, hd)
    changed = flat.any(dim=4).any(dim=3).any(dim=1).any(dim=0).nonzero().flatten().tolist()
    assert changed and set(changed) <= written
    for s in probes:
        graph.free_seq(s)


def test_mem_fraction_static_sizes_the_kv_pool_by_profiling():
    runner = _runner("triton", graphs=False, mem_fraction_static=0.3)
    plan = runner.memory_plan
    assert plan is not None and plan.num_kv_blocks == runner.block_manager.num_blocks > 0
    assert plan.weights_bytes + plan.kv_bytes <= 0.3 * plan.total_bytes
    assert plan.activation_peak_bytes > 0
    del runner
    with pytest.raises(OutOfDeviceMemory, match="mem-fraction-static"):
        _runner("triton", graphs=False, mem_fraction_static=0.0001)
