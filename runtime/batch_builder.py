"""Input building of ModelRunner.forward: checking a batch of SeqForwards against the sequences' KV state, reserving
their KV blocks, and packing the ForwardBatch (token ids, RoPE positions, KV slots, logits rows, tree masks), in plain
Python plus one pinned host-to-device copy (or a graph's static buffers). Knows nothing about models or attention
kernels; the runner owns the sequence states this reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime import pinned
from runtime.forward_batch import ForwardBatch, ForwardMode, SeqAttention
from runtime.kv_cache import BlockManager, OutOfKVBlocks

if TYPE_CHECKING:
    from runtime.cuda_graph import CudaGraphRunner

LOGITS_MODES = ("last", "all", "none")

@dataclass
class SeqForward:
    seq_id: str
    token_ids: list[int]  # new tokens, written to KV at indices [kv_len, kv_len + T)
    positions: list[int] | None = None  # RoPE positions; None = kv_len.. (chain) or region_start + depth (tree)
    # None = causal chain append. Otherwise a speculative TREE append: parents[j] = region index of token j's parent,
    # -1 = attaches to the prefix.
    parents: list[int] | None = None
    logits: str = "last"  # "last" | "all" | "none": which of the T tokens get logits
    capture_hidden: bool = False  # also return the final-norm hidden state of the logits rows
    # (T, F) per-token input features for feature-based draft models (EAGLE); None for plain LMs. All SeqForwards of
    # one forward either carry them or not.
    input_features: torch.Tensor | None = None



class UnknownSeq(KeyError):
    """The runner holds no sequence with this id."""


@dataclass
class SeqState:
    kv_len: int = 0
    region_start: int | None = None  # KV index of tree-region node 0 while a region is open
    # Per region node: bitmask of region nodes it attends to (its ancestors and itself). Python ints: unbounded width.
    region_visible: list[int] = field(default_factory=list)
    region_parents: list[int] = field(default_factory=list)

    def close_region(self) -> None:
        self.region_start = None
        self.region_visible = []
        self.region_parents = []


def seq_state(seqs: dict[str, SeqState], seq_id: str) -> SeqState:
    try:
        return seqs[seq_id]
    except KeyError:
        raise UnknownSeq(seq_id) from None


def to_device_long(values: list[int], device: torch.device) -> torch.Tensor:
    return pinned.to_device(torch.tensor(values, dtype=torch.int64), device)  # async from pinned memory on CUDA


def validate_batch(batch: list[SeqForward], seqs: dict[str, SeqState], vocab_size: int) -> None:
    """Raise ValueError / UnknownSeq unless every SeqForward fits its sequence's state; changes nothing."""
    if not batch:
        raise ValueError("forward needs at least one SeqForward")
    seen: set[str] = set()
    vocab = vocab_size
    with_features = batch[0].input_features is not None
    for sf in batch:
        if sf.seq_id in seen:
            raise ValueError(f"seq {sf.seq_id!r} appears twice in one forward")
        seen.add(sf.seq_id)
        state = seq_state(seqs, sf.seq_id)
        num_tokens = len(sf.token_ids)
        if num_tokens == 0:
            raise ValueError(f"seq {sf.seq_id!r}: token_ids is empty")
        if any(not 0 <= t < vocab for t in sf.token_ids):
            raise ValueError(f"seq {sf.seq_id!r}: token id outside [0, {vocab})")
        if sf.logits not in LOGITS_MODES:
            raise ValueError(f"seq {sf.seq_id!r}: logits must be one of {LOGITS_MODES}, got {sf.logits!r}")
        if (sf.input_features is not None) != with_features:
            raise ValueError("input_features must be given for all sequences of a forward or for none")
        if with_features and (sf.input_features.dim() != 2 or sf.input_features.shape[0] != num_tokens):
            raise ValueError(
                f"seq {sf.seq_id!r}: input_features must be (T={num_tokens}, F), "
                f"got {tuple(sf.input_features.shape)}"
            )
        if sf.positions is not None and len(sf.positions) != num_tokens:
            raise ValueError(f"seq {sf.seq_id!r}: {len(sf.positions)} positions for {num_tokens} tokens")
        if sf.parents is None:
            if state.region_start is not None:
                raise ValueError(
                    f"seq {sf.seq_id!r}: chain append while a tree region is open; truncate or compact first"
                )
            continue
        if len(sf.parents) != num_tokens:
            raise ValueError(f"seq {sf.seq_id!r}: {len(sf.parents)} parents for {num_tokens} tokens")
        region_len = 0 if state.region_start is None else state.kv_len - state.region_start
        for j, p in enumerate(sf.parents):
            # Parents come before children, so the mask of every node is known when it is appended.
            if not -1 <= p < region_len + j:
                raise ValueError(f"seq {sf.seq_id!r}: parents[{j}]={p} must be in [-1, {region_len + j})")


