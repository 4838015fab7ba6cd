"""Proposer interface of the draft service and the per-sequence bookkeeping every proposer shares (its inputs and
outputs are the step items of core/steps.py).

A proposer keeps, per sequence, the committed tokens it has been told. Each Propose names the committed length and
the newly committed tail; the proposer rolls back to where the tail starts (dropping its own speculative state) and
answers STALE when it knows too little to do so. It never decides what is committed.

A pre-draft (`append_guess`, overlapped drafting) extends the sequence by the gateway's guess of the accepted tokens
plus the proposer's own greedy next token, and drafts from there; that hypothetical tail is ordinary speculative
state, dropped by the next Propose's rollback when the guess was wrong. A feature draft gets the target's features of
the committed tokens only (the guessed path is still being verified): `_guess_next` runs its head over the path with
its own hidden states in their place (`_guess_tails` holds each sequence's path until then).
"""
from __future__ import annotations

import abc

import torch

from core.steps import ProposeInput, ProposeOutput, SpecShape
from core.types import DraftTree
from core.types import SeqStatus as Status


class StaleSequence(Exception):
    """Raised by `_on_rollback` when the proposer dropped what it needs to continue from the kept tokens: the
    sequence is released and answered STALE, and the gateway re-syncs it with a prefill."""


class Proposer(abc.ABC):
    """Base class: tracks committed tokens per sequence; subclasses draft."""

    algorithm: str = ""
    needs_features: bool = False  # True: prefill and propose must carry target features
    runner = None  # the draft model's ModelRunner (its KV); None for proposers without a draft model

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._static_steps: dict[SpecShape, object] = {}  # SpecShape -> runtime.speculative.draft_step step
        self._guess_tails: dict[str, list[int]] = {}  # feature pre-drafts: the guessed path, for _guess_next

    def enable_static_step(self, spec: SpecShape, max_bs: int) -> bool:
        """Propose batches of this shape through runtime/speculative/draft_step.py: the whole Propose as static device
        code, one CUDA graph per batch bucket (captured here) on CUDA, eager elsewhere. Only model drafters whose
        runner uses the triton backend (static attention metadata) can; returns whether this one does."""
        runner = self.runner
        if runner is None or not hasattr(runner.attn_backend, "use_static_metadata") or spec.num_draft_tokens < 2:
            return False
        step = self._new_static_step(spec, max_bs)
        if step is None:
            return False
        step.capture()
        self._static_steps[spec] = step
        return True

    def _new_static_step(self, spec: SpecShape, max_bs: int):
        """The static step of this shape (not captured yet), or None when this proposer drafts it eagerly only."""
        from runtime.speculative.draft_step import StaticDraftStep, StepShape

        shape = StepShape(spec.num_steps, spec.topk, spec.num_draft_tokens, catch_up=spec.num_steps + 1)
        return StaticDraftStep(self.runner, shape, max_bs, feature_head=self.needs_features)

    def _reserve_static(self, step, plans: list[tuple[ProposeInput, int, int]]) -> bool:
        """plans: (input, start, end): the static step's catch-up writes draft KV [start, end), its tree nodes follow.
        Unless every span fits the step (False, nothing changed): rolls each sequence's KV back to start and reserves
        [0, end + num_steps * topk)."""
        shape, bm = step.shape, self.runner.block_manager
        scratch = shape.num_steps * shape.topk
        for _, start, end in plans:
            if not 1 <= end - start <= shape.catch_up or bm.blocks_for(end + scratch) > step.max_blocks:
                return False
        for inp, start, _ in plans:
            if start < self.runner.kv_len(inp.seq_id):
                self.runner.truncate(inp.seq_id, start)
        self.runner.reserve({inp.seq_id: end + scratch for inp, _, end in plans})
        return True

    def _static_step_for(self, inputs: list[ProposeInput]):
        """The static step that can run this whole batch (one shape, within its largest bucket), or None."""
        if not inputs or not self._static_steps:
            return None
        spec = inputs[0].spec
        step = self._static_steps.get(spec)
        if step is None or len(inputs) > step.max_bs or any(inp.spec != spec for inp in inputs):
            return None
        return step

    def prefill(self, seq_id: str, token_ids: list[int], features: torch.Tensor | None = None) -> Status:
        """features: (len(token_ids) - 1, F), row i = the target feature of token_ids[i] (feature drafts only)."""
        self.release([seq_id])
        if self.needs_features and not _rows_ok(features, max(len(token_ids) - 1, 0), self._feature_width):
            return Status.INVALID
        self._tokens[seq_id] = list(token_ids)
        self._on_prefill(seq_id)
        if features is not None and self.needs_features:
            self._on_features(seq_id, features)
        return Status.OK

    def propose(self, inputs: list[ProposeInput]) -> list[ProposeOutput]:
        outputs: list[ProposeOutput] = []
        ready: list[ProposeInput] = []
        for inp in inputs:
            out = ProposeOutput(inp.seq_id, base_committed_len=inp.committed_len)
            outputs.append(out)
            tokens = self._tokens.get(inp.seq_id)
            start = inp.committed_len - len(inp.new_token_ids)
            known = len(inp.new_token_ids)  # new tokens the target committed (a feature pre-draft: the rows sent)
            if self.needs_features and inp.append_guess:
                known = 0 if inp.features is None else inp.features.shape[0]
                if not 0 <= known < len(inp.new_token_ids):
                    out.status, out.error = Status.INVALID, "a pre-draft needs a guessed path after the feature rows"
                    continue
            if self.needs_features and not _rows_ok(inp.features, known, self._feature_width):
                width = self._feature_width or "F"
                out.status, out.error = Status.INVALID, f"features must be (len(new_token_ids), {width})"
                continue
            if tokens is None or start < 0 or start > len(tokens):
                out.status, out.error = Status.STALE, "unknown sequence or committed tokens missing"
                continue
            del tokens[start:]
            tokens.extend(inp.new_token_ids[:known])
            try:
                self._on_rollback(inp.seq_id, start)
            except StaleSequence as exc:  # the proposer cannot rebuild its state from here: the gateway re-syncs
                self.release([inp.seq_id])
                out.status, out.error = Status.STALE, str(exc)
                continue
            if self.needs_features and known:
                self._on_features(inp.seq_id, inp.features)
            if known < len(inp.new_token_ids):  # the committed part as the input; the path waits for _guess_next
                self._guess_tails[inp.seq_id] = inp.new_token_ids[known:]
                inp = ProposeInput(inp.seq_id, start + known, inp.new_token_ids[:known], inp.spec, inp.features,
                                   True, inp.sampling)
            ready.append(inp)
        ready = self._append_guesses(ready, {o.seq_id: o for o in outputs})
        trees = self._draft(ready) if ready else []
        by_id = {o.seq_id: o for o in outputs}
        for inp, tree in zip(ready, trees):
            by_id[inp.seq_id].tree = tree
        return outputs

    def release(self, seq_ids: list[str]) -> int:
        released = 0
        for seq_id in seq_ids:
            if self._tokens.pop(seq_id, None) is not None:
                released += 1
            self._on_release(seq_id)
        return released

    def catch_up_tokens(self, inputs: list[ProposeInput]) -> int:
        """Committed tokens a Propose of these inputs runs through the draft model before drafting, all sequences
        together (the part of its work a request can make unbounded: the draft's first Propose after a prefill
        catches up the whole prompt). Proposers without a model count the new tokens."""
        total = 0
        for inp in inputs:
            seen = self._model_kv_len(inp.seq_id)
            total += len(inp.new_token_ids) if seen is None else max(0, inp.committed_len - seen)
        return total

    @property
    def num_seqs(self) -> int:
        return len(self._tokens)

    def memory(self) -> tuple[int, int]:
        """(free, total) KV tokens; proposers without KV report zeros."""
        return 0, 0

    def _append_guesses(self, ready: list[ProposeInput], by_id: dict[str, ProposeOutput]) -> list[ProposeInput]:
        """Pre-drafts: append each one's guessed next token; drop (INVALID) those the proposer cannot guess for."""
        guess_inputs = [inp for inp in ready if inp.append_guess]
        if not guess_inputs:
            return ready
        try:
            guesses = self._guess_next(guess_inputs)
        finally:
            self._guess_tails.clear()
        kept = []
        for inp in ready:
            if not inp.append_guess:
                kept.append(inp)
                continue
            out = by_id[inp.seq_id]
            token = guesses.get(inp.seq_id)
            if token is None:
                out.status, out.error = Status.INVALID, f"{self.algorithm} cannot pre-draft this sequence"
                continue
            tokens = self._tokens[inp.seq_id]  # a feature draft's _guess_next appended the guessed path
            tokens.append(token)
            out.guessed_token_ids = [token]
            out.base_committed_len = len(tokens)
            start = inp.committed_len - len(inp.new_token_ids)  # where this Propose's new tokens began
            # still a pre-draft for _draft: its tokens end with the guessed path and the token just appended
            kept.append(ProposeInput(inp.seq_id, len(tokens), tokens[start:], inp.spec, append_guess=True,
                                     sampling=inp.sampling))
        return kept

    @property
    def _feature_width(self) -> int | None:
        """Width every feature row must have (a feature draft's `feature_size`); None = not checked here."""
        return getattr(self, "feature_size", None)

    # Hooks for subclasses.
    def _model_kv_len(self, seq_id: str) -> int | None:
        """Committed positions the draft model's KV already covers for this sequence (0 if none); None for
        proposers without a draft model."""
        if self.runner is None:
            return None
        return self.runner.kv_len(seq_id) if self.runner.has_seq(seq_id) else 0

    def _guess_next(self, inputs: list[ProposeInput]) -> dict[str, int]:
        """The proposer's greedy next token after each sequence's tokens (pre-drafts); absent = cannot guess. A
        feature draft first appends each sequence's guessed path (`_guess_tails`) to its tokens and state."""
        return {}

    def _on_prefill(self, seq_id: str) -> None:
        pass

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        """Committed tokens past `kept_len` were replaced; drop state derived from them (StaleSequence: cannot)."""

    def _on_release(self, seq_id: str) -> None:
        pass

    def _on_features(self, seq_id: str, features: torch.Tensor) -> None:
        """(n, F) target features of committed tokens [C-1-n, C-1), C = the committed length now: each is the feature
        of the token just before one of the last n committed tokens (row 0 is meaningless when C-1-n = -1)."""

    @abc.abstractmethod
    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        """One tree per input, rooted at the last committed token (`self._tokens[seq_id][-1]`)."""


def _rows_ok(features: torch.Tensor | None, num_rows: int, width: int | None = None) -> bool:
    if features is None:
        return num_rows == 0
    return (features.dim() == 2 and features.shape[0] == num_rows
            and (width is None or num_rows == 0 or features.shape[1] == width))
