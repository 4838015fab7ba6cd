"""compact_kv (Triton) against compact_kv_ref (KVPool.copy_slots semantics) for accepted-path moves."""

from __future__ import annotations

import random

import pytest
import torch

from tandem_kernels.compact_kv import compact_kv, compact_kv_ref
from runtime.kv_pool import KVPool


def _path_moves(region_starts: list[int], paths: list[list[int]], block_size: int, tables: list[list[int]]):
    """Flat (src, dst) slots moving each sequence's accepted region nodes to region_start + i."""
    src, dst = [], []
    for start, path, table in zip(region_starts, paths, tables):
        for i, node in enumerate(path):
            if node == i:
                continue
            for lst, idx in ((src, start + node), (dst, start + i)):
                lst.append(table[idx // block_size] * block_size + idx % block_size)
    return src, dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_moves", [1, 2, 16])
def test_compact_path_matches_ref(dtype, block_moves, device):
    rng = random.Random(block_moves)
    block_size, num_blocks = 4, 24
    pool = KVPool(3, num_blocks, block_size, 2, 16, dtype, device)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = [blocks[:8], blocks[8:16], blocks[16:]]
    region_starts = [5, 0, 13]
    # Accepted paths are increasing node lists starting at the root (node 0); the middle one needs no move at all.
    paths = [[0, 2, 5, 6, 11], [0, 1, 2], [0, 3, 4, 9, 15]]
    src, dst = _path_moves(region_starts, paths, block_size, tables)
    src += [-1, -1]  # padding moves, as a fixed-size graph batch would carry
    dst += [7, 0]
    src_t = torch.tensor(src, dtype=torch.int32, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int32, device=device)
    want = pool.kv.clone()
    compact_kv_ref(want, src_t, dst_t)
    compact_kv(pool.kv, src_t, dst_t, block_moves=block_moves)
    torch.testing.assert_close(pool.kv, want, atol=0, rtol=0)
    assert not torch.equal(want, pool.kv.new_zeros(()).expand_as(want))


def test_compact_within_a_chunk_reads_before_writing(device):
    # A swap only works if both sources are read before either destination is written.
    kv = torch.randn(2, 2, 2, 4, 1, 16, device=device)
    src = torch.tensor([1, 6], dtype=torch.int64, device=device)
    dst = torch.tensor([6, 1], dtype=torch.int64, device=device)
    want = kv.clone()
    compact_kv_ref(want, src, dst)
    compact_kv(kv, src, dst, block_moves=2)
    torch.testing.assert_close(kv, want, atol=0, rtol=0)


def test_compact_kv_asserts_layout(device):
    kv = torch.zeros(2, 2, 2, 4, 1, 16, device=device)
    idx = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        compact_kv(kv.transpose(2, 3), idx, idx)
    with pytest.raises(ValueError, match="same length"):
        compact_kv(kv, idx, idx[:1])
