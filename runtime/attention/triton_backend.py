"""Triton attention backend: new K/V stored by `tandem_kernels.store_kv`, attention by `tandem_kernels.paged_attention` straight
over the paged pool (no gather), chain appends causal and tree appends through a dense per-row tail mask, split-KV
when the batch is too small to fill the GPU.

Metadata (block tables, query offsets, KV and prefix lengths, tree masks) is packed on the host and sent in a few
pinned, non-blocking copies: no host sync inside a step. For CUDA graphs it is written into preallocated buffers
(`init_graph_buffers`, `load_graph_metadata`) whose addresses the captured kernels keep.

Matches the `torch` backend on every ForwardBatch the runner builds. Imported lazily through the registry, so
`import runtime` never needs triton. On CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

try:
    from tandem_kernels.paged_attention import default_num_splits, paged_attention
    from tandem_kernels.store_kv import store_kv
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    raise ImportError("attention backend 'triton' needs the triton package (3.6.x; the 'test' extra installs it)") from exc

from runtime import pinned
from runtime.attention import AttentionBackend, register_backend
from runtime.forward_batch import ForwardBatch, tree_mask_rows
from runtime.kv_pool import KVPool

# Rows of the packed per-sequence int32 metadata.
_QUERY_START, _KV_LEN, _PREFIX_LEN, _USE_TREE = range(4)


@dataclass
class _Metadata:
    """Per-forward device tensors, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # (N,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int32; only the first ceil(kv_len / block_size) entries are read
    query_start: torch.Tensor  # (B+1,) int32
    kv_lens: torch.Tensor  # (B,) int32
    prefix_lens: torch.Tensor  # (B,) int32
    max_query_len: int
    tree_mask: torch.Tensor | None  # (N, W) uint8, rows of tree sequences only meaningful
    use_tree: torch.Tensor | None  # (B,) int32, nonzero = tree sequence
    num_splits: int | None = None  # split-KV chunks; None = the kernel's default for the grid


