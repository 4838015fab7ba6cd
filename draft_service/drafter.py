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
