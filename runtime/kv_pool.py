"""KV tensors for all layers, indexed by the flat slot numbers `kv_cache.BlockManager` hands out.

One tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) so compaction copies every layer in one
indexing op. Knows nothing about sequences; callers pass slots.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        # zeros, not empty: a bug that reads an unwritten slot then gives finite numbers in tests, not NaN soup.
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )  # (L, 2, num_blocks, block_size, kvh, hd)
        self._flat = self.kv.view(num_layers, 2, self.num_slots, num_kv_heads, head_dim)  # (L, 2, slots, kvh, hd)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def k(self, layer: int) -> torch.Tensor:
        return self._flat[layer, 0]  # (slots, kvh, hd)

    def v(self, layer: int) -> torch.Tensor:
        return self._flat[layer, 1]  # (slots, kvh, hd)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as (num_blocks, block_size, kvh, hd), for paged kernels."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: (N,) int64; k, v: (N, kvh, hd)."""
        self._flat[layer, 0].index_copy_(0, slots, k.to(self.kv.dtype))
        self._flat[layer, 1].index_copy_(0, slots, v.to(self.kv.dtype))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot src[i] -> dst[i] in every layer, K and V. Reads all sources before writing, so ranges may overlap."""
        self._flat[:, :, dst] = self._flat[:, :, src]