@dataclass
class _GraphBuffers:
    block_tables: torch.Tensor  # (max_bs, max_blocks) int32
    seq_info: torch.Tensor  # (4, max_bs + 1) int32: query_start, kv_len, prefix_len, use_tree
    tree_mask: torch.Tensor  # (max_bs * max_query_len, max_query_len) uint8


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    _graph: _GraphBuffers | None = None
    _graph_mask_width: int | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.slot_mapping.device
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton backend needs a GPU device, or TRITON_INTERPRET=1 on CPU")
        seqs = batch.seqs
        num_seqs = len(seqs)
        tables, info, mask = _host_metadata(batch, num_seqs, batch.max_query_len, batch.num_tokens)
        has_tree = mask is not None
        # One packed int32 copy for tables + per-sequence info, one for the tree mask.
        packed = _to_device(np.concatenate([tables.ravel(), info.ravel()]), device)
        info_dev = packed[tables.size:].view(4, num_seqs + 1)
        self._meta = _Metadata(
            slot_mapping=batch.slot_mapping,
            block_tables=packed[:tables.size].view(tables.shape),
            query_start=info_dev[_QUERY_START],
            kv_lens=info_dev[_KV_LEN, :num_seqs],
            prefix_lens=info_dev[_PREFIX_LEN, :num_seqs],
            max_query_len=batch.max_query_len,
            tree_mask=_to_device(mask, device) if has_tree else None,
            use_tree=info_dev[_USE_TREE, :num_seqs] if has_tree else None,
        )

    # ---- CUDA graph support ----------------------------------------------------------------------------------------
    def init_graph_buffers(
        self, max_bs: int, max_query_len: int, max_blocks: int, device: torch.device, mask_width: int | None = None
    ) -> None:
        """Allocate the static metadata buffers every captured graph reads. mask_width: tree tails wider than the
        query (a draft's tree steps attend to every earlier step's nodes); then every graph gets that width."""
        self._graph_mask_width = mask_width
        self._graph = _GraphBuffers(
            block_tables=torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device),
            seq_info=torch.zeros(4, max_bs + 1, dtype=torch.int32, device=device),
            tree_mask=torch.zeros(max_bs * max_query_len, max(max_query_len, mask_width or 0), dtype=torch.uint8,
                                  device=device),
        )

    def graph_max_blocks(self) -> int:
        return self._graph.block_tables.shape[1]

    def load_graph_metadata(
        self, batch: ForwardBatch | None, num_seqs: int, query_len: int, slot_mapping: torch.Tensor
    ) -> None:
        """Point the metadata at the static buffers for a graph of `num_seqs` sequences of `query_len` tokens and
        fill them from `batch` (its sequences first, then padding sequences), or with padding only when batch is
        None (capture). Padding sequences read block 0 causally and write nothing (their slots are -1), so they can
        never change a real row. Host-to-device copies only: no sync."""
        g = self._graph
        num_tokens = num_seqs * query_len
        tables, info, mask = _host_metadata(batch, num_seqs, query_len, num_tokens, pad_kv_len=query_len)
        device = g.block_tables.device
        if batch is not None:
            pinned.copy_to(g.block_tables[:num_seqs, :tables.shape[1]], tables)
            pinned.copy_to(g.seq_info[:, :num_seqs + 1], info)
            if mask is not None:
                pinned.copy_to(g.tree_mask[:num_tokens, :mask.shape[1]], mask)
        else:
            g.block_tables[:num_seqs].zero_()
            g.seq_info[:, :num_seqs + 1].copy_(torch.from_numpy(info))
            g.tree_mask.zero_()
        group = self.num_heads // self.num_kv_heads
        tiles = -(-query_len // max(1, _tokens_per_tile(group, query_len)))
        self._meta = _Metadata(
            slot_mapping=slot_mapping,
            block_tables=g.block_tables[:num_seqs],
            query_start=g.seq_info[_QUERY_START, :num_seqs + 1],
            kv_lens=g.seq_info[_KV_LEN, :num_seqs],
            prefix_lens=g.seq_info[_PREFIX_LEN, :num_seqs],
            max_query_len=query_len,
            # Always present in graphs: a captured graph cannot switch kernels when a tree shows up.
            tree_mask=g.tree_mask[:num_tokens, :self._graph_mask_width or query_len],
            use_tree=g.seq_info[_USE_TREE, :num_seqs],
            num_splits=default_num_splits(num_seqs * self.num_kv_heads * tiles, device),
        )

    def use_static_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
        kv_lens: torch.Tensor, prefix_lens: torch.Tensor, max_query_len: int, tree_mask: torch.Tensor | None = None,
        use_tree: torch.Tensor | None = None,
    ) -> None:
        """The next forward's metadata as device tensors computed by device code (a static draft step builds them
        inside its CUDA graph, runtime/speculative/draft_step.py): block_tables (B, W) int32, query_start (B+1,),
        kv_lens, prefix_lens (B,) int32, tree_mask (N, width) uint8 with use_tree (B,) int32, or neither (chain)."""
        num_seqs = kv_lens.shape[0]
        group = self.num_heads // self.num_kv_heads
        tiles = -(-max_query_len // max(1, _tokens_per_tile(group, max_query_len)))
        self._meta = _Metadata(
            slot_mapping=slot_mapping, block_tables=block_tables, query_start=query_start, kv_lens=kv_lens,
            prefix_lens=prefix_lens, max_query_len=max_query_len, tree_mask=tree_mask, use_tree=use_tree,
            num_splits=default_num_splits(num_seqs * self.num_kv_heads * tiles, slot_mapping.device),
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
            meta.max_query_len, meta.tree_mask, meta.use_tree, num_splits=meta.num_splits,
        )  # (N, nh, hd)
        return out.view(q.shape[0], self.num_heads * self.head_dim)


def _tokens_per_tile(group: int, query_len: int) -> int:
    # The launcher's default block_m (paged_attention): max(16, next_pow2(group * min(T, 16))) rows per tile.
    rows = max(16, 1 << max(0, (group * min(query_len, 16) - 1).bit_length()))
    return rows // group


def _host_metadata(
    batch: ForwardBatch | None, num_seqs: int, query_len: int, num_tokens: int, pad_kv_len: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(block tables (B, max_blocks) int32, seq info (4, B+1) int32, tree mask (N, W) uint8 or None). Sequences past
    the batch's (graph padding) hold query_len tokens each over pad_kv_len keys of block 0, chain-causal."""
    seqs = batch.seqs if batch is not None else []
    info = np.zeros((4, num_seqs + 1), dtype=np.int32)
    offset = 0
    for b, seq in enumerate(seqs):
        # The kernel reads each sequence's query count from consecutive offsets.
        if seq.query_start != offset:
            raise ValueError(f"sequence queries must be contiguous and in order; got start {seq.query_start}")
        info[:, b] = (offset, seq.kv_len, seq.prefix_len, seq.tree_rows is not None)
        offset += seq.query_len
    for b in range(len(seqs), num_seqs):
        info[:, b] = (offset, pad_kv_len, 0, 0)
        offset += query_len
    info[_QUERY_START, num_seqs] = offset
    max_blocks = max([len(s.block_table) for s in seqs] or [1])
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for b, seq in enumerate(seqs):
        tables[b, :len(seq.block_table)] = seq.block_table
    tree_seqs = [s for s in seqs if s.tree_rows is not None]
    mask = None
    if tree_seqs:
        mask = np.zeros((num_tokens, max(s.tail_len for s in tree_seqs)), dtype=np.uint8)
        for s in tree_seqs:
            mask[s.query_start:s.query_start + s.query_len, :s.tail_len] = tree_mask_rows(s.tree_rows, s.tail_len)
    return tables, info, mask


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # Pinned source + non_blocking: the copy is queued on the stream; the host does not wait for the GPU.
    return pinned.to_device(array, device)
