"""Continuous speculative steps of a target and the draft in its process, chained on the device
(runtime/speculative/fused_step.py): a Verify call's k steps run as one device run with one readback, instead of two
host round trips (verify readback, draft readback) per step.

Used by TargetServicer for the sequences of a call that can take it (greedy without logprobs or penalties, the served
tree shape with static verify and draft steps, target and draft exactly as the last static Propose left them, room
for the run): the whole call when its trees are the draft's last proposals (`_chain_call`), else the steps after
the first (`_chained_steps`). The other sequences of the call, and any run whose KV reservation fails, take the
step-by-step path in the same call. Output is that path's: the same static steps run the same device code, and the
commit applies stops and length limits step by step."""
from __future__ import annotations

import logging

from core.steps import ProposeOutput, SpecShape, StepOutput, VerifyInput
from core.types import ROOT, DraftTree
from core.types import SeqStatus as Status

logger = logging.getLogger(__name__)


class ChainedSteps:
    def __init__(self, engine, proposer) -> None:
        """engine: the TargetEngine; proposer: the co-located draft's ModelDrafter."""
        self.engine, self.proposer = engine, proposer
        self.fused: dict[SpecShape, object] = {}  # shape -> runtime.speculative.fused_step.FusedSteps
        self.num_runs = 0  # chained runs (device runs of several steps)
        self.num_steps = 0  # sequence-steps they ran

    def enable(self, max_steps: int = 16) -> list[SpecShape]:
        """FusedSteps for every shape both the draft's static step and the target's static verify step take; the
        glue graphs are captured here (CUDA). Returns the shapes."""
        from runtime.speculative.fused_step import FusedSteps

        verify = self.engine._static_verify
        if verify is None or not getattr(self.proposer, "chainable", False):
            return []
        for spec in self.proposer.chain_shapes():
            draft = self.proposer.chain_step(spec)
            if draft is None or spec.num_draft_tokens != verify.width or draft.sizes != verify.sizes:
                continue
            source = self.proposer.chain_tree_source(spec, verify.max_bs, self._span(spec, draft, max_steps))
            try:
                fused = FusedSteps(verify, draft, max_steps, tree_source=source)
            except ValueError as exc:  # e.g. a draft step whose trees are capped below the served width
                logger.info("speculative steps of %s are not chained: %s", spec, exc)
                continue
            fused.capture()
            self.fused[spec] = fused
        return list(self.fused)

    def _ready(self, inp: VerifyInput, spec: SpecShape, steps: int, max_accept: int) -> bool:
        # a tree no deeper than the draft's steps: its accepted path fits the catch-up window and the KV reserved
        return (inp.propose_next == spec and inp.tree.draft_probs is None and bool(inp.tree.token_ids)
                and max(inp.tree.depths()) < spec.num_steps
                and self.engine.chain_ready(inp, steps, max_accept)
                and self.proposer.chain_ready(inp.seq_id, inp.committed_len, spec, steps, max_accept))

    @staticmethod
    def _span(spec: SpecShape, draft, steps: int) -> int:
        """Committed positions a chained run of `steps` steps may draft at, from its start: every step's accepted
        path (at most a whole path and the bonus) then the last tree's depth."""
        return steps * min(draft.shape.num_draft_tokens, draft.shape.catch_up) + spec.num_steps + 1

    def run(self, inputs: list[VerifyInput], steps: int) -> dict[str, StepOutput]:
        """inputs: each sequence's next step (its committed length, root and tree: a tree this draft drafted, as its
        last static Propose left it). Runs `steps` chained steps of those that can take them — the served shape,
        greedy without logprobs or penalties, target and draft where the tree left them, room for the run — and
        returns the outcome of each of those, as one output covering the steps (tokens, counts, the proposal drafted
        after the last step); the others (absent) run as usual."""
        if not inputs or steps < 1:
            return {}
        spec = inputs[0].propose_next
        fused = self.fused.get(spec)
        if fused is None:
            return {}
        steps = min(steps, fused.max_steps)
        inputs = [inp for inp in inputs if self._ready(inp, spec, steps, fused.max_accept)][:fused.max_bs]
        if not inputs:
            return {}
        # No more steps than some sequence can use: near the length limits a shorter run, then the next call, instead
        # of device steps whose output is dropped (128 tokens at tau 7.5: 17 steps, 20 in runs of 4)
        steps = min(steps, max(self.engine.chain_useful_steps(inp, fused.max_accept) for inp in inputs))
        targets = self.engine.chain_reserve(inputs, steps, fused.max_accept)
        if targets is None:
            return {}
        drafts = self.proposer.chain_reserve([(inp.seq_id, inp.committed_len) for inp in inputs], spec, steps,
                                             fused.max_accept)
        if drafts is None:
            self.engine.chain_abort(inputs)
            return {}
        from runtime.speculative.fused_step import ChainSeq

        seqs = [ChainSeq(inp.root_token_id, t_start, d_start, t_table, d_table, list(inp.tree.token_ids),
                         [-1 if p == ROOT else p for p in inp.tree.parents])
                for inp, (t_start, t_table), (d_start, d_table) in zip(inputs, targets, drafts)]
        rows = None
        if fused.tree_source is not None:
            rows = self.proposer.chain_tree_rows([inp.seq_id for inp in inputs], spec,
                                                 self._span(spec, fused.draft, steps))
        try:
            results = fused.run(seqs, steps, rows)
        except Exception:  # noqa: BLE001 - a bug here must not fail requests: this shape steps one by one from now
            logger.exception("chained speculative steps of %s failed; running them step by step from now on", spec)
            self.fused.pop(spec, None)
            self.engine.chain_abort(inputs)
            self.proposer.chain_abort([inp.seq_id for inp in inputs])
            return {}
        self.num_runs += 1
        self.num_steps += steps * len(inputs)
        outputs = {}
        for inp, res in zip(inputs, results):
            out = self.engine.chain_commit(inp, res.steps)
            self.proposer.chain_commit(inp.seq_id, [t for tokens in res.steps for t in tokens], res.last_feature)
            if out.finish_reason is None:
                tree = DraftTree(res.tree_tokens, [ROOT if p < 0 else p for p in res.tree_parents])
                out.proposal = ProposeOutput(inp.seq_id, Status.OK, tree,
                                             base_committed_len=inp.committed_len + len(out.token_ids))
            outputs[inp.seq_id] = out
        return outputs