def reserve_kv(batch: list[SeqForward], seqs: dict[str, SeqState], bm: BlockManager) -> None:
    """Grow every sequence's block table for its new tokens, all or nothing (OutOfKVBlocks before any change)."""
    needed = sum(bm.num_blocks_needed(sf.seq_id, seqs[sf.seq_id].kv_len + len(sf.token_ids)) for sf in batch)
    if needed > bm.num_free_blocks():
        raise OutOfKVBlocks(needed, bm.num_free_blocks())
    for sf in batch:
        bm.ensure_capacity(sf.seq_id, seqs[sf.seq_id].kv_len + len(sf.token_ids))


def build_forward_batch(
    batch: list[SeqForward], seqs: dict[str, SeqState], bm: BlockManager, device: torch.device,
    mode: ForwardMode | None, graph_runner: CudaGraphRunner | None = None,
) -> tuple[ForwardBatch, dict[str, tuple[int, list[int], list[int]]], tuple[int, int] | None]:
    """(batch, new tree regions, CUDA graph key or None). Token arrays go to the device in one pinned copy,
    into the graph's static buffers when `graph_runner` (given only when graphs may run it) has a graph for it."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logits_indices: list[int] = []
    tree_parents_tok: list[int] = []  # per token: parent region node when the append opens a region, else -1
    num_logit_rows: list[int] = []
    seq_attn: list[SeqAttention] = []
    new_regions: dict[str, tuple[int, list[int], list[int]]] = {}
    for sf in batch:
        state = seqs[sf.seq_id]
        num_tokens = len(sf.token_ids)
        start = len(input_ids)
        kv_len = state.kv_len + num_tokens
        tree_rows = None
        tree_parents = None
        if sf.parents is None:
            prefix_len = state.kv_len
            pos = sf.positions or list(range(state.kv_len, kv_len))
        else:
            region_start = state.kv_len if state.region_start is None else state.region_start
            region_len = state.kv_len - region_start
            visible = list(state.region_visible)
            for j, p in enumerate(sf.parents):
                visible.append((1 << (region_len + j)) | (visible[p] if p >= 0 else 0))
            tree_parents = state.region_parents + list(sf.parents)
            new_regions[sf.seq_id] = (region_start, visible, tree_parents)
            prefix_len = region_start
            tree_rows = visible[region_len:]  # per query: bitmask over the tail [region_start, kv_len)
            # Default position: prefix length + depth, where depth = number of visible region nodes - 1.
            pos = sf.positions or [region_start + v.bit_count() - 1 for v in tree_rows]
        fresh_tree = sf.parents is not None and state.region_start is None
        tree_parents_tok.extend(sf.parents if fresh_tree else [-1] * num_tokens)
        input_ids.extend(sf.token_ids)
        positions.extend(pos)
        slot_mapping.extend(bm.slots(sf.seq_id, state.kv_len, kv_len))
        n_rows = {"last": 1, "all": num_tokens, "none": 0}[sf.logits]
        logits_indices.extend(range(start + num_tokens - n_rows, start + num_tokens))
        num_logit_rows.append(n_rows)
        seq_attn.append(SeqAttention(
            query_start=start, query_len=num_tokens, kv_len=kv_len, prefix_len=prefix_len,
            block_table=bm.block_table(sf.seq_id), block_size=bm.block_size, device=device,
            tree_rows=tree_rows, tree_parents=tree_parents,
        ))
    if mode is None:
        if any(sf.parents is not None for sf in batch):
            mode = ForwardMode.VERIFY
        elif all(len(sf.token_ids) == 1 for sf in batch):
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.PREFILL
    graph_key = graph_runner.key_for(seq_attn) if graph_runner is not None else None
    n = len(input_ids)
    if graph_key is not None:
        ids, pos_t, slots, rows = graph_runner.load_inputs(
            graph_key, input_ids, positions, slot_mapping, logits_indices, tree_parents_tok)
    else:
        packed = to_device_long(input_ids + positions + slot_mapping + logits_indices, device)
        ids, pos_t, slots, rows = packed.split([n, n, n, len(logits_indices)])
    fb = ForwardBatch(
        mode=mode, input_ids=ids, positions=pos_t, slot_mapping=slots, seqs=seq_attn, logits_indices=rows,
        num_logit_rows=num_logit_rows,
    )
    return fb, new_regions, graph_key
