"""The draft side of a gateway step: trees from the draft pods (one batched Propose per pod; sequences re-synced from
the committed list after STALE or a pod change; feature rows for EAGLE heads; a failing pod sends its sequences to
target-only steps) and overlapped drafting (`enable_overlap_drafting`, PEARL-style post-verify: while a step's
Verify is in flight, each draft pod pre-drafts the next step from a guess of the outcome — the tree's first-child path
accepted in full, then the draft's own greedy next token as the bonus — used next step only if the guess came true).

The scheduler (gateway/scheduler.py) owns the loop and the sequences; this module only fills `trees` for a step and
the sequences' draft bookkeeping (draft pod, draft_synced_len, predraft and its hit/miss counters).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from dataclasses import dataclass

from core import algorithms
from core.steps import DraftPrefillInput, ProposeInput, ProposeOutput, SpecShape
from core.types import ROOT, DraftTree
from gateway.clients import STATUS_OK, STATUS_STALE, DraftClient, PodUnavailable
from gateway.metrics import GatewayMetrics
from gateway.pods import PodPool
from gateway.sequence import Predraft, Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape sent with every Propose; an algorithm without drafts (NONE) means plain decoding through
    Verify. What the gateway does for the algorithm is read from its registry entry (core/algorithms.py)."""

    algorithm: str = algorithms.NONE.name
    num_steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 1

    @functools.cached_property
    def entry(self) -> algorithms.SpeculativeAlgorithm:
        """Looked up once: needs_features is read per sequence on every step."""
        return algorithms.get(self.algorithm)

    @property
    def shape(self) -> SpecShape:
        return SpecShape(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def enabled(self) -> bool:
        return self.entry.drafts

    @property
    def needs_features(self) -> bool:
        """Feature-based drafts need the target's hidden states of every committed token."""
        return self.entry.needs_features


class Drafting:
    def __init__(self, pool: PodPool, spec: SpecConfig, metrics: GatewayMetrics, enable_overlap: bool,
                 drafts_on_target: bool = False) -> None:
        """drafts_on_target: the draft pods are the target pods (a draft in the target's process: UNO by its
        registry entry, or `--colocate-draft`): a sequence's Propose goes to the pod that holds it, and its Verify asks
        that pod to draft the next tree right after (`fused`)."""
        self.pool = pool
        self.spec = spec
        self.metrics = metrics
        self.enable_overlap = enable_overlap
        self.on_target = spec.entry.drafts_on_target or drafts_on_target

    async def propose(self, seqs: list[Sequence], shape: SpecShape | None = None) -> dict[str, DraftTree]:
        """Trees per sequence from the draft pods (one batched call per pod; a rejection-sampling draft's q rides in
        draft_probs as opaque bytes); sequences without a reachable draft pod get no tree (a target-only step).
        shape: this step's (None = the configured one)."""
        if not self.spec.enabled or not len(self.pool):
            return {}
        groups: dict[object, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            if seq.draft is None or self.pool.is_down(seq.draft) or not self._colocated(seq):
                seq.draft = self._route(seq)
                seq.draft_synced_len = 0
            if seq.draft is None:
                continue
            if self.spec.needs_features and not self._features_ready(seq):
                if seq.features.start > 0:
                    # its draft lost its state after steps whose features stayed on the pod (the log starts after
                    # them): the target recomputes them all in a re-prefill (next iteration), which prefills that
                    # draft again
                    seq.needs_target_prefill, seq.draft_synced_len = True, 0
                    seq.features.reset(None)
                continue
            groups[seq.draft].append(seq)
        if len(groups) == 1:  # (the usual case) no task hop: the call goes out in the caller's first step, before
            (pod, group), = groups.items()  # the host work the scheduler overlaps with it (_propose_delivering)
            return await self._propose_on(pod, group, shape)
        trees: dict[str, DraftTree] = {}
        for part in await asyncio.gather(*(self._propose_on(pod, group, shape) for pod, group in groups.items())):
            trees.update(part)
        return trees

    def _route(self, seq: Sequence) -> DraftClient | None:
        """The sequence's draft pod: rendezvous hashing over the draft pods; when the target pods draft themselves
        (registry drafts_on_target, UNO), the DraftService of the pod that holds the sequence."""
        if not self.on_target:
            return self.pool.route(seq.seq_id)
        target = getattr(seq.target, "address", None)
        return next((c for c in self.pool.live() if c.address == target), None)

    def prefilled_on_pod(self, seq: Sequence) -> None:
        """The target pod prefilled its own draft with this sequence (PrefillInput.prefill_draft): the draft knows
        every committed token and the features stayed there."""
        seq.draft = self._route(seq)
        seq.draft_synced_len = len(seq.committed) if seq.draft is not None else 0
        seq.features.reset(None, start=len(seq.committed) - 1)  # rows from here on, should a step return them

    def _features_ready(self, seq: Sequence) -> bool:
        """The gateway holds the feature rows the sequence's draft has not seen (all of them for a draft to prefill),
        or that draft needs none (it knows every committed token, in the target's process)."""
        need_from = max(seq.draft_synced_len - 1, 0)
        return self._synced_on_pod(seq) or seq.features.covers(need_from, len(seq.committed) - 1)

    def _synced_on_pod(self, seq: Sequence) -> bool:
        """A draft in the target's process that knows every committed token: its Propose needs no feature rows."""
        return (self.on_target and seq.draft is not None and seq.draft_synced_len == len(seq.committed)
                and not self.pool.is_down(seq.draft) and self._colocated(seq))

    def _colocated(self, seq: Sequence) -> bool:
        """False when the target drafts and the sequence moved to another target pod since its last Propose."""
        return not self.on_target or seq.draft.address == getattr(seq.target, "address", None)

    async def _propose_on(self, pod: DraftClient, seqs: list[Sequence], shape: SpecShape | None = None
                          ) -> dict[str, DraftTree]:
        shape = shape or self.spec.shape
        try:
            unsynced = [s for s in seqs if s.draft_synced_len == 0]
            if unsynced:
                statuses = await pod.prefill([DraftPrefillInput(s.seq_id, s.committed[:], self.features(s, 0))
                                              for s in unsynced])
                for seq, status in zip(unsynced, statuses):
                    if status == STATUS_OK:
                        seq.draft_synced_len = len(seq.committed)
            ready = [s for s in seqs if s.draft_synced_len > 0]
            items = [ProposeInput(s.seq_id, len(s.committed), s.committed[s.draft_synced_len:], shape,
                                  self.features(s, s.draft_synced_len - 1), sampling=_sampled(s)) for s in ready]
            proposals = await self.metrics.timed("draft", pod.propose(items)) if items else []
        except (PodUnavailable, ValueError) as exc:
            if isinstance(exc, PodUnavailable):
                self.pool.mark_down(pod, str(exc))
            logger.warning("draft pod %s unusable, these sequences step target-only: %s", pod.address, exc)
            for seq in seqs:
                seq.draft, seq.draft_synced_len = None, 0
            return {}
        trees = {}
        by_id = {s.seq_id: s for s in ready}
        for proposal in proposals:
            seq = by_id[proposal.seq_id]
            if proposal.status == STATUS_STALE:
                seq.draft_synced_len = 0
            elif proposal.status == STATUS_OK and proposal.base_committed_len == len(seq.committed):
                seq.draft_synced_len = len(seq.committed)
                trees[seq.seq_id] = proposal.tree
        return trees

    # ---------------------------------------------------------------- fused verify → propose (drafts on the target)
    def fused(self, seq: Sequence, shape: SpecShape) -> SpecShape | None:
        """`shape` to ask the sequence's Verify to draft next (VerifyInput.propose_next), or None: only when its
        draft lives in the process of the pod that verifies it and knows every committed token."""
        return shape if self._synced_on_pod(seq) else None

    def keep_proposal(self, seq: Sequence, proposal: ProposeOutput, shape: SpecShape) -> None:
        """A Verify's proposal (of `shape`) for the next step (after the step's tokens were committed)."""
        if proposal.status == STATUS_STALE:
            seq.draft_synced_len = 0
        elif proposal.status == STATUS_OK and proposal.base_committed_len == len(seq.committed):
            seq.draft_synced_len = len(seq.committed)
            seq.proposal = Predraft(seq.draft, proposal.base_committed_len, [], proposal.tree, shape)
        elif proposal.status != STATUS_OK:  # INVALID: the draft did not take the tokens; the next Propose sends them
            logger.warning("pod %s did not draft %s after its verify: %s", getattr(seq.draft, "address", None),
                           seq.seq_id, proposal.error)

    def take_proposals(self, seqs: list[Sequence], shape: SpecShape) -> dict[str, DraftTree]:
        """The trees the last Verify drafted for these sequences, where still valid (same pod, same committed length)
        and of this step's shape (an adaptive tier that moved drafts afresh); the others are dropped."""
        trees = {}
        for seq in seqs:
            proposal, seq.proposal = seq.proposal, None
            if (proposal is not None and proposal.pod is seq.draft and not self.pool.is_down(proposal.pod)
                    and proposal.matches(seq.committed) and proposal.shape == shape):
                trees[seq.seq_id] = proposal.tree
        return trees

    def features(self, seq: Sequence, start: int):
        """Feature rows [start, L-1) of a sequence with L committed tokens; None for token-only drafts."""
        if not self.spec.needs_features or start >= len(seq.committed) - 1:
            return None  # (no rows to send: a draft that knows every committed token)
        return seq.features.slice(start, len(seq.committed) - 1)

    # ---------------------------------------------------------------- overlapped drafting
    @property
    def overlap_enabled(self) -> bool:
        # Only proposers that guess (draft_service Proposer._guess_next: STANDALONE, the EAGLE family, SYNTHETIC).
        return self.enable_overlap and self.spec.entry.supports_overlap and len(self.pool) > 0

    def take_predrafts(self, seqs: list[Sequence]) -> dict[str, DraftTree]:
        """Trees pre-drafted last step whose guess came true (hits); the others are dropped (misses)."""
        trees = {}
        for seq in seqs:
            predraft, seq.predraft = seq.predraft, None
            if predraft is None:
                continue
            if predraft.pod is seq.draft and not self.pool.is_down(predraft.pod) and predraft.matches(seq.committed):
                seq.predraft_hits += 1
                self.metrics.predrafts.labels("hit").inc()
                # The draft's guessed tail is now committed (a feature draft keeps the KV it built on its own hidden
                # states there: re-sending the target's features measured +0.1 tau on the demo chain, not worth a
                # catch-up past the static step's window)
                seq.draft_synced_len = predraft.base_len
                trees[seq.seq_id] = predraft.tree
            else:
                seq.predraft_misses += 1  # draft_synced_len still ends before the guess: the next Propose rolls back
                self.metrics.predrafts.labels("miss").inc()
        return trees

    def predraft_items(self, seqs: list[Sequence], trees: dict[str, DraftTree]) -> dict[object, list]:
        """Per draft pod: (seq, committed len now, guessed path, pre-draft Propose) for every sequence with a tree."""
        by_pod: dict[object, list] = defaultdict(list)
        for seq in seqs:
            tree = trees.get(seq.seq_id)
            if not tree or seq.draft is None or seq.draft_synced_len == 0 or seq.finished:
                continue
            path = _first_child_path(tree)
            committed_len = len(seq.committed)
            # A feature draft gets the rows of the committed tokens only; it stands in its own hidden states for the
            # guessed path's (their target features come with this step's Verify).
            item = ProposeInput(seq.seq_id, committed_len + len(path), [*seq.committed[seq.draft_synced_len:], *path],
                                self.spec.shape, self.features(seq, seq.draft_synced_len - 1), append_guess=True,
                                sampling=_sampled(seq))
            by_pod[seq.draft].append((seq, committed_len, path, item))
        return by_pod

    async def predraft(self, by_pod) -> None:
        await asyncio.gather(*(self._predraft_on(pod, entries) for pod, entries in by_pod.items()))

    async def _predraft_on(self, pod: DraftClient, entries: list) -> None:
        try:
            proposals = await self.metrics.timed("draft", pod.propose([item for *_, item in entries]))
        except (PodUnavailable, ValueError) as exc:
            if isinstance(exc, PodUnavailable):
                self.pool.mark_down(pod, str(exc))
            logger.warning("pre-draft on %s failed: %s", pod.address, exc)
            for seq, *_ in entries:
                seq.draft, seq.draft_synced_len = None, 0
            return
        for (seq, committed_len, path, item), proposal in zip(entries, proposals):
            if proposal.status == STATUS_STALE:
                seq.draft_synced_len = 0
                continue
            seq.draft_synced_len = committed_len  # the real committed prefix; the guessed tail is speculative
            if proposal.status == STATUS_OK and proposal.guessed_token_ids and (
                    proposal.base_committed_len == item.committed_len + len(proposal.guessed_token_ids)):
                seq.predraft = Predraft(pod, proposal.base_committed_len, [*path, *proposal.guessed_token_ids],
                                        proposal.tree)


def _sampled(seq: Sequence):
    """The request's sampling for the draft, sampled requests only (a rejection-sampling draft samples from it)."""
    sampling = seq.params.sampling
    return sampling if sampling.temperature > 0 else None


def _first_child_path(tree: DraftTree) -> list[int]:
    """The draft's own best guess of the accepted path: from the root, the first child in node order at every level
    (drafts list a parent's children best first; a chain is its whole self)."""
    path, node = [], ROOT
    while True:
        child = next((i for i, p in enumerate(tree.parents) if p == node), None)
        if child is None:
            return path
        path.append(tree.token_ids[child])
        node = child
