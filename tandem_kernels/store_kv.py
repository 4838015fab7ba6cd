"""Write new tokens' K/V into one layer's paged cache at flat slots (slot = block * block_size + offset).

Owns only the scatter; which slots a token gets is the block manager's business. A negative slot means "padding
row, write nothing", so a CUDA graph can run a fixed-size batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, check_index, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # over (kv head, dim) of one token
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    inside = (offs < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=inside)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=inside)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs  # the cache is contiguous: a slot is kvh * hd elements
    tl.store(k_cache_ptr + dst, k, mask=inside)
    tl.store(v_cache_ptr + dst, v, mask=inside)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (N, kvh, hd), last dim contiguous; k_cache, v_cache: (num_blocks, block_size, kvh, hd) or
    (num_slots, kvh, hd), contiguous, k's dtype; slot_mapping: (N,) int32/int64, -1 = skip the row."""
    check(k.dim() == 3 and v.shape == k.shape, f"k, v must be (N, kvh, hd), got {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    check(k.stride(2) == 1 and v.stride(2) == 1, "k, v must be contiguous in head_dim")
    check(k.dtype in FLOAT_DTYPES and v.dtype == k.dtype, f"k, v dtype {k.dtype}/{v.dtype} unsupported")
    check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k_cache and v_cache must match")
    # No casting here: the interpreter rounds fp32 -> bf16 differently from torch, and the engine never needs it.
    check(k_cache.dtype == k.dtype, f"k dtype {k.dtype} != cache dtype {k_cache.dtype}")
    check(k_cache.dim() in (3, 4) and tuple(k_cache.shape[-2:]) == (num_kv_heads, head_dim),
          f"cache shape {tuple(k_cache.shape)} does not end in (kvh={num_kv_heads}, hd={head_dim})")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    check(k_cache.device == k.device, "cache and k must be on one device")
    check_index(slot_mapping, "slot_mapping", 1, k.device)
    check(slot_mapping.shape[0] == num_tokens, f"slot_mapping has {slot_mapping.shape[0]} rows for {num_tokens}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=next_pow2(num_kv_heads * head_dim),
    )


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[-2:])  # (slots, kvh, hd)
    flat_v = v_cache.view(-1, *v_cache.shape[-2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k[slots] = k[keep]
    flat_v[slots] = v[keep]
