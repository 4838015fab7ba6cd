"""ModelDrafter: the Propose skeleton every proposer with a draft model over its own paged KV shares (STANDALONE,
the EAGLE family, SYNTHETIC's head): fits → catch-up → expand → finalize, either eagerly (one batched catch-up
forward, then one batched forward per tree step) or as one static device step (runtime/speculative/draft_step.py).

Subclasses say what their KV holds and how their model runs: `_fits`, `_catch_up`, `_expand`, and the catch-up
window of the static step (`_catch_up_start`, `_catch_up_features`, `_caught_up`). Knows nothing about the wire.
"""
from __future__ import annotations

import abc
from collections import defaultdict

from core.steps import ProposeInput, SpecShape
from core.types import DraftTree
from draft_service.proposer import Proposer
from runtime.kv_cache import OutOfKVBlocks
from runtime.speculative.draft_step import CatchUp


class ModelDrafter(Proposer):
    """A proposer whose draft model keeps KV for the committed tokens and drafts a chain or top-k tree after them."""

    # Committed positions the draft KV lags the committed tokens by: 0 for a plain LM (its KV holds [0, C)), 1 for
    # feature heads (position p holds (t_{p+1}, f_p), so the KV holds [0, C-1)).
    kv_lag: int = 0

    def memory(self) -> tuple[int, int]:
        return self.runner.num_free_tokens(), self.runner.num_total_tokens()

    def _on_release(self, seq_id: str) -> None:
        if self.runner.has_seq(seq_id):
            self.runner.free_seq(seq_id)

    # ---- the skeleton ----------------------------------------------------------------------------------------------
    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        # Sequences that do not fit (context limit, KV, shape) get no proposal: the target decodes them alone.
        active = [inp for inp in inputs if self._fits(inp)]
        trees = self._draft_static(active) if self._static_allowed(active) else None
        if trees is None:
            trees = self._draft_eager(active)
        return [trees.get(inp.seq_id, DraftTree([], [])) for inp in inputs]

    # Whether `_catch_up` leaves a sequence where the static step can take over (multi-layer EAGLE: no, its layers'
    # windows are the static step's own).
    _eager_catch_up_first: bool = True

    def _draft_eager(self, inputs: list[ProposeInput]) -> dict[str, DraftTree]:
        """Catch up the committed tokens (one batched forward), expand each shape's group step by step, then drop the
        speculative nodes' KV: the committed KV stays for the next Propose."""
        roots = self._catch_up(inputs)
        groups: dict[SpecShape, list[ProposeInput]] = defaultdict(list)
        for inp in inputs:
            groups[inp.spec].append(inp)
        trees: dict[str, DraftTree] = {}
        for spec, group in groups.items():
            for inp, tree in zip(group, self._expand(group, spec, [roots[inp.seq_id] for inp in group])):
                trees[inp.seq_id] = tree
        for inp in inputs:
            self.runner.truncate(inp.seq_id, inp.committed_len - self.kv_lag)
        return trees

    def _draft_static(self, inputs: list[ProposeInput]) -> dict[str, DraftTree] | None:
        """The whole Propose as one static device step (runtime/speculative/draft_step.py) when one was enabled for
        this shape and every sequence's catch-up fits it; None = draft eagerly."""
        step = self._static_step_for(inputs)
        if step is None:
            return None
        if self._eager_catch_up_first:
            # The step re-runs at most `catch_up` positions (what one verify commits); a sequence further behind --
            # its first Propose, a whole prompt -- is caught up eagerly first (one batched forward, as a prefill), so
            # its tree still comes from this one step, not from num_steps eager forwards with a top-k and tree
            # bookkeeping each (EAGLE3 5/4/16 on the bundled head, a 200-token prompt: 1,099 dispatched ops before,
            # 190 and one graph replay now -- host time of every request's start on a GPU). The step then re-runs
            # the root's position alone.
            behind = [inp for inp in inputs
                      if inp.committed_len - self.kv_lag - self._catch_up_start(inp) > step.shape.catch_up]
            if behind:
                self._catch_up(behind)
        # The catch-up writes KV [start, end), end = the committed KV end; it re-runs at least the root's position
        # (its output starts the tree).
        plans = [(inp, self._catch_up_start(inp), inp.committed_len - self.kv_lag) for inp in inputs]
        if not self._reserve_static(step, plans):
            return None
        bm, lag = self.runner.block_manager, self.kv_lag
        items = [CatchUp(self._tokens[inp.seq_id][start + lag:end + lag], start, bm.slots(inp.seq_id, start, end),
                         bm.block_table(inp.seq_id), self._catch_up_features(inp, start, end),
                         self._catch_up_own(inp, start, end))
                 for inp, start, end in plans]
        trees = step.propose(items)
        for inp, _, end in plans:  # the catch-up is committed, the tree nodes were scratch
            self.runner.written(inp.seq_id, end)
            self._caught_up(inp)
        return {inp.seq_id: tree for (inp, _, _), tree in zip(plans, trees)}

    # ---- chained speculative steps (runtime/speculative/fused_step.py) ----------------------------------------------
    chainable: bool = False  # subclasses whose state after a static Propose chain_commit can rebuild

    def chain_shapes(self) -> list[SpecShape]:
        """The shapes a chained run may draft (those with a static step)."""
        return list(self._static_steps)

    def chain_tree_source(self, spec: SpecShape, max_bs: int, span: int):
        """Where a chained run's trees come from instead of the draft step's output; None: the draft step's."""
        return None

    def chain_step(self, spec: SpecShape):
        """The static draft step a chained run of this shape drafts with (a plain StaticDraftStep), or None."""
        from runtime.speculative.draft_step import StaticDraftStep

        step = self._static_steps.get(spec)
        return step if self.chainable and type(step) is StaticDraftStep else None

    def chain_ready(self, seq_id: str, committed_len: int, spec: SpecShape, num_steps: int, max_accept: int) -> bool:
        """Whether this sequence can take a chained run of num_steps steps: exactly as a static Propose of its last
        tree left it (its tokens, KV end, no pre-drafted rows), with room for the run."""
        step = self.chain_step(spec)
        tokens = self._tokens.get(seq_id)
        if (step is None or tokens is None or len(tokens) != committed_len or not self.runner.has_seq(seq_id)
                or self.runner.kv_len(seq_id) != committed_len - self.kv_lag or not self._chain_ready(seq_id)):
            return False
        total = self._chain_total(committed_len, spec, num_steps, max_accept)
        return (total + self.kv_lag < self.runner.model_config.max_position_embeddings
                and self.runner.block_manager.blocks_for(total) <= step.max_blocks)

    def _chain_total(self, committed_len: int, spec: SpecShape, num_steps: int, max_accept: int) -> int:
        """Draft KV a chained run may write: every step's catch-up as long as it can be, the tree nodes after."""
        return committed_len - self.kv_lag + num_steps * max_accept + spec.num_steps * spec.topk

    def chain_reserve(self, seqs: list[tuple[str, int]], spec: SpecShape, num_steps: int,
                      max_accept: int) -> list[tuple[int, list[int]]] | None:
        """seqs: (seq_id, committed length), each chain_ready. Reserves the worst case's draft KV, all or nothing.
        Returns each sequence's (catch-up start, block table), or None: nothing changed."""
        totals = {seq_id: self._chain_total(committed_len, spec, num_steps, max_accept)
                  for seq_id, committed_len in seqs}
        try:
            self.runner.reserve(totals)
        except OutOfKVBlocks:
            return None
        return [(self.runner.kv_len(seq_id), self.runner.block_manager.block_table(seq_id)) for seq_id, _ in seqs]

    def chain_commit(self, seq_id: str, new_tokens: list[int], last_feature) -> None:
        """After a chained run: the sequence's committed tokens grew by new_tokens (every step's, caught up by the
        draft's last catch-up); last_feature: the target feature of the last kept row (feature heads)."""
        tokens = self._tokens[seq_id]
        tokens.extend(new_tokens)
        self.runner.written(seq_id, len(tokens) - self.kv_lag)
        self._chain_committed(seq_id, last_feature)

    def chain_abort(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if self.runner.has_seq(seq_id):
                self.runner.written(seq_id, self.runner.kv_len(seq_id))

    # ---- hooks -----------------------------------------------------------------------------------------------------
    def _static_allowed(self, inputs: list[ProposeInput]) -> bool:
        """Whether this batch may take the static step at all (e.g. not when a chain must be sampled)."""
        return True

    def _catch_up_start(self, inp: ProposeInput) -> int:
        """First KV position the static catch-up writes: at least the root's, so that its output starts the tree."""
        return min(self.runner.kv_len(inp.seq_id), inp.committed_len - self.kv_lag - 1)

    def _catch_up_features(self, inp: ProposeInput, start: int, end: int):
        """(end - start, F) raw features of the catch-up positions for feature heads; None for token-only drafts."""
        return None

    def _catch_up_own(self, inp: ProposeInput, start: int, end: int) -> dict[int, object] | None:
        """Catch-up rows (index from `start`) whose input is the draft's own recurrent hidden, not a target feature
        (feature heads during a pre-draft); None = none."""
        return None

    def _caught_up(self, inp: ProposeInput) -> None:
        """After a static catch-up wrote this sequence's committed KV."""

    def _chain_ready(self, seq_id: str) -> bool:
        """Whether this sequence's state lets a chained run start (e.g. no pre-drafted rows)."""
        return True

    def _chain_committed(self, seq_id: str, last_feature) -> None:
        """After chain_commit: what a static Propose's `_caught_up` leaves (feature tails, prefix cache)."""

    @abc.abstractmethod
    def _fits(self, inp: ProposeInput) -> bool:
        """Whether this sequence can be drafted now (shape, context limit, free KV)."""

    @abc.abstractmethod
    def _catch_up(self, inputs: list[ProposeInput]) -> dict:
        """Run the draft over the committed positions it has not seen; per sequence, what starts its tree (the
        draft's output at the root's position) as `_expand` takes it."""

    @abc.abstractmethod
    def _expand(self, group: list[ProposeInput], spec: SpecShape, roots: list) -> list[DraftTree]:
        """One tree per sequence of a group of one shape, from what `_catch_up` returned for each."""
