"""Attention backends behind a registry keyed by name ("torch", later "triton", "flashinfer").

Backends are imported lazily by module path so GPU-only ones never load on a CPU box. Contract of a backend:
`init_forward_metadata(batch)` once per forward, then `forward(layer, q, k, v, kv_pool)` per layer, which writes the
new K/V at `batch.slot_mapping` and returns attention output (N, num_heads * head_dim).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from runtime.forward_batch import ForwardBatch
    from runtime.kv_pool import KVPool


class AttentionBackend:
    """Base class: one instance per model runner; holds per-forward metadata between layers."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool
    ) -> torch.Tensor:
        """q: (N, num_heads, hd); k, v: (N, kvh, hd) -> (N, num_heads * hd)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[AttentionBackend]] = {}
# name -> module that registers it on import; lets `get_backend` find backends nobody has imported yet.
_LAZY: dict[str, str] = {"torch": "runtime.attention.torch_backend", "triton": "runtime.attention.triton_backend",
                         "flashinfer": "runtime.attention.flashinfer_backend"}  # optional, CUDA only


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _REGISTRY[name] = cls
        return cls

    return deco


def register_lazy_backend(name: str, module: str) -> None:
    _LAZY[name] = module


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        known = sorted(set(_REGISTRY) | set(_LAZY))
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(known)}") from None
