"""Move KV entries between flat slots in every layer, K and V, in one launch: after a verify, the accepted path's
KV is copied from its tree positions to contiguous positions right after the prefix.

Moves are processed in chunks of `block_moves`: inside a chunk every source is read before any destination is
written; across chunks they run in the given order. So a move may not read a slot that an earlier chunk writes.
Accepted-path compaction satisfies this whatever the chunking: listed in path order, move i goes from region node
n_i to region index i with n_i >= i and n_i increasing, so no later source is an earlier destination.
A negative source slot is padding (no copy), so a CUDA graph can run a fixed number of moves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, check_index, next_pow2


@triton.jit
def _compact_kv_kernel(
    kv_ptr, src_ptr, dst_ptr, num_moves, plane_stride,
    SLOT_SIZE: tl.constexpr,  # elements per slot: kvh * hd
    BLOCK_MOVES: tl.constexpr, BLOCK_D: tl.constexpr,
):
    plane = tl.program_id(0).to(tl.int64)  # one (layer, K or V) plane of the pool
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < SLOT_SIZE
    base = kv_ptr + plane * plane_stride
    first = 0
    while first < num_moves:  # while, not range: see paged_attention (interpreter and loaded bounds)
        i = first + tl.arange(0, BLOCK_MOVES)
        src = tl.load(src_ptr + i, mask=i < num_moves, other=-1).to(tl.int64)
        dst = tl.load(dst_ptr + i, mask=i < num_moves, other=-1).to(tl.int64)
        ok = (src >= 0)[:, None] & d_ok[None, :]
        rows = tl.load(base + src[:, None] * SLOT_SIZE + d[None, :], mask=ok)  # (BLOCK_MOVES, BLOCK_D)
        # Another thread's move may write a slot this chunk reads (path 0,2,3: 2->1 reads what 3->2 writes): every
        # load of the chunk must be performed before any store of it.
        tl.debug_barrier()
        tl.store(base + dst[:, None] * SLOT_SIZE + d[None, :], rows, mask=ok)
        first += BLOCK_MOVES


def compact_kv(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, block_moves: int = 16) -> None:
    """kv: the whole pool (num_layers, 2, num_blocks, block_size, kvh, hd), contiguous; src_slots, dst_slots: (M,)
    flat slots, src -1 = no move. Copies slot src[i] -> dst[i] in every layer, K and V (see module docstring for
    the ordering contract)."""
    check(kv.dim() == 6 and kv.shape[1] == 2, f"kv must be (L, 2, num_blocks, block_size, kvh, hd), got {kv.shape}")
    check(kv.is_contiguous(), "kv must be contiguous")
    check(kv.dtype in FLOAT_DTYPES, f"kv dtype {kv.dtype} unsupported")
    check_index(src_slots, "src_slots", 1, kv.device)
    check_index(dst_slots, "dst_slots", 1, kv.device)
    check(src_slots.shape == dst_slots.shape, "src_slots and dst_slots must have the same length")
    check(block_moves == next_pow2(block_moves), "block_moves must be a power of 2")
    num_moves = src_slots.shape[0]
    if num_moves == 0:
        return
    num_planes = kv.shape[0] * 2
    slot_size = kv.shape[4] * kv.shape[5]
    block_d = min(256, next_pow2(slot_size))
    _compact_kv_kernel[(num_planes, triton.cdiv(slot_size, block_d))](
        kv, src_slots, dst_slots, num_moves, kv[0, 0].numel(),
        SLOT_SIZE=slot_size, BLOCK_MOVES=block_moves, BLOCK_D=block_d,
    )


def compact_kv_ref(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Gather every source, then scatter (KVPool.copy_slots semantics)."""
    flat = kv.view(kv.shape[0], 2, -1, *kv.shape[4:])  # (L, 2, slots, kvh, hd)
    keep = src_slots >= 0
    src, dst = src_slots[keep].long(), dst_slots[keep].long()
    flat[:, :, dst] = flat[:, :, src]
