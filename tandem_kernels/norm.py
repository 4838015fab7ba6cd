"""RMSNorm, residual add + RMSNorm in one pass, and two RMSNorms side by side in one output (EAGLE-3's input pair),
for the decoder's per-layer norms.

Numerics follow runtime/models/llama.py's torch RMSNorm exactly: fp32 statistics, the normalized row rounded to the
input dtype, then multiplied by the weight in the promoted dtype (as `weight * x32.to(dtype)` does). The residual sum
is rounded to the input dtype before the norm reads it, as `h + x` in bf16 does. One program per row; in the decode
step this replaces ~8 tiny torch kernels per norm with one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check, next_pow2

MAX_DIM = 65536  # one row lives in one program's registers


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps,
    inner, stride_xa, stride_xb, stride_ra, stride_rb,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a = row // inner  # rows of a 3-D input (A, B, D) are (a, b) pairs, so strided head views need no copy
    b = row % inner
    offs = tl.arange(0, BLOCK)
    ok = offs < DIM
    x_src = x_ptr + a * stride_xa + b * stride_xb + offs
    x = tl.load(x_src, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + a * stride_ra + b * stride_rb + offs, mask=ok, other=0.0).to(tl.float32)
        # The sum is rounded to the stream dtype (as torch's `h + x`) and becomes the new residual stream, in x.
        s = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(x_src, s, mask=ok)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / DIM
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * DIM + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_pair_kernel(
    a_ptr, b_ptr, wa_ptr, wb_ptr, out_ptr, eps_a, eps_b, stride_a, stride_b, stride_out,
    DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    # program (row, 0) norms a's row into out[row, :DIM], (row, 1) b's into out[row, DIM:]: the math of
    # _rms_norm_kernel per row, so the pair equals two rms_norm calls and a cat bit for bit
    row = tl.program_id(0).to(tl.int64)
    second = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < DIM
    if second == 0:
        x = tl.load(a_ptr + row * stride_a + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(wa_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        eps = eps_a
    else:
        x = tl.load(b_ptr + row * stride_b + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(wb_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        eps = eps_b
    var = tl.sum(x * x, axis=0) / DIM
    normed = (x * tl.rsqrt(var + eps)).to(a_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + second * DIM + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(rows, inner, stride_a, stride_b) of a 2-D (R, D) or 3-D (A, B, D) tensor contiguous in D."""
    check(t.dim() in (2, 3), f"{name} must be (rows, dim) or (A, B, dim), got shape {tuple(t.shape)}")
    check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} unsupported")
    check(weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_contiguous(),
          f"weight must be contiguous ({x.shape[-1]},), got {tuple(weight.shape)}")
    check(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    check(0 < x.shape[-1] <= MAX_DIM, f"dim {x.shape[-1]} outside 1..{MAX_DIM}")
    rows, inner, sxa, sxb = _rows(x, "x")
    sra = srb = 0
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device,
              f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
        _, _, sra, srb = _rows(residual, "residual")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows == 0:
        return out
    block = next_pow2(x.shape[-1])
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, float(eps),
        inner, sxa, sxb, sra, srb,
        DIM=x.shape[-1], BLOCK=block, HAS_RES=residual is not None, num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim. x: (R, D) or (A, B, D), contiguous in D (other strides free, e.g. a
    head view of a fused qkv output); weight: (D,). Returns a new contiguous tensor of x's shape in the promoted dtype."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x += residual in place (x becomes the new residual stream), then (weight * rmsnorm(x), x).

    The sum goes into x, the fresh output of the previous sublayer, rather than into residual: the caller's stream
    tensor is never modified, so a captured copy of it (EAGLE3's aux hidden states) stays valid without a clone."""
    return _launch(x, residual, weight, eps), x


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor, eps_a: float,
                  eps_b: float) -> torch.Tensor:
    """torch.cat([weight_a * rmsnorm(a), weight_b * rmsnorm(b)], dim=-1) in one launch (EAGLE-3's decoder input:
    the token embedding and the feature, each normed, side by side; was two norms and a cat). a, b: (R, D) of one
    dtype, contiguous in D; weights (D,) of one dtype. Returns a new (R, 2D) tensor in the promoted dtype."""
    check(a.dim() == 2 and b.shape == a.shape, f"a and b must be (rows, dim) of one shape, got {tuple(a.shape)} "
                                               f"and {tuple(b.shape)}")
    check(a.dtype in FLOAT_DTYPES and b.dtype == a.dtype, f"a {a.dtype} and b {b.dtype} must share a float dtype")
    check(a.stride(-1) == 1 and b.stride(-1) == 1, "a and b must be contiguous in their last dim")
    dim = a.shape[-1]
    for name, w in (("weight_a", weight_a), ("weight_b", weight_b)):
        check(w.dim() == 1 and w.shape[0] == dim and w.is_contiguous() and w.dtype == weight_a.dtype,
              f"{name} must be contiguous ({dim},) of one dtype with the other weight, got {tuple(w.shape)} {w.dtype}")
        check(w.device == a.device, f"{name} is on {w.device}, a on {a.device}")
    check(b.device == a.device, f"b is on {b.device}, a on {a.device}")
    check(0 < dim <= MAX_DIM, f"dim {dim} outside 1..{MAX_DIM}")
    out = torch.empty(a.shape[0], 2 * dim, dtype=torch.promote_types(weight_a.dtype, a.dtype), device=a.device)
    if a.shape[0] == 0:
        return out
    block = next_pow2(dim)
    _rms_norm_pair_kernel[(a.shape[0], 2)](
        a, b, weight_a, weight_b, out, float(eps_a), float(eps_b), a.stride(0), b.stride(0), out.stride(0),
        DIM=dim, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x.copy_(residual + x)
    return rms_norm_ref(x, weight, eps), x
