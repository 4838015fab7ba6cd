"""Helpers shared by the Triton launchers: layout assertions and the interpreter switch.

Imports nothing from triton, so the launchers can use it before touching the GPU.
"""

from __future__ import annotations

import os

import torch

# Dtypes the attention kernels accept for queries and KV.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read by triton at import).

    The interpreter's tl.dot mis-computes bf16 operands, so kernels upcast to fp32 before dot when this is set."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check(cond: bool, msg: str) -> None:
    """Layout-contract assertion that survives `python -O` (a bad stride would otherwise read garbage silently)."""
    if not cond:
        raise ValueError(msg)


def check_index(t: torch.Tensor, name: str, ndim: int, device: torch.device) -> None:
    check(t.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {t.dtype}")
    check(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    check(t.is_contiguous(), f"{name} must be contiguous")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
