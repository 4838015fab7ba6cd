"""silu(gate) * up over the fused gate_up projection output, in one launch (torch runs silu, then the product).

Numerics follow `F.silu(gate) * up` in the tensor's dtype: silu in fp32 rounded to the dtype, then the product
rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels._common import FLOAT_DTYPES, check

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (act * up).to(dt), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (N, 2I), contiguous in the last dim, gate = x[:, :I], up = x[:, I:]. Returns a new (N, I) tensor."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be (N, 2I), got {tuple(x.shape)}")
    check(x.stride(1) == 1, "x must be contiguous in its last dim")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} unsupported")
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(width, block))](
        x, out, x.stride(0), width, BLOCK=block, num_warps=max(1, min(4, block // 256)),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
