"""Triton kernels against their torch references at Llama-3.1-8B attention shapes (32 query heads, 8 KV heads,
head_dim 128, bf16, pages of 16): batches up to 64, prefixes up to 4k, trees of 16-64 nodes, and the decode and
verify steps captured in a CUDA graph and replayed with new contents (no host sync, fixed shapes)."""

from __future__ import annotations

import random

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem_kernels.compact_kv import compact_kv, compact_kv_ref  # noqa: E402
from tandem_kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from tandem_kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from tandem_kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from tandem_kernels.verify_greedy import verify_tree_greedy, verify_tree_greedy_ref  # noqa: E402
from tests.kernels.paged import ancestor_mask, make_batch, random_parents  # noqa: E402

NH, KVH, HD, PAGE = 32, 8, 128, 16
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _batch(prefix_lens, query_lens, tree, seed, **kw):
    return make_batch(prefix_lens, query_lens, tree, num_heads=NH, num_kv_heads=KVH, head_dim=HD, block_size=PAGE,
                      dtype=torch.bfloat16, device="cuda", seed=seed, **kw)


def _compare(batch, **kw):
    scale = HD**-0.5
    got = paged_attention(*batch.args(), scale, batch.max_query_len, batch.tree_mask, batch.use_tree, **kw)
    want = paged_attention_ref(*batch.args(), scale, batch.max_query_len, batch.tree_mask, batch.use_tree)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)


@pytest.mark.parametrize("num_seqs", [1, 16, 64])
def test_decode_attention_8b_shapes(num_seqs):
    rng = random.Random(num_seqs)
    prefix = [rng.randrange(1, 4096) for _ in range(num_seqs)]
    prefix[0] = 4095  # the longest context always present
    batch = _batch(prefix, [1] * num_seqs, [False] * num_seqs, seed=num_seqs)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.kv_lens, HD**-0.5)
    torch.testing.assert_close(decode_attention(*args).float(), decode_attention_ref(*args).float(), **BF16_TOL)


@pytest.mark.parametrize("num_seqs,num_nodes", [(1, 64), (8, 16), (32, 32), (64, 64)])
def test_tree_attention_8b_shapes(num_seqs, num_nodes):
    rng = random.Random(num_nodes)
    prefix = [rng.randrange(1, 4096) for _ in range(num_seqs)]
    batch = _batch(prefix, [num_nodes] * num_seqs, [True] * num_seqs, seed=num_seqs + num_nodes)
    _compare(batch)


def test_tree_region_over_several_forwards_and_mixed_batch():
    # Trees whose earlier nodes came in earlier forwards, next to chain extends and decodes.
    batch = _batch([1000, 3000, 17, 2048, 512], [16, 8, 300, 1, 24], [True, True, False, False, True], seed=7,
                   region_lens=[48, 40, 300, 1, 24])
    _compare(batch)


@pytest.mark.parametrize("block_m,block_n", [(16, 64), (64, 64), (128, 32)])
def test_chain_prefill_8b_shapes(block_m, block_n):
    batch = _batch([0, 1500, 37, 4000], [1024, 512, 777, 96], [False] * 4, seed=11)
    _compare(batch, block_m=block_m, block_n=block_n)


