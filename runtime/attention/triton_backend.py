"""Triton attention backend: new K/V stored by `kernels.store_kv`, attention by `kernels.paged_attention` straight
over the paged pool (no gather), chain appends causal and tree appends through a dense per-row tail mask.

Matches the `torch` backend on every ForwardBatch the runner builds. Imported lazily through the registry, so
`import runtime` never needs triton. On CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    from kernels.paged_attention import paged_attention
    from kernels.store_kv import store_kv
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    raise ImportError("attention backend 'triton' needs the triton package (3.6.x; the 'test' extra installs it)") from exc

from runtime.attention import AttentionBackend, register_backend
from runtime.forward_batch import ForwardBatch
from runtime.kv_pool import KVPool


@dataclass
class _Metadata:
    """Per-forward device tensors, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # (N,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int32, zero-padded
    query_start: torch.Tensor  # (B+1,) int32
    kv_lens: torch.Tensor  # (B,) int32
    prefix_lens: torch.Tensor  # (B,) int32
    max_query_len: int
    tree_mask: torch.Tensor | None  # (N, max_tail) bool, rows of tree sequences only meaningful
    use_tree: torch.Tensor | None  # (B,) bool


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.slot_mapping.device
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton backend needs a GPU device, or TRITON_INTERPRET=1 on CPU")
        seqs = batch.seqs
        offset = 0
        for seq in seqs:
            # The kernel reads each sequence's query count from consecutive offsets.
            if seq.query_start != offset:
                raise ValueError(f"sequence queries must be contiguous and in order; got start {seq.query_start}")
            offset += seq.query_len
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        tree_seqs = [s for s in seqs if s.tree_mask is not None]
        tree_mask = use_tree = None
        if tree_seqs:
            width = max(s.kv_len - s.prefix_len for s in tree_seqs)
            tree_mask = torch.zeros(batch.num_tokens, width, dtype=torch.bool, device=device)
            for s in tree_seqs:
                tree_mask[s.query_start:s.query_start + s.query_len, :s.tree_mask.shape[1]] = s.tree_mask
            use_tree = torch.tensor([s.tree_mask is not None for s in seqs], dtype=torch.bool, device=device)
        self._meta = _Metadata(
            slot_mapping=batch.slot_mapping,
            block_tables=_int32(tables, device),
            query_start=_int32([s.query_start for s in seqs] + [offset], device),
            kv_lens=_int32([s.kv_len for s in seqs], device),
            prefix_lens=_int32([s.prefix_len for s in seqs], device),
            max_query_len=max(s.query_len for s in seqs),
            tree_mask=tree_mask,
            use_tree=use_tree,
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool
    ) -> torch.Tensor:
        # q: (N, nh, hd); k, v: (N, kvh, hd)
        meta = self._meta
        k_cache, v_cache = kv_pool.paged(layer)  # (num_blocks, block_size, kvh, hd)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.kv_lens, meta.prefix_lens, self.scale,
            meta.max_query_len, meta.tree_mask, meta.use_tree,
        )  # (N, nh, hd)
        return out.view(q.shape[0], self.num_heads * self.head_dim)


def _int32(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
