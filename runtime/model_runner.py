"""ModelRunner: one model, its paged KV cache and its sequences' KV state, driven by explicit per-sequence appends
(chain or speculative tree), one batched model forward per call. The API target and draft services build on.

Owns KV memory and tree regions; knows nothing about sampling, acceptance or the wire. Sequences are opaque ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention import get_backend
from runtime.config import EngineConfig, ModelConfig
from runtime.forward_batch import ForwardBatch, ForwardMode, SeqAttention
from runtime.kv_cache import BlockManager, OutOfKVBlocks
from runtime.kv_pool import KVPool
from runtime.models.loader import load_model, resolve_dtype

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


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor]  # per SeqForward: (num_logit_rows, vocab) float32
    hidden: list[torch.Tensor | None]  # per SeqForward: (num_logit_rows, H) when capture_hidden, else None
    # per SeqForward, only when forward(capture_layers=...): (T, len(capture_layers) * H), all T tokens
    aux_hidden: list[torch.Tensor | None] = field(default_factory=list)


class UnknownSeq(KeyError):
    """The runner holds no sequence with this id."""


@dataclass
class _SeqState:
    kv_len: int = 0
    region_start: int | None = None  # KV index of tree-region node 0 while a region is open
    # Per region node: bitmask of region nodes it attends to (its ancestors and itself). Python ints: unbounded width.
    region_visible: list[int] = field(default_factory=list)
    region_parents: list[int] = field(default_factory=list)

    def close_region(self) -> None:
        self.region_start = None
        self.region_visible = []
        self.region_parents = []


class ModelRunner:
    def __init__(
        self,
        model_path: str | None,
        engine_config: EngineConfig,
        model_config: ModelConfig | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """model: an already loaded module (e.g. an EAGLE draft head built by its own loader) to run instead of
        loading one from model_path; model_config then only describes its KV shape."""
        if model_config is None:
            if model_path is None:
                raise ValueError("need a model_path or a model_config")
            model_config = ModelConfig.from_pretrained(model_path)
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = torch.device(engine_config.device)
        self.dtype = resolve_dtype(engine_config, model_config)
        self.model = model if model is not None else load_model(model_path, model_config, engine_config)
        num_blocks = engine_config.resolved_num_kv_blocks
        self.block_manager = BlockManager(num_blocks, engine_config.block_size)
        self.kv_pool = KVPool(
            model_config.num_layers, num_blocks, engine_config.block_size,
            model_config.num_kv_heads, model_config.head_dim, self.dtype, self.device,
        )
        backend_cls = get_backend(engine_config.attention_backend)
        self.attn_backend = backend_cls(
            model_config.num_heads, model_config.num_kv_heads, model_config.head_dim, model_config.head_dim**-0.5
        )
        self._seqs: dict[str, _SeqState] = {}

    # ---- sequence lifecycle ----------------------------------------------------------------------------------------
    def add_seq(self, seq_id: str) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id!r} already exists")
        self.block_manager.allocate_seq(seq_id, 0)
        self._seqs[seq_id] = _SeqState()

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def kv_len(self, seq_id: str) -> int:
        return self._state(seq_id).kv_len

    def region_start(self, seq_id: str) -> int | None:
        """KV index of the open tree region's node 0, or None when no region is open."""
        return self._state(seq_id).region_start

    def free_seq(self, seq_id: str) -> None:
        self._state(seq_id)
        del self._seqs[seq_id]
        self.block_manager.free_seq(seq_id)

    def num_free_tokens(self) -> int:
        """Free KV capacity in tokens (whole free blocks; slack in sequences' last blocks is not counted)."""
        return self.block_manager.num_free_blocks() * self.block_manager.block_size

    def num_total_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # ---- KV rollback -----------------------------------------------------------------------------------------------
    def truncate(self, seq_id: str, kv_len: int) -> None:
        """Roll the sequence's KV back to [0, kv_len); closes any open tree region."""
        state = self._state(seq_id)
        if not 0 <= kv_len <= state.kv_len:
            raise ValueError(f"truncate seq {seq_id!r} to {kv_len}: must be in [0, {state.kv_len}]")
        self.block_manager.truncate(seq_id, kv_len)
        state.kv_len = kv_len
        state.close_region()

    def compact(self, seq_id: str, region_nodes: list[int]) -> None:
        """Keep only these region nodes, moved in this order to KV indices region_start..; closes the region."""
        state = self._state(seq_id)
        if state.region_start is None:
            raise ValueError(f"compact seq {seq_id!r}: no tree region is open")
        region_len = state.kv_len - state.region_start
        if len(set(region_nodes)) != len(region_nodes) or any(not 0 <= n < region_len for n in region_nodes):
            raise ValueError(f"compact seq {seq_id!r}: nodes {region_nodes} must be distinct, in [0, {region_len})")
        start = state.region_start
        moves = [(start + n, start + i) for i, n in enumerate(region_nodes) if n != i]
        if moves:
            src = [self.block_manager.slot(seq_id, s) for s, _ in moves]
            dst = [self.block_manager.slot(seq_id, d) for _, d in moves]
            self.kv_pool.copy_slots(self._long(src), self._long(dst))
        new_len = start + len(region_nodes)
        self.block_manager.truncate(seq_id, new_len)
        state.kv_len = new_len
        state.close_region()

    # ---- forward ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        batch: list[SeqForward],
        capture_layers: list[int] | None = None,
        mode: ForwardMode | None = None,
    ) -> ForwardOutput:
        """One model forward over all sequences' new tokens. Validates everything and reserves KV before any state
        changes, so a raised error (ValueError, UnknownSeq, OutOfKVBlocks) leaves every sequence as it was."""
        self._validate(batch)
        self._reserve_kv(batch)
        fb, new_regions = self._build_forward_batch(batch, mode)
        self.attn_backend.init_forward_metadata(fb)
        extra = {}
        if batch[0].input_features is not None:  # _validate made it all-or-none
            extra["input_features"] = torch.cat([sf.input_features for sf in batch]).to(self.device)  # (N, F)
        out = self.model(fb.input_ids, fb.positions, self.attn_backend, self.kv_pool, capture_layers, **extra)
        rows_hidden = out.hidden[fb.logits_indices]  # (num_logit_rows, H)
        logits = self.model.compute_logits(rows_hidden) if rows_hidden.shape[0] else None
        result = ForwardOutput(logits=[], hidden=[], aux_hidden=[])
        row = 0
        for sf, seq, n in zip(batch, fb.seqs, fb.num_logit_rows):
            if logits is None:
                result.logits.append(torch.empty(0, self.model_config.vocab_size, device=self.device))
            else:
                result.logits.append(logits[row : row + n])
            result.hidden.append(rows_hidden[row : row + n] if sf.capture_hidden else None)
            tokens = slice(seq.query_start, seq.query_start + seq.query_len)
            result.aux_hidden.append(out.aux_hidden[tokens] if out.aux_hidden is not None else None)
            row += n
        # Commit state only after the forward succeeded.
        for sf in batch:
            state = self._seqs[sf.seq_id]
            if sf.parents is not None:
                start, visible, parents = new_regions[sf.seq_id]
                state.region_start, state.region_visible, state.region_parents = start, visible, parents
            state.kv_len += len(sf.token_ids)
        return result

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _state(self, seq_id: str) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSeq(seq_id) from None

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _validate(self, batch: list[SeqForward]) -> None:
        if not batch:
            raise ValueError("forward needs at least one SeqForward")
        seen: set[str] = set()
        vocab = self.model_config.vocab_size
        with_features = batch[0].input_features is not None
        for sf in batch:
            if sf.seq_id in seen:
                raise ValueError(f"seq {sf.seq_id!r} appears twice in one forward")
            seen.add(sf.seq_id)
            state = self._state(sf.seq_id)
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

    def _reserve_kv(self, batch: list[SeqForward]) -> None:
        bm = self.block_manager
        needed = sum(bm.num_blocks_needed(sf.seq_id, self._seqs[sf.seq_id].kv_len + len(sf.token_ids)) for sf in batch)
        if needed > bm.num_free_blocks():
            raise OutOfKVBlocks(needed, bm.num_free_blocks())
        for sf in batch:
            bm.ensure_capacity(sf.seq_id, self._seqs[sf.seq_id].kv_len + len(sf.token_ids))

    def _build_forward_batch(
        self, batch: list[SeqForward], mode: ForwardMode | None
    ) -> tuple[ForwardBatch, dict[str, tuple[int, list[int], list[int]]]]:
        bm = self.block_manager
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        num_logit_rows: list[int] = []
        seqs: list[SeqAttention] = []
        new_regions: dict[str, tuple[int, list[int], list[int]]] = {}
        for sf in batch:
            state = self._seqs[sf.seq_id]
            num_tokens = len(sf.token_ids)
            start = len(input_ids)
            kv_len = state.kv_len + num_tokens
            tree_mask = None
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
                tail_len = kv_len - region_start
                rows = visible[region_len:]
                tree_mask = torch.tensor(
                    [[(v >> c) & 1 for c in range(tail_len)] for v in rows], dtype=torch.bool
                ).to(self.device)  # (T, tail_len)
                # Default position: prefix length + depth, where depth = number of visible region nodes - 1.
                pos = sf.positions or [region_start + v.bit_count() - 1 for v in rows]
            input_ids.extend(sf.token_ids)
            positions.extend(pos)
            slot_mapping.extend(bm.slots(sf.seq_id, state.kv_len, kv_len))
            n_rows = {"last": 1, "all": num_tokens, "none": 0}[sf.logits]
            logits_indices.extend(range(start + num_tokens - n_rows, start + num_tokens))
            num_logit_rows.append(n_rows)
            seqs.append(SeqAttention(
                query_start=start, query_len=num_tokens, kv_len=kv_len, prefix_len=prefix_len,
                block_table=bm.block_table(sf.seq_id), kv_slots=self._long(bm.slots(sf.seq_id, 0, kv_len)),
                tree_mask=tree_mask, tree_parents=tree_parents,
            ))
        if mode is None:
            if any(sf.parents is not None for sf in batch):
                mode = ForwardMode.VERIFY
            elif all(len(sf.token_ids) == 1 for sf in batch):
                mode = ForwardMode.DECODE
            else:
                mode = ForwardMode.PREFILL
        fb = ForwardBatch(
            mode=mode, input_ids=self._long(input_ids), positions=self._long(positions),
            slot_mapping=self._long(slot_mapping), seqs=seqs, logits_indices=self._long(logits_indices),
            num_logit_rows=num_logit_rows,
        )
        return fb, new_regions