def test_store_kv_8b_shapes():
    num_tokens, num_blocks = 64 * 64, 1024
    fused = torch.randn(num_tokens, (NH + 2 * KVH) * HD, device="cuda", dtype=torch.bfloat16)
    k = fused[:, NH * HD:(NH + KVH) * HD].view(num_tokens, KVH, HD)
    v = fused[:, (NH + KVH) * HD:].view(num_tokens, KVH, HD)
    slots = torch.randperm(num_blocks * PAGE, device="cuda")[:num_tokens]
    slots[::7] = -1
    caches = [torch.zeros(num_blocks, PAGE, KVH, HD, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_compact_kv_8b_shapes():
    rng = random.Random(0)
    num_layers, num_blocks = 32, 1024
    kv = torch.randn(num_layers, 2, num_blocks, PAGE, KVH, HD, device="cuda", dtype=torch.bfloat16)
    src, dst = [], []
    for b in range(64):  # 64 sequences, each with a 64-node region at a random offset in its own 8 pages
        base = b * 8 * PAGE + rng.randrange(0, 32)
        path = sorted(rng.sample(range(1, 64), rng.randrange(0, 9)))
        for i, node in enumerate([0] + path):
            if node != i:
                src.append(base + node)
                dst.append(base + i)
    src_t = torch.tensor(src + [-1] * 5, dtype=torch.int32, device="cuda")
    dst_t = torch.tensor(dst + [0] * 5, dtype=torch.int32, device="cuda")
    want = kv.clone()
    compact_kv_ref(want, src_t, dst_t)
    compact_kv(kv, src_t, dst_t)
    assert torch.equal(kv, want)


def _verify_inputs(num_seqs, num_nodes, seed):
    rng = random.Random(seed)
    par = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    cand = torch.zeros(num_seqs, num_nodes, dtype=torch.int64)
    pred = torch.zeros(num_seqs, num_nodes, dtype=torch.int64)
    for b in range(num_seqs):
        for m in range(1, num_nodes):
            par[b, m] = rng.randrange(0, m)
            cand[b, m] = rng.randrange(4)
        for m in range(num_nodes):
            children = [c for c in range(1, num_nodes) if par[b, c] == m]
            pred[b, m] = cand[b, rng.choice(children)] if children and rng.random() < 0.8 else rng.randrange(4)
    return cand.cuda(), par.cuda(), pred.cuda()


@pytest.mark.parametrize("num_seqs,num_nodes", [(1, 8), (64, 16), (64, 65)])
def test_verify_tree_greedy_real_sizes(num_seqs, num_nodes):
    cand, par, pred = _verify_inputs(num_seqs, num_nodes, seed=num_nodes)
    for got, want in zip(verify_tree_greedy(cand, par, pred), verify_tree_greedy_ref(cand, par, pred)):
        assert torch.equal(got, want)


def test_verify_step_replays_in_a_cuda_graph():
    """store_kv + tree attention + greedy verify captured once, replayed with other prefixes, trees and pages."""
    num_seqs, num_nodes, max_blocks, num_blocks = 8, 32, 260, 8 * 260 + 4
    n = num_seqs * num_nodes
    k_cache = torch.randn(num_blocks, PAGE, KVH, HD, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    static = dict(
        q=torch.zeros(n, NH, HD, device="cuda", dtype=torch.bfloat16),
        k=torch.zeros(n, KVH, HD, device="cuda", dtype=torch.bfloat16),
        v=torch.zeros(n, KVH, HD, device="cuda", dtype=torch.bfloat16),
        slots=torch.zeros(n, dtype=torch.int64, device="cuda"),
        tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda"),
        query_start=torch.arange(0, n + 1, num_nodes, dtype=torch.int32, device="cuda"),
        kv_lens=torch.zeros(num_seqs, dtype=torch.int32, device="cuda"),
        prefix_lens=torch.zeros(num_seqs, dtype=torch.int32, device="cuda"),
        tree_mask=torch.zeros(n, num_nodes, dtype=torch.bool, device="cuda"),
        use_tree=torch.ones(num_seqs, dtype=torch.bool, device="cuda"),
        out=torch.zeros(n, NH, HD, device="cuda", dtype=torch.bfloat16),
        cand=torch.zeros(num_seqs, num_nodes, dtype=torch.int64, device="cuda"),
        parents=torch.zeros(num_seqs, num_nodes, dtype=torch.int32, device="cuda"),
        pred=torch.zeros(num_seqs, num_nodes, dtype=torch.int64, device="cuda"),
    )
    s = static

    def step():
        store_kv(s["k"], s["v"], k_cache, v_cache, s["slots"])
        paged_attention(s["q"], k_cache, v_cache, s["tables"], s["query_start"], s["kv_lens"], s["prefix_lens"],
                        HD**-0.5, num_nodes, s["tree_mask"], s["use_tree"], out=s["out"])
        return verify_tree_greedy(s["cand"], s["parents"], s["pred"])

    def fill(seed):
        rng = random.Random(seed)
        blocks = list(range(num_blocks))
        rng.shuffle(blocks)
        prefix = [rng.randrange(0, 4000) for _ in range(num_seqs)]
        s["tables"].copy_(torch.tensor([blocks[b * max_blocks:(b + 1) * max_blocks] for b in range(num_seqs)]))
        s["prefix_lens"].copy_(torch.tensor(prefix))
        s["kv_lens"].copy_(torch.tensor([p + num_nodes for p in prefix]))
        tables = s["tables"].cpu()
        slots = [int(tables[b, j // PAGE]) * PAGE + j % PAGE for b in range(num_seqs)
                 for j in range(prefix[b], prefix[b] + num_nodes)]
        s["slots"].copy_(torch.tensor(slots))
        s["tree_mask"].copy_(torch.cat([ancestor_mask(random_parents(num_nodes, rng)) for _ in range(num_seqs)]))
        for name in ("q", "k", "v"):
            s[name].normal_()
        cand, par, pred = _verify_inputs(num_seqs, num_nodes, seed)
        s["cand"].copy_(cand)
        s["parents"].copy_(par)
        s["pred"].copy_(pred)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_out = step()
    for seed in (1, 2):
        fill(seed)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        store_kv_ref(s["k"], s["v"], k_before, v_before, s["slots"])
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
        want = paged_attention_ref(s["q"], k_cache, v_cache, s["tables"], s["query_start"], s["kv_lens"],
                                   s["prefix_lens"], HD**-0.5, num_nodes, s["tree_mask"], s["use_tree"])
        torch.testing.assert_close(s["out"].float(), want.float(), **BF16_TOL)
        for got, ref in zip(verify_out, verify_tree_greedy_ref(s["cand"], s["parents"], s["pred"])):
            assert torch.equal(got, ref)
