"""DFLASH proposer: a block-diffusion draft (runtime/models/dflash.py) fed by the target's features of the configured
layers, drafting a chain of B-1 tokens per Propose in one forward (B = num_draft_tokens, the block size).

Draft KV holds target features, never draft tokens: each committed token's feature row (arriving with the Propose
after the token gained target KV) is projected once — fc + hidden_norm, then per draft layer k_proj/v_proj, k_norm and
RoPE at the token's position — and written to this proposer's paged KV pool ("context KV injection", lazily, batched
over the sequences of a Propose). A Propose at committed length C attends over the context positions [0, C-1) (or
the last --speculative-draft-window-size of them: a ring of that many KV slots per sequence, so the draft KV of a
sequence stays bounded) plus the block [t_{C-1}, MASK x (B-1)] at positions C-1..C+B-2 without a causal mask; rows
1..B-1 give the chain, taken greedily (the target verifies it exactly, greedy or by target-only sampling).
Knows nothing about how the target produced the features or what gets committed.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from core.steps import ProposeInput
from core.types import DraftTree
from draft_service.proposer import Proposer, StaleSequence
from runtime.config import EngineConfig, ModelConfig
from runtime.kv_cache import BlockManager, OutOfKVBlocks
from runtime.kv_pool import KVPool
from runtime.models.dflash import dflash_capture_layers, load_dflash_draft
from runtime.speculative.block_step import BlockItem

logger = logging.getLogger(__name__)
_CTX_ALIGN = 16  # padded context length granularity of a batched block forward (fewer distinct shapes)


@dataclass
class _SeqContext:
    end: int = 0  # context KV written for committed positions [0, end) (the window keeps the last W of them)
    pending_start: int = 0  # first position of `pending` (== end while rows are pending)
    pending: torch.Tensor | None = None  # (n, K*H_t) target features of positions [end, end + n), not injected yet


class DFlashProposer(Proposer):
    algorithm = "DFLASH"
    needs_features = True

    def __init__(self, target_path: str, draft_path: str, engine_config: EngineConfig,
                 window_size: int | None = None) -> None:
        """target_path: the target checkpoint (its embedding and lm_head are the draft's); draft_path: the DFlash
        draft; window_size: attend to at most this many latest context positions, with that many KV slots per
        sequence (--speculative-draft-window-size; None = the whole context)."""
        super().__init__()
        if window_size is not None and window_size < 1:
            raise ValueError(f"--speculative-draft-window-size must be positive, got {window_size}")
        target = ModelConfig.from_pretrained(target_path)
        self.model = load_dflash_draft(draft_path, target_path, engine_config)
        config = self.model.dflash
        self.dtype = self.model.fc.weight.dtype
        self.device = device = torch.device(engine_config.device)
        self.window_size = window_size
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.max_context_len = target.max_position_embeddings
        self.target_capture_layers = dflash_capture_layers(list(config.target_layer_ids), target.num_layers)
        self.feature_size = config.feature_size
        m, num_blocks = config.model, engine_config.resolved_num_kv_blocks  # --max-total-tokens of context KV
        self.block_manager = BlockManager(num_blocks, engine_config.block_size)
        self.kv_pool = KVPool(m.num_layers, num_blocks, engine_config.block_size, m.num_kv_heads, m.head_dim,
                              self.dtype, device)
        self._ctx: dict[str, _SeqContext] = {}
        self.engine_config = engine_config
        self._block_step = None  # runtime.speculative.block_step.StaticBlockDraftStep, see enable_static_step

    # ---- bookkeeping hooks -----------------------------------------------------------------------------------------
    def memory(self) -> tuple[int, int]:
        bm = self.block_manager
        return bm.num_free_blocks() * bm.block_size, bm.num_blocks * bm.block_size

    def kv_slots_held(self, seq_id: str) -> int:
        """KV slots the sequence holds (bounded by the window when one is set)."""
        return self.block_manager.capacity(seq_id) if self.block_manager.has_seq(seq_id) else 0

    def _on_prefill(self, seq_id: str) -> None:
        self._ctx[seq_id] = _SeqContext()
        self.block_manager.allocate_seq(seq_id)

    def _on_release(self, seq_id: str) -> None:
        self._ctx.pop(seq_id, None)
        if self.block_manager.has_seq(seq_id):
            self.block_manager.free_seq(seq_id)

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        """Keep context for positions [0, kept_len - 1): the feature of the last kept token arrives with the tail."""
        ctx = self._ctx.get(seq_id)
        if ctx is None:
            raise StaleSequence("DFLASH draft state of this sequence was dropped")
        keep = max(0, kept_len - 1)
        if ctx.pending is not None and keep < ctx.pending_start + ctx.pending.shape[0]:
            rows = max(0, keep - ctx.pending_start)
            ctx.pending = ctx.pending[:rows] if rows else None
        if keep < ctx.end:
            if self.window_size is not None and ctx.end > self.window_size:
                # The ring already overwrote positions a shorter context would attend to again.
                raise StaleSequence("rollback past the DFLASH draft window")
            ctx.end = keep
            self.block_manager.truncate(seq_id, keep)
            ctx.pending_start = keep

    def _on_features(self, seq_id: str, features: torch.Tensor) -> None:
        """Rows of positions [C-1-n, C-1), C = the committed length now; injected at the next draft."""
        ctx = self._ctx[seq_id]
        start = len(self._tokens[seq_id]) - 1 - features.shape[0]
        if features.shape[1] != self.feature_size:
            raise ValueError(f"DFLASH features must be {self.feature_size} wide (the draft's target layers x target "
                             f"hidden size), got {features.shape[1]}")
        have = ctx.end if ctx.pending is None else ctx.pending_start + ctx.pending.shape[0]
        if start > have:
            raise ValueError(f"seq {seq_id!r}: target features start at position {start}, the draft has {have}")
        first = ctx.end if ctx.pending is None else ctx.pending_start
        if start < first:  # re-sent rows of positions already injected or pending: keep those
            features, start = features[first - start:], first
        if not features.shape[0]:
            return
        if ctx.pending is None:
            ctx.pending, ctx.pending_start = features, start
        else:
            ctx.pending = torch.cat([ctx.pending[:start - ctx.pending_start], features])

    def enable_static_step(self, spec, max_bs: int) -> bool:
        """Propose blocks of the draft's own size as one static device step (runtime/speculative/block_step.py: one
        CUDA graph per batch bucket on CUDA, eager elsewhere), paged attention over the context KV instead of the
        dense gather (with --speculative-draft-window-size, over the ring of its last W positions: the keys carry
        their RoPE, so their order in the KV does not matter); returns whether it is on."""
        if spec.num_draft_tokens != self.block_size or self.block_size < 2:
            return False
        from runtime.speculative.block_step import StaticBlockDraftStep

        step = StaticBlockDraftStep(self.model, self.kv_pool, self.block_manager, self.engine_config,
                                    self.max_context_len, self.block_size, self.mask_token_id, max_bs)
        step.capture()
        self._block_step = step
        return True

    # ---- drafting ----------------------------------------------------------------------------------------------------
    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        trees: dict[str, DraftTree] = {}
        with torch.inference_mode():
            # the static step takes a whole batch of served-size blocks, their few new context rows injected inside
            whole = self._draft_static(self._static_batch(inputs)) or {}
            trees.update(whole)
            rest = [inp for inp in inputs if inp.seq_id not in whole]
            ready = self._inject([inp.seq_id for inp in rest])
            groups: dict[int, list[ProposeInput]] = defaultdict(list)
            for inp in rest:
                if inp.seq_id in ready and inp.spec.num_draft_tokens >= 2 and inp.committed_len < self.max_context_len:
                    groups[inp.spec.num_draft_tokens].append(inp)
            for block, group in groups.items():
                static = self._draft_static(group) if block == self.block_size else None
                trees.update(static if static is not None else self._draft_blocks(group, block))
        return [trees.get(inp.seq_id, DraftTree([], [])) for inp in inputs]

    def _static_batch(self, inputs: list[ProposeInput]) -> list[ProposeInput]:
        """The batch when the static step can take all of it as it stands (served block size, within its buckets,
        at most a block of pending context rows each: a step's accepted tokens); else none of it."""
        step = self._block_step
        if step is None or not inputs or len(inputs) > step.max_bs:
            return []
        for inp in inputs:
            ctx = self._ctx.get(inp.seq_id)
            if (ctx is None or inp.spec.num_draft_tokens != self.block_size or inp.committed_len >= self.max_context_len
                    or (ctx.pending is not None and ctx.pending.shape[0] > self.block_size)):
                return []
        return inputs

    def _inject(self, seq_ids: list[str]) -> set[str]:
        """Write the pending context features of these sequences into the draft KV (one projection for all); returns
        the sequences whose context is complete. A sequence that runs out of KV blocks is dropped (its next Propose is
        answered STALE and the gateway re-syncs it; meanwhile its steps are target-only)."""
        bm, window = self.block_manager, self.window_size
        rows, positions, slots, ready = [], [], [], set()
        for seq_id in seq_ids:
            ctx = self._ctx[seq_id]
            if ctx.pending is None:
                ready.add(seq_id)
                continue
            feats, start = ctx.pending, ctx.pending_start
            end = start + feats.shape[0]
            if window is not None and feats.shape[0] > window:  # only the last W positions are ever read
                feats, start = feats[-window:], end - window
            try:
                bm.ensure_capacity(seq_id, end if window is None else min(end, window))
            except OutOfKVBlocks:
                logger.warning("DFLASH draft KV full: seq %s drafts nothing until it is re-synced", seq_id)
                self._on_release(seq_id)
                continue
            index = list(range(start, end)) if window is None else [p % window for p in range(start, end)]
            slots.extend(bm.slot(seq_id, i) for i in index)
            rows.append(feats)
            positions.extend(range(start, end))
            ctx.end, ctx.pending = end, None
            ready.add(seq_id)
        if rows:
            feats = torch.cat(rows).to(self.device, self.dtype)  # (N, K*H_t)
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            slot_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
            for layer, (k, v) in enumerate(self.model.context_kv(feats, pos)):  # (N, kvh, hd) each
                self.kv_pool.write(layer, slot_t, k, v)
        return ready

    def _draft_static(self, group: list[ProposeInput]) -> dict[str, DraftTree] | None:
        """The block forward of these sequences as the static step (when enabled and every sequence fits it), their
        pending context rows (at most a block each) injected in the same step; the block's K/V go to scratch slots
        just past each context, given back after. None = nothing done (draft eagerly)."""
        step, bm, block = self._block_step, self.block_manager, self.block_size
        if step is None or not group or len(group) > step.max_bs:
            return None
        window = self.window_size
        plans = []  # (input, context end before, pending rows or None, context end after, context KV length after)
        for inp in group:
            ctx = self._ctx[inp.seq_id]
            rows = ctx.pending
            if rows is not None and rows.shape[0] > block:
                return None
            after = ctx.end + (0 if rows is None else rows.shape[0])
            held = after if window is None else min(after, window)  # a window: the ring of its last W positions
            if not step.fits(held):
                return None
            plans.append((inp, ctx.end, rows, after, held))
        try:
            for inp, _, _, _, held in plans:
                bm.ensure_capacity(inp.seq_id, held + block)
        except OutOfKVBlocks:
            for inp, before, _, _, _ in plans:
                bm.truncate(inp.seq_id, before if window is None else min(before, window))
            return None
        items = []
        for inp, before, rows, after, held in plans:
            ring = range(before, after) if window is None else [p % window for p in range(before, after)]
            items.append(BlockItem(self._tokens[inp.seq_id][-1], inp.committed_len - 1, held,
                                   bm.slots(inp.seq_id, held, held + block), bm.block_table(inp.seq_id), before,
                                   [bm.slot(inp.seq_id, i) for i in ring], rows))
        trees = {}
        for (inp, _, _, after, held), chain in zip(plans, step.propose(items)):
            ctx = self._ctx[inp.seq_id]
            ctx.end, ctx.pending, ctx.pending_start = after, None, after  # the context rows are in the KV now
            bm.truncate(inp.seq_id, held)  # the block's slots were scratch
            trees[inp.seq_id] = DraftTree.chain(chain[:self.max_context_len - inp.committed_len])
        return trees

    def _draft_blocks(self, group: list[ProposeInput], block: int) -> dict[str, DraftTree]:
        """One forward over every sequence's block [t_{C-1}, MASK x (block-1)] at positions C-1..; the argmax of rows
        1.. is the chain (cut where it would pass the context length)."""
        bm, window = self.block_manager, self.window_size
        lens = [self._ctx[inp.seq_id].end if window is None else min(self._ctx[inp.seq_id].end, window)
                for inp in group]
        width = max(_CTX_ALIGN, -(-max(lens) // _CTX_ALIGN) * _CTX_ALIGN)  # padded context length
        b, bs = len(group), bm.block_size
        tables = [bm.block_table(inp.seq_id) for inp in group]
        table = torch.zeros(b, -(-width // bs), dtype=torch.int64)  # (b, blocks): padded block tables
        for i, blocks in enumerate(tables):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        j = torch.arange(width)
        index = (table[:, j // bs] * bs + j % bs).to(self.device)  # (b, width) KV slots; padding is masked out
        visible = torch.arange(width + block).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # (b, width + block)
        visible[:, width:] = True  # the whole block, both directions
        mask = visible.to(self.device).view(b, 1, 1, width + block).expand(b, 1, block, width + block)
        ids = torch.full((b, block), self.mask_token_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor([self._tokens[inp.seq_id][-1] for inp in group])
        positions = torch.tensor([inp.committed_len - 1 for inp in group]).unsqueeze(1) + torch.arange(block)
        context = [(self.kv_pool.k(layer)[index], self.kv_pool.v(layer)[index])  # (b, width, kvh, hd) each
                   for layer in range(self.model.num_layers)]
        hidden = self.model(ids.to(self.device), positions.to(self.device), context, mask)  # (b, block, H)
        drafts = self.model.compute_logits(hidden[:, 1:]).argmax(dim=-1).tolist()  # (b, block - 1): one readback
        trees = {}
        for inp, chain in zip(group, drafts):
            chain = chain[:self.max_context_len - inp.committed_len]  # draft i sits at position C-1+i
            trees[inp.seq_id] = DraftTree.chain(chain)
        return trees


def build(build) -> tuple[DFlashProposer, str]:
    """Registry factory (core/algorithms.py): the DFlash draft of --speculative-draft-model-path with the target's
    embedding and lm_head. build: tandem.services.DraftBuild."""
    args = build.args
    path = str(args.speculative_draft_model_path)
    engine_config = build.engine_config()
    build.loading(path, engine_config)
    return DFlashProposer(build.target_path, path, engine_config,
                          window_size=getattr(args, "speculative_draft_window_size", None)), path
