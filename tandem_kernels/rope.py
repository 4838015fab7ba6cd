"""Rotary embedding applied in place to q and k in one launch (rotate-half / neox layout, as the Llama family uses).

cos/sin come in the model's layout: one row per token (or per position, then picked by `positions`), last dim
head_dim holding cat(freqs, freqs), so the kernel reads only the first half. Numerics follow the torch path
`q * cos + rotate_half(q) * sin` in the tensor's dtype: each product and the sum are rounded to q's dtype, so a bf16
model sees the same values as today. Replaces ~10 tiny torch kernels per layer (mul, neg, cat, mul, add for q and k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, check_index, next_pow2

HEADS_PER_PROGRAM = 4


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, head0, num_heads, c, s,
                  HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    h = head0 + tl.arange(0, HEADS)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < num_heads) & (d[None, :] < HALF)
    lo_ptr = ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
    lo = tl.load(lo_ptr, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = ptr.dtype.element_ty
    # out_lo = lo*cos - hi*sin, out_hi = hi*cos + lo*sin, rounding each product as the torch path does.
    new_lo = (lo * c).to(dt).to(tl.float32) - (hi * s).to(dt).to(tl.float32)
    new_hi = (hi * c).to(dt).to(tl.float32) + (lo * s).to(dt).to(tl.float32)
    tl.store(lo_ptr, new_lo.to(dt), mask=ok)
    tl.store(lo_ptr + HALF, new_hi.to(dt), mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_q_heads, num_k_heads, q_programs,
    HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # the first q_programs groups of heads are q's, the rest k's
    if HAS_POS:
        row = tl.load(pos_ptr + token).to(tl.int64)
    else:
        row = token
    d = tl.arange(0, BLOCK_D)
    c = tl.load(cos_ptr + row * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + row * stride_sin + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    if group < q_programs:
        _rotate_heads(q_ptr, stride_qt, stride_qh, token, group * HEADS, num_q_heads, c, s,
                      HALF=HALF, HEADS=HEADS, BLOCK_D=BLOCK_D)
    else:
        _rotate_heads(k_ptr, stride_kt, stride_kh, token, (group - q_programs) * HEADS, num_k_heads, c, s,
                      HALF=HALF, HEADS=HEADS, BLOCK_D=BLOCK_D)


def _table(t: torch.Tensor, name: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos/sin as (rows, head_dim): accepts the model's (rows, 1, head_dim) broadcast layout too."""
    if t.dim() == 3:
        check(t.shape[1] == 1, f"{name} must be (rows, head_dim) or (rows, 1, head_dim), got {tuple(t.shape)}")
        t = t[:, 0]
    check(t.dim() == 2 and t.shape[1] == head_dim, f"{name} must have last dim head_dim={head_dim}, got {tuple(t.shape)}")
    check(t.stride(1) == 1, f"{name} must be contiguous in its last dim")
    check(t.device == device, f"{name} is on {t.device}, q on {device}")
    check(t.dtype == dtype, f"{name} dtype {t.dtype} != q dtype {dtype}")
    return t


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
) -> None:
    """Rotate q (N, nh, hd) and k (N, kvh, hd) in place; both contiguous in hd, other strides free (views of a fused
    qkv output). cos/sin: (R, hd) or (R, 1, hd) in q's dtype, rows laid out as cat(f, f). Without positions, row i
    serves token i (R == N); with positions (N,) int32/int64, token i uses row positions[i] (R = the table size; the
    caller keeps positions < R, as nothing here can check without a host sync)."""
    check(q.dim() == 3 and k.dim() == 3, f"q, k must be (N, heads, hd), got {tuple(q.shape)}, {tuple(k.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    check(k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q, k must be contiguous in head_dim")
    check(q.dtype in FLOAT_DTYPES and k.dtype == q.dtype, f"q, k dtype {q.dtype}/{k.dtype} unsupported")
    check(k.device == q.device, "q and k must be on one device")
    cos = _table(cos, "cos", head_dim, q.device, q.dtype)
    sin = _table(sin, "sin", head_dim, q.device, q.dtype)
    check(sin.shape[0] == cos.shape[0], "cos and sin must have the same rows")
    if positions is not None:
        check_index(positions, "positions", 1, q.device)
        check(positions.shape[0] == num_tokens, f"positions has {positions.shape[0]} rows for {num_tokens} tokens")
    else:
        check(cos.shape[0] == num_tokens, f"cos has {cos.shape[0]} rows for {num_tokens} tokens (pass positions)")
    if num_tokens == 0:
        return
    heads = min(HEADS_PER_PROGRAM, next_pow2(max(num_q_heads, k.shape[1], 1)))
    q_programs = triton.cdiv(num_q_heads, heads)
    grid = (num_tokens, q_programs + triton.cdiv(k.shape[1], heads))
    _rope_kernel[grid](
        q, k, cos, sin, positions if positions is not None else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_q_heads, k.shape[1], q_programs,
        HALF=head_dim // 2, HEADS=heads, BLOCK_D=next_pow2(head_dim // 2), HAS_POS=positions is not None,
        num_warps=1 if head_dim * heads <= 256 else 2,
        # No fma contraction: `lo*cos - hi*sin` fused into one fma would skip rounding hi*sin, which torch does.
        enable_fp_fusion=False,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
) -> None:
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    q.copy_(q * cos + _rotate_half(q) * sin)
    k.copy_(k * cos + _rotate_half(k) * sin)
