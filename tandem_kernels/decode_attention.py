"""Decode attention: one query token per sequence over its paged KV (the query is the last key).

The 1-token special case of `paged_attention`, launched through the same kernel with a one-token grid; kept as its
own entry point so callers (and CUDA graphs of the decode step) need not build query offsets or prefix lengths.
At small batch it runs split-KV (flash-decoding, see paged_attention) so a single sequence still fills the GPU.
"""

from __future__ import annotations

import torch

from tandem_kernels._common import check
from tandem_kernels.paged_attention import paged_attention, paged_attention_ref


def _offsets(q: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)  # (B+1,)
    prefix_lens = torch.zeros_like(kv_lens)  # causal with T = 1 already shows every key
    return query_start, prefix_lens


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    kv_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """q: (B, nh, hd); caches (num_blocks, block_size, kvh, hd); block_tables (B, max_blocks); kv_lens (B,), each
    counting the query's own (already stored) key. num_splits: split-KV chunks (None = fill the GPU).
    Returns (B, nh, hd)."""
    check(q.dim() == 3 and block_tables.shape[0] == q.shape[0], "q must be (B, nh, hd) with one row per sequence")
    query_start, prefix_lens = _offsets(q, kv_lens)
    return paged_attention(q, k_cache, v_cache, block_tables, query_start, kv_lens, prefix_lens, scale,
                           max_query_len=1, out=out, num_splits=num_splits)


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    kv_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    query_start, prefix_lens = _offsets(q, kv_lens)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start, kv_lens, prefix_lens, scale, 1)
