"""paged_attention / decode_attention (Triton) against their plain-torch references: chain appends, decode, trees
over a paged prefix, trees spanning several forwards, mixed batches, GQA groups, fp32/fp16/bf16."""

from __future__ import annotations

import pytest
import torch

from tandem_kernels.decode_attention import decode_attention, decode_attention_ref
from tandem_kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.paged import make_batch

# On GPU the kernel feeds p to the PV dot in the input dtype; the tolerances cover that rounding.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4, 16), (4, 2, 32), (6, 2, 24)]  # (num_heads, num_kv_heads, head_dim): MHA, GQA, odd group and hd


def _check(batch, dtype, **kw):
    got = paged_attention(*batch.args(), 0.3, batch.max_query_len, batch.tree_mask, batch.use_tree, **kw)
    want = paged_attention_ref(*batch.args(), 0.3, batch.max_query_len, batch.tree_mask, batch.use_tree)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_chain_append_matches_ref(dtype, heads, device):
    nh, kvh, hd = heads
    batch = make_batch([0, 5, 13], [7, 3, 1], [False] * 3, num_heads=nh, num_kv_heads=kvh, head_dim=hd,
                       block_size=4, dtype=dtype, device=device, seed=1)
    _check(batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_tree_append_over_paged_prefix_matches_ref(dtype, heads, device):
    nh, kvh, hd = heads
    batch = make_batch([9, 0, 21], [6, 5, 11], [True] * 3, num_heads=nh, num_kv_heads=kvh, head_dim=hd,
                       block_size=4, dtype=dtype, device=device, seed=2)
    _check(batch, dtype)


def test_tree_region_spanning_forwards_matches_ref(device):
    # Queries are the last nodes of a region whose earlier nodes were appended by an earlier forward.
    batch = make_batch([10, 3], [4, 2], [True, True], region_lens=[9, 6], num_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=4, dtype=torch.float32, device=device, seed=3)
    _check(batch, torch.float32)


def test_mixed_chain_and_tree_batch_ignores_chain_mask_rows(device):
    batch = make_batch([5, 12, 0], [3, 4, 6], [False, True, False], num_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=8, dtype=torch.float32, device=device, seed=4)
    _check(batch, torch.float32)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64)])
def test_tiling_does_not_change_results(block_m, block_n, device):
    # Several query tiles per sequence and key blocks that straddle pages and the prefix/tree boundary.
    batch = make_batch([37, 2], [20, 9], [True, False], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, device=device, seed=5)
    _check(batch, torch.float32, block_m=block_m, block_n=block_n)


def test_tree_node_sees_only_ancestors(device):
    # A direct check independent of the reference: a chain-shaped mask must equal a causal chain append.
    batch = make_batch([6], [5], [False], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                       dtype=torch.float32, device=device, seed=6)
    causal = paged_attention(*batch.args(), 0.3, 5)
    tree_mask = torch.ones(5, 5, dtype=torch.bool, device=device).tril()
    use_tree = torch.ones(1, dtype=torch.bool, device=device)
    as_tree = paged_attention(*batch.args(), 0.3, 5, tree_mask, use_tree)
    torch.testing.assert_close(as_tree, causal)
    tree_mask[4, 2] = False  # dropping one ancestor must change the last row only
    pruned = paged_attention(*batch.args(), 0.3, 5, tree_mask, use_tree)
    torch.testing.assert_close(pruned[:4], causal[:4])
    assert not torch.allclose(pruned[4], causal[4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_matches_ref(dtype, heads, device):
    nh, kvh, hd = heads
    batch = make_batch([0, 4, 17, 30], [1, 1, 1, 1], [False] * 4, num_heads=nh, num_kv_heads=kvh, head_dim=hd,
                       block_size=4, dtype=dtype, device=device, seed=7)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.kv_lens, 0.25)
    torch.testing.assert_close(decode_attention(*args).float(), decode_attention_ref(*args).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_layout_contract_is_asserted(device):
    batch = make_batch([4], [2], [False], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(batch.q.half(), *batch.args()[1:], 0.3, 2)
    with pytest.raises(ValueError, match="contiguous in hd"):
        paged_attention(batch.q.transpose(1, 2).contiguous().transpose(1, 2), *batch.args()[1:], 0.3, 2)
    with pytest.raises(ValueError, match="group"):
        paged_attention(batch.q[:, :3], *batch.args()[1:], 0.3, 2)
    with pytest.raises(ValueError, match="use_tree"):
        paged_attention(*batch.args(), 0.3, 2, torch.ones(2, 2, dtype=torch.bool, device=device))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_matches_ref(num_splits, dtype, device):
    # Chains, trees and decodes, with chunks that end up empty (short kv) and chunks fully masked for causal rows.
    batch = make_batch([37, 0, 5, 60], [9, 7, 1, 1], [True, False, False, False], num_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=4, dtype=dtype, device=device, seed=8)
    _check(batch, dtype, num_splits=num_splits, block_n=16)


def test_split_kv_decode_matches_unsplit(device):
    batch = make_batch([0, 4, 17, 70], [1, 1, 1, 1], [False] * 4, num_heads=6, num_kv_heads=2, head_dim=24,
                       block_size=4, dtype=torch.float32, device=device, seed=9)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.kv_lens, 0.25)
    torch.testing.assert_close(decode_attention(*args, num_splits=5), decode_attention(*args, num_splits=1),
                               atol=1e-5, rtol=1e-5)
