"""The typed carrier of one model forward: flattened tokens of many sequences, where their K/V go, and what each
query may attend to (causal chain or tree mask). Built by `ModelRunner`, read by models and attention backends.

Key layout per sequence: KV indices [0, kv_len). The first `prefix_len` are visible to every query of the sequence;
the rest (the "tail") is visible per query: causally for a chain append, by `tree_mask` for a tree append.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # chain append of many tokens (prompt, or any extend)
    DECODE = "decode"  # chain append of one token per sequence
    VERIFY = "verify"  # tree append: target scores a draft tree
    DRAFT_EXTEND = "draft_extend"  # draft model catching up on committed tokens (set by the caller)


@dataclass
class SeqAttention:
    """What the queries of one sequence see. Host-side description; the device tensors a backend may want
    (`kv_slots`, `tree_mask`) are built on first use, so backends that pack their own metadata pay no copies."""

    query_start: int  # first row of this sequence in the flattened batch
    query_len: int  # T new tokens
    kv_len: int  # KV entries [0, kv_len) exist after this forward's writes
    prefix_len: int  # KV entries [0, prefix_len) are visible to all T queries
    block_table: list[int]  # blocks holding this sequence's KV, in order
    block_size: int  # tokens per block: KV index i lives in slot block_table[i // block_size] * block_size + i % ..
    device: torch.device
    # Tree appends: per query, a bitmask over the tail (bit c = tail entry prefix_len + c visible). None = causal:
    # query i sees tail[: i + 1] (chain append).
    tree_rows: list[int] | None = None
    tree_parents: list[int] | None = None  # region parents of the whole open region (tree appends), for kernels

    @property
    def tail_len(self) -> int:
        return self.kv_len - self.prefix_len

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """(kv_len,) int64: flat slot of every KV index, for gather-style backends."""
        j = np.arange(self.kv_len)
        table = np.asarray(self.block_table, dtype=np.int64)
        return torch.from_numpy(table[j // self.block_size] * self.block_size + j % self.block_size).to(self.device)

    @cached_property
    def tree_mask(self) -> torch.Tensor | None:
        """(T, tail_len) bool, True = visible; None for a chain append."""
        if self.tree_rows is None:
            return None
        return torch.from_numpy(tree_mask_rows(self.tree_rows, self.tail_len).astype(bool)).to(self.device)


def tree_mask_rows(rows: list[int], width: int) -> np.ndarray:
    """(len(rows), width) uint8 from per-row bitmasks (bit c = column c)."""
    num_bytes = max(1, (width + 7) // 8)
    packed = np.frombuffer(b"".join(r.to_bytes(num_bytes, "little") for r in rows), dtype=np.uint8)
    return np.unpackbits(packed.reshape(len(rows), num_bytes), axis=1, bitorder="little")[:, :width]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64: RoPE positions
    slot_mapping: torch.Tensor  # (N,) int64: flat KV slot each token's K/V is written to
    seqs: list[SeqAttention]
    logits_indices: torch.Tensor  # (num_logit_rows,) int64: rows of the flattened batch that get logits
    num_logit_rows: list[int] = field(default_factory=list)  # per sequence, to split the logits back

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(s.query_len for s in self.seqs)
