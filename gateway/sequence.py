"""One running request as the gateway sees it: the committed token list (source of truth), output streaming,
incremental detokenization with stop strings, and speculative statistics.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from core.steps import SpecShape
from core.types import DraftTree, StopRule
from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.features import FeatureLog
from gateway.types import FinishReason, GenerateChunk, GenerateParams, Usage


@dataclass
class Predraft:
    """A tree drafted for the next step during this step's verify, valid only if the committed tokens become exactly
    committed[:base_len - len(tail)] + tail (the guessed accepted path plus the draft's guess of the bonus)."""

    pod: object  # the DraftClient that holds the guessed tail
    base_len: int
    tail: list[int]
    tree: DraftTree
    shape: SpecShape | None = None  # the shape it was drafted with (a co-located draft's proposal)

    def matches(self, committed: list[int]) -> bool:
        return len(committed) == self.base_len and committed[self.base_len - len(self.tail):] == self.tail


class Sequence:
    def __init__(self, seq_id: str, params: GenerateParams, tokenizer, deadline: float, stop: StopRule):
        self.seq_id = seq_id
        self.params = params
        self.request_id = params.request_id
        self.deadline = deadline
        self.stop = stop
        self.committed: list[int] = list(params.prompt_token_ids)  # prompt + output; the last one has no KV yet
        self.prompt_len = len(params.prompt_token_ids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.aborted = False
        self.needs_target_prefill = False  # set when the target answered STALE: re-sync from `committed`
        self.no_target_since: float | None = None  # when it found no live target pod (it waits for one, bounded)
        self.draft_synced_len = 0  # committed tokens the draft pod knows; 0 = it must be (re-)prefilled
        # target features of committed[:-1] for feature drafts; with the draft in the target's process the rows of
        # fused steps stay on the pod and the log starts after them (FeatureLog.start): enough for that draft, not
        # for re-prefilling one that lost its state
        self.features = FeatureLog()
        self.target = None  # TargetClient of the pod holding this sequence's KV (sticky while it is up)
        self.draft = None  # DraftClient of its draft pod, None = unassigned
        self.target_failures = 0  # target pod failures this request has survived (max_pod_failures bounds them)
        self.verify_steps = 0
        self.accepted_draft_tokens = 0
        self.proposed_draft_tokens = 0
        self.predraft: Predraft | None = None  # overlapped drafting: the tree pre-drafted for the next step
        # a draft in the target pod's process: the tree it drafted right after the last Verify (VerifyInput.
        # propose_next) for the next step; a Predraft with no guessed tail
        self.proposal: Predraft | None = None
        self.predraft_hits = 0
        self.predraft_misses = 0
        self.cached_prompt_tokens = 0  # prompt tokens the target's prefix cache served at the first prefill
        self._detok = IncrementalDetokenizer(tokenizer) if params.detokenize else None
        self._stops = StopStringMatcher(params.stop) if params.detokenize and params.stop else None
        self._outbox: list[tuple[list[int], list | None]] = []  # committed, not yet detokenized/streamed (deliver)

    @property
    def num_output(self) -> int:
        return len(self.committed) - self.prompt_len

    def record_step(self, num_accepted: int, num_proposed: int, num_steps: int = 1) -> None:
        """num_steps: target forwards the result covered (a continuous decode covers several)."""
        self.verify_steps += num_steps
        self.accepted_draft_tokens += num_accepted
        self.proposed_draft_tokens += num_proposed

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=self.num_output,
                     verify_steps=self.verify_steps, accepted_draft_tokens=self.accepted_draft_tokens,
                     proposed_draft_tokens=self.proposed_draft_tokens, predraft_hits=self.predraft_hits,
                     predraft_misses=self.predraft_misses, cached_prompt_tokens=self.cached_prompt_tokens)

    def commit(self, token_ids: list[int], finish: FinishReason | None,
               logprobs: list[tuple[float, list[int], list[float]]] | None = None, defer: bool = False) -> None:
        """Append tokens the target accepted and stream them; apply stop strings. logprobs: one entry per token
        when the request asked for them. defer: only append them to `committed` now (the next Propose needs them)
        and detokenize, match stop strings and stream them at `deliver`, which the scheduler calls while that
        Propose is in flight; a stop string found then ends the sequence with exactly the same output (the tokens
        committed past it are never streamed, and the finished sequence is not verified again)."""
        if self.finished:
            return
        if defer and finish is None:
            self.committed.extend(token_ids)
            self._outbox.append((list(token_ids), logprobs))
            return
        self.deliver()
        if self.finished:  # a stop string in the held tokens
            return
        self._emit(token_ids, finish, logprobs, commit=True)

    def deliver(self) -> None:
        """Detokenize, match stop strings and stream the tokens `commit(defer=True)` held back, in order."""
        outbox, self._outbox = self._outbox, []
        for token_ids, logprobs in outbox:
            if self.finished:
                return
            self._emit(token_ids, None, logprobs, commit=False)

    def _emit(self, token_ids: list[int], finish: FinishReason | None, logprobs, commit: bool) -> None:
        if self.params.logprobs is not None and token_ids:
            logprobs = list(logprobs or [])
            # A target that returned none (an older pod): neutral entries keep the list aligned with the tokens.
            logprobs += [(-9999.0, [], [])] * (len(token_ids) - len(logprobs))
        else:
            logprobs = None
        if commit:
            self.committed.extend(token_ids)
        text, matched = "", None
        if self._detok is not None:
            text = self._detok.push(token_ids)
            if finish is not None:
                text += self._detok.flush()
            if self._stops is not None:
                text, matched = self._stops.push(text)
                if matched is not None:
                    finish = FinishReason.STOP
                elif finish is not None:
                    text += self._stops.flush()
        if finish is None:
            if token_ids or text:
                self.queue.put_nowait(GenerateChunk(token_ids=list(token_ids), text=text, logprobs=logprobs))
            return
        self.finished = True
        self.queue.put_nowait(GenerateChunk(token_ids=list(token_ids), text=text, finish_reason=finish,
                                            usage=self.usage(), matched_stop=matched, logprobs=logprobs))

    def finish(self, reason: FinishReason) -> None:
        self.deliver()  # what was committed before the end is streamed first (unless a stop string ends it there)
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(GenerateChunk(token_ids=[], finish_reason=reason, usage=self.usage()))

    def fail(self, error: Exception) -> None:
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(error)
