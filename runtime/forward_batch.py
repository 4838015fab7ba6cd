"""The typed carrier of one model forward: flattened tokens of many sequences, where their K/V go, and what each
query may attend to (causal chain or tree mask). Built by `ModelRunner`, read by models and attention backends.

Key layout per sequence: KV indices [0, kv_len). The first `prefix_len` are visible to every query of the sequence;
the rest (the "tail") is visible per query: causally for a chain append, by `tree_mask` for a tree append.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # chain append of many tokens (prompt, or any extend)
    DECODE = "decode"  # chain append of one token per sequence
    VERIFY = "verify"  # tree append: target scores a draft tree
    DRAFT_EXTEND = "draft_extend"  # draft model catching up on committed tokens (set by the caller)


@dataclass
class SeqAttention:
    """What the queries of one sequence see."""

    query_start: int  # first row of this sequence in the flattened batch
    query_len: int  # T new tokens
    kv_len: int  # KV entries [0, kv_len) exist after this forward's writes
    prefix_len: int  # KV entries [0, prefix_len) are visible to all T queries
    block_table: list[int]  # blocks holding this sequence's KV, in order
    kv_slots: torch.Tensor  # (kv_len,) int64: flat slot of every KV index, for gather-style backends
    # (T, kv_len - prefix_len) bool, True = visible; None = causal: query i sees tail[: i + 1] (chain append).
    tree_mask: torch.Tensor | None = None
    tree_parents: list[int] | None = None  # region parents of the whole open region (tree appends), for kernels


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
