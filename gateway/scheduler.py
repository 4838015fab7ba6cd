"""The speculative loop: continuous batching of every running sequence over pools of draft and target pods.

Each loop iteration: release finished/aborted sequences on their pods, admit waiting requests (one batched target
Prefill per pod), then one step for all running sequences — one batched Propose per draft pod, one batched Verify
per target pod, the pods of a kind called concurrently — and commit what the targets accepted. A sequence's target
pod is chosen cache-aware (gateway/routing.py: the pod already holding its prompt prefix, load permitting), its draft
pod by rendezvous hashing over the live pods. The gateway's committed token list is the source
of truth: a pod that answers STALE, or a target pod that is lost, is re-synced from it (re-prefill on another pod);
a sequence without a reachable draft pod decodes target-only.

The draft side of a step (Propose batching, re-sync, feature rows, overlapped pre-drafts) is gateway/drafting.py;
adaptive draft lengths per batch size are gateway/adaptive.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from core import algorithms
from core.steps import PrefillInput, SpecShape, VerifyInput
from core.types import DraftTree, StopRule
from gateway.adaptive import AdaptiveSpec
from gateway.drafting import Drafting, SpecConfig
from gateway.clients import STATUS_OK, STATUS_OOM, STATUS_STALE, DraftClient, PodUnavailable, TargetClient
from gateway.metrics import GatewayMetrics
from gateway.overlap import PINGPONG, OverlapSchedule
from gateway.pods import PodPool
from gateway.profiling import ClusterProfiler
from gateway.routing import PrefixRouter, RoutingConfig
from gateway.sequence import Sequence
from protos.profiler import ProcessProfiler, ProfileOptions
from gateway.types import (DeadlineExceeded, FinishReason, GatewayError, GenerateChunk, GenerateParams,
                           InvalidRequest, Overloaded, Unavailable, check_params)

logger = logging.getLogger(__name__)

# Prefill calls one loop iteration may make before the running batch steps (the first admits what waits; each
# further one what arrived during the previous Prefill).
ADMISSION_ROUNDS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_queued_requests: int = 256
    request_timeout_s: float = 600.0
    pod_retry_s: float = 5.0  # how long a failed pod is left alone before it is tried again
    max_pod_failures: int = 3  # pod failures one request survives (each moves it to another pod)
    max_prompt_tokens: int | None = None  # longer prompts are refused (400); None = only the context bounds them
    enable_overlap_drafting: bool = False  # pre-draft step i+1 during Verify(step i) (token-only drafts)
    # Two micro-batches that ping-pong between the draft and target pods (gateway/overlap.py): "auto" measures and
    # picks per batch size, "on" always splits batches of >= 2, "off" (--disable-overlap-schedule) never does.
    overlap_schedule: str = "auto"
    # A Verify's tokens are detokenized, stop-matched and streamed while the next call is in flight (#14 item 1);
    # False (--disable-overlap-schedule: the sequential loop) streams them before the next call goes out.
    defer_delivery: bool = True
    # Plain decode steps (no draft tree) run back to back inside one Verify call (SGLang's
    # --num-continuous-decode-steps): fewer round trips per token, chunks of up to this many tokens.
    num_continuous_decode_steps: int = 1
    # With the draft in the target's process (drafts_on_target): speculative steps (verify, draft, verify, ...) per
    # Verify call. `tandem serve`: --num-continuous-decode-steps when given, else 4
    # (tandem.services.AUTO_SPECULATIVE_STEPS_PER_CALL, measured on the H200).
    speculative_steps_per_call: int = 1
    # The target pods draft in their own process (`--colocate-draft`; UNO by its registry entry): Propose goes to the
    # pod holding the sequence and every Verify drafts the next tree in the same call (one round trip per step).
    drafts_on_target: bool = False
    routing: RoutingConfig = RoutingConfig()  # how new sequences pick a target pod
    # Seconds between active health probes (grpc.health.v1) of every pod; 0 = none (pods are then only marked down
    # by failed calls). /health and gRPC health follow: unhealthy while no target pod is up.
    pod_probe_interval_s: float = 1.0
    # How long a sequence waits for a target pod while none is up (all restarting) before it fails with 503.
    no_target_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.max_queued_requests < 0 or self.request_timeout_s <= 0:
            raise ValueError("max_running_requests >= 1, max_queued_requests >= 0, request_timeout_s > 0")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, got {self.overlap_schedule!r}")
        for name in ("num_continuous_decode_steps", "speculative_steps_per_call"):
            if not 1 <= getattr(self, name) <= 256:
                raise ValueError(f"{name} must be in 1..256, got {getattr(self, name)}")


class Scheduler:
    """Implements gateway.types.GenerationBackend over pools of target and draft pods."""

    def __init__(self, *, targets: list[TargetClient], drafts: list[DraftClient], tokenizer, model_name: str,
                 max_context_len: int, vocab_size: int, eos_token_ids: list[int], spec: SpecConfig,
                 config: SchedulerConfig = SchedulerConfig(), metrics: GatewayMetrics | None = None,
                 adaptive: AdaptiveSpec | None = None, profiler: ProcessProfiler | None = None):
        """adaptive: per-batch-size choice of the draft steps (gateway/adaptive.py); chain drafts only.
        profiler: this process's (--profile-dir; None = profiling off): /start_profile profiles it and every pod."""
        if not targets:
            raise ValueError("at least one target pod is needed")
        if adaptive is not None and (spec.topk != 1 or not spec.entry.supports_adaptive
                                     or config.enable_overlap_drafting):
            chains = ", ".join(algorithms.names(lambda a: a.supports_adaptive))
            raise ValueError(f"adaptive speculation needs a chain draft (topk 1; {chains}) and no overlapped drafting")
        self.adaptive = adaptive
        self.targets = PodPool(targets, config.pod_retry_s)
        self.router = PrefixRouter(config.routing)
        self.drafts = PodPool(drafts, config.pod_retry_s)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.spec = spec
        self.config = config
        self._gateway_id = uuid.uuid4().hex[:8]
        for client in [*targets, *drafts]:  # the pods refuse another gateway's Release of our sequences
            if hasattr(client, "owner") and not client.owner:
                client.owner = self._gateway_id
        self._counter = itertools.count()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._to_release: list[Sequence] = []
        self._by_request: dict[str, Sequence] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None
        self.num_steps = 0
        self.metrics = metrics or GatewayMetrics()
        self.metrics.bind(num_waiting=lambda: len(self._waiting), num_running=lambda: len(self._running),
                          pools={"target": self.targets, "draft": self.drafts})
        self.drafting = Drafting(self.drafts, spec, self.metrics, config.enable_overlap_drafting,
                                 config.drafts_on_target)
        # Ping-pong halves (gateway/overlap.py): not with adaptive draft lengths (one shape per batch size) or the
        # pre-drafts of --enable-overlap-drafting (their own overlap), and only when something drafts.
        self.overlap: OverlapSchedule | None = None
        if (config.overlap_schedule != "off" and adaptive is None and not config.enable_overlap_drafting
                and spec.entry.drafts and drafts and not self.drafting.on_target):
            self.overlap = OverlapSchedule(force=PINGPONG if config.overlap_schedule == "on" else None)
        self._pending: dict[str, DraftTree] = {}  # ping-pong: trees drafted, not yet verified
        self._last_step_end: tuple[int, float] = (-1, 0.0)  # (num_steps after it, perf_counter) of the last step
        # Result processing off the critical path: a Verify's tokens are committed at once (the next step needs
        # them) but detokenized, stop-matched and streamed while the next call is in flight (Sequence.deliver): the
        # next Propose, or on a step that drafts nothing (plain decoding, an adaptive tier of 0 steps) the next
        # Verify. 8B plain decoding through the services lost 20-28 ms per 4-step call at batch 32-64 streaming
        # its tokens between calls (bench/results/speculative_h200/adaptive/NOTES.md, seventh session).
        self._drafts_nothing = not (spec.entry.drafts and drafts)
        self.profiling = ClusterProfiler(profiler or ProcessProfiler("gateway", None),
                                         lambda: [*self.targets.clients, *self.drafts.clients])

    # ---------------------------------------------------------------- GenerationBackend
    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tandem-scheduler")
        if self.config.pod_probe_interval_s > 0:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="tandem-pod-probes")

    async def close(self) -> None:
        for task in (self._task, self._probe_task):
            if task:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for seq in [*self._running, *self._waiting]:
            seq.fail(Unavailable("server shutting down"))

    @property
    def gateway_id(self) -> str:
        """This gateway's id: the prefix of its sequence ids and the owner of its sequences on the pods."""
        return self._gateway_id

    async def start_profile(self, options: ProfileOptions) -> dict:
        """/start_profile: this process and every pod (gateway/profiling.py)."""
        return await self.profiling.start(options)

    async def stop_profile(self) -> dict:
        return await self.profiling.stop()

    # ------------------------------------------------------------- NGRAM's external corpora (SGLang's endpoints)
    def _corpus_pods(self) -> list[DraftClient]:
        if self.spec.entry.name != "NGRAM" or not self.drafts.clients:
            raise InvalidRequest("external corpora are NGRAM's: this server "
                                 + (f"drafts with {self.spec.entry.name}" if self.spec.entry.drafts else "does not draft"))
        return list({c.address: c for c in self.drafts.clients}.values())

    async def _on_corpus_pods(self, call) -> list[tuple[DraftClient, object]]:
        """call(pod) on every NGRAM pod at once: (pod, result or the exception); a pod's refusal is the request's
        InvalidRequest."""
        pods = self._corpus_pods()
        results = await asyncio.gather(*(call(pod) for pod in pods), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise InvalidRequest(str(result))
        return list(zip(pods, results))

    @staticmethod
    def _corpus_answer(results, **extra) -> dict:
        down = [f"{pod.address}: {r}" for pod, r in results if isinstance(r, Exception)]
        answer = {"success": not down, "message": "; ".join(down), **extra}
        counts = next((r[1] if isinstance(r, tuple) else r for _, r in results if not isinstance(r, Exception)), {})
        return {**answer, "corpus_token_counts": counts}

    async def add_external_corpus(self, corpus_id: str, documents: list[list[int]]) -> dict:
        """POST /add_external_corpus: every NGRAM pod indexes the documents (token ids) as `corpus_id`. A pod that
        is down misses it (success false, the pod named); one that restarts later keeps only its start-up corpus."""
        if self.vocab_size and any(t >= self.vocab_size for doc in documents for t in doc):
            raise InvalidRequest(f"corpus token ids must be below the vocabulary size {self.vocab_size}",
                                 "token_chunks")
        results = await self._on_corpus_pods(lambda pod: pod.add_external_corpus(corpus_id, documents))
        loaded = next((r[0] for _, r in results if isinstance(r, tuple)), 0)
        return self._corpus_answer(results, corpus_id=corpus_id, loaded_token_count=loaded)

    async def remove_external_corpus(self, corpus_id: str) -> dict:
        return self._corpus_answer(await self._on_corpus_pods(lambda pod: pod.remove_external_corpus(corpus_id)))

    async def list_external_corpora(self) -> dict:
        return self._corpus_answer(await self._on_corpus_pods(lambda pod: pod.list_external_corpora()))

    def health(self) -> bool:
        """Serving: the loop runs and at least one target pod is up (probed, or not failing calls)."""
        return self._task is not None and not self._task.done() and bool(self.targets.live())

    async def _probe_loop(self) -> None:
        interval = self.config.pod_probe_interval_s
        while True:
            clients = [(pool, c) for pool in (self.targets, self.drafts) for c in pool.clients
                       if hasattr(c, "health_check")]
            try:
                results = await asyncio.gather(*(c.health_check(timeout_s=max(interval, 2.0)) for _, c in clients),
                                               return_exceptions=True)
                for (pool, client), ok in zip(clients, results):
                    pool.set_probe_result(client, ok is True)
            except Exception:  # never let one bad round end the probing
                logger.exception("pod health probes failed")
            await asyncio.sleep(interval)

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateChunk]:
        try:
            seq = self._admit(params)
        except GatewayError as exc:
            self.metrics.on_rejected(params.request_id, exc)
            raise
        self.metrics.on_admitted(seq)
        try:
            while True:
                remaining = seq.deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(remaining, 0.0) + 5.0):
                        item = await seq.queue.get()
                except TimeoutError:
                    raise DeadlineExceeded("request deadline exceeded") from None
                self.metrics.on_item(seq, item)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.finished:  # client went away or the iterator was closed early: free KV on both pods
                seq.finished = True
                seq.aborted = True
                self._wakeup.set()
            self._by_request.pop(seq.request_id, None)
            self.metrics.on_closed(seq)

    async def abort(self, request_id: str) -> bool:
        seq = self._by_request.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.finish(FinishReason.ABORT)
        self._wakeup.set()
        return True

    # ---------------------------------------------------------------- admission
    def _admit(self, params: GenerateParams) -> Sequence:
        prompt_len = len(params.prompt_token_ids)
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if self.config.max_prompt_tokens and prompt_len > self.config.max_prompt_tokens:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; this server accepts at most "
                                 f"{self.config.max_prompt_tokens} (--max-prompt-tokens)", "prompt")
        check_params(params, self.vocab_size)
        if prompt_len + params.max_new_tokens > self.max_context_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_context_len} tokens. However, you requested "
                f"{prompt_len + params.max_new_tokens} tokens ({prompt_len} in the messages, "
                f"{params.max_new_tokens} in the completion).", "max_tokens")
        if params.request_id in self._by_request:
            raise InvalidRequest(f"request id {params.request_id!r} is already running", "request_id")
        if len(self._waiting) >= self.config.max_queued_requests + max(
                0, self.config.max_running_requests - len(self._running)):
            raise Overloaded("too many requests queued; retry later")
        deadline = params.deadline_s or time.monotonic() + self.config.request_timeout_s
        seq_id = f"{self._gateway_id}-{next(self._counter)}"
        stop_ids = [] if params.ignore_eos else sorted({*self.eos_token_ids, *params.stop_token_ids})
        seq = Sequence(seq_id, params, self.tokenizer, deadline,
                       StopRule(params.max_new_tokens, frozenset(stop_ids), params.ignore_eos, prompt_len))
        self._by_request[params.request_id] = seq
        self._waiting.append(seq)
        self._wakeup.set()
        return seq

    # ---------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            if not (self._waiting or self._running or self._to_release):
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step kill the loop; fail what was in flight
                logger.exception("scheduler step failed")
                for seq in self._running:
                    seq.fail(Unavailable("internal error in the speculative loop"))
                await asyncio.sleep(0.1)

    async def _iteration(self) -> None:
        now = time.monotonic()
        for seq in self._running:
            if not seq.finished and now > seq.deadline:
                seq.fail(DeadlineExceeded("request deadline exceeded"))
        self._reap()
        await self._release()
        # Prefill first (SGLang's scheduler runs a prefill batch before the next decode batch): requests that arrive
        # while a Prefill is in flight join the batch before it steps, not a whole (multi-step) Verify call later.
        # A burst of requests otherwise splits into admission waves, the later ones a call behind (session 25's
        # batch-64 profile: 40 steps where in-process ran 32). Bounded, so a steady trickle cannot starve decoding.
        for _ in range(ADMISSION_ROUNDS):
            await self._admit_waiting()
            if not (self._waiting and len(self._running) < self.config.max_running_requests):
                break
        active = [s for s in self._running if not s.finished and not s.needs_target_prefill]
        if len(active) < len(self._running):  # sequences that step no more (or not now): stream what they hold
            self._deliver([s for s in self._running if s.needs_target_prefill])
        if active:
            await self._step(active)
            self.num_steps += 1
            self.profiling.step()
        else:
            self._last_step_end = (-1, 0.0)  # the next step's iteration time starts afresh
            if any(s.no_target_since is not None for s in self._running):
                await asyncio.sleep(0.05)  # sequences wait for a target pod: poll the pools, do not spin
        self._reap()

    def _reap(self) -> None:
        keep = []
        for seq in self._running:
            if seq.finished:
                self._to_release.append(seq)
                self._pending.pop(seq.seq_id, None)
            else:
                keep.append(seq)
        self._running = keep
        while self._waiting and self._waiting[0].finished:  # aborted before admission: nothing to release
            self._waiting.popleft()

    async def _release(self) -> None:
        """Release finished sequences on the pods that hold them (one batched call per pod)."""
        if not self._to_release:
            return
        seqs, self._to_release = self._to_release, []
        by_pod: dict[object, list[str]] = defaultdict(list)
        for seq in seqs:
            for pod in (seq.target, seq.draft):
                if pod is not None:
                    by_pod[pod].append(seq.seq_id)
        pods = list(by_pod)
        results = await asyncio.gather(*(pod.release(by_pod[pod]) for pod in pods), return_exceptions=True)
        for pod, result in zip(pods, results):
            if isinstance(result, Exception):  # the target frees finished sequences itself; log and move on
                logger.warning("release on %s failed: %s", pod.address, result)

    def _route_target(self, seq: Sequence) -> bool:
        """Keep a sequence on its target pod while that pod is up; otherwise move it (its KV is gone)."""
        if seq.target is not None and not self.targets.is_down(seq.target):
            return True
        if seq.target is not None:  # the pod it lived on failed: rebuild its KV elsewhere from the committed list
            seq.needs_target_prefill = seq.num_output > 0
            seq.features.reset(None)
        load: dict[str, int] = defaultdict(int)
        for other in self._running:
            if other.target is not None and not other.finished:
                load[other.target.address] += 1
        seq.target = self.router.choose(seq.seq_id, seq.committed, self.targets.live(), load)
        return seq.target is not None

    async def _admit_waiting(self) -> None:
        new: list[Sequence] = []
        while self._waiting and len(self._running) + len(new) < self.config.max_running_requests:
            seq = self._waiting.popleft()
            if not seq.finished:
                new.append(seq)
        resync = [s for s in self._running if s.needs_target_prefill and not s.finished]
        if not (new or resync):
            return
        self._running.extend(new)
        groups: dict[object, list[Sequence]] = defaultdict(list)
        for seq in [*new, *resync]:
            if self._route_target(seq):
                seq.no_target_since = None
                groups[seq.target].append(seq)
            else:
                self._wait_for_target(seq)
        await asyncio.gather(*(self._prefill_on(pod, group) for pod, group in groups.items()))

    def _wait_for_target(self, seq: Sequence) -> None:
        """No target pod is up (all restarting or lost): the sequence waits, its committed tokens safe here, and is
        prefilled on the first pod that comes back — or fails after `no_target_wait_s`."""
        now = time.monotonic()
        if seq.no_target_since is None:
            seq.no_target_since = now
        if now - seq.no_target_since > self.config.no_target_wait_s:
            seq.fail(Unavailable("no target pod is reachable"))
        else:
            seq.needs_target_prefill = True

    async def _prefill_on(self, pod: TargetClient, seqs: list[Sequence]) -> None:
        # New sequences sample their first token; re-synced ones only rebuild KV (their last token stays pending).
        feats = self.spec.needs_features
        # a draft in the target's process is prefilled there (a feature draft's features handed over on the pod) and
        # drafts the first tree in the same call: the first step needs no Propose
        shape = self._shape_for(len(self._running))
        on_pod = self.drafting.on_target and (feats or shape is not None)
        items = [PrefillInput(s.seq_id, s.committed[:], s.num_output == 0, s.params.sampling, s.stop, feats,
                              _logprobs(s), prefill_draft=on_pod, propose_next=shape if on_pod else None)
                 for s in seqs]
        try:
            results = await self.metrics.timed("prefill", pod.prefill(items))
        except ValueError as exc:  # INVALID_ARGUMENT for the call: find the sequence(s) it is about, fail only those
            if len(seqs) > 1:
                await asyncio.gather(*(self._prefill_on(pod, [seq]) for seq in seqs))
            else:
                seqs[0].fail(InvalidRequest(f"target rejected the prompt: {exc}"))
            return
        except PodUnavailable as exc:
            self.targets.mark_down(pod, str(exc))
            for seq in seqs:  # retried on another pod next iteration, a bounded number of times
                seq.target_failures += 1
                seq.needs_target_prefill = True
                if seq.target_failures > self.config.max_pod_failures:
                    seq.fail(Unavailable(f"target unavailable: {exc}"))
            return
        for seq, result in zip(seqs, results):
            seq.needs_target_prefill = False
            if seq.num_output == 0:  # the first prefill: what the prompt got from the target's prefix cache
                seq.cached_prompt_tokens = result.num_cached_tokens
            if feats:
                seq.features.reset(result.features)
            if result.status == STATUS_OOM:
                seq.fail(Overloaded(f"not enough KV cache: {result.error}"))
            elif result.status != STATUS_OK:
                seq.fail(InvalidRequest(result.error or "target rejected the prompt"))
            elif result.token_ids:
                seq.commit(result.token_ids, result.finish_reason, result.logprobs)
            # the pod's draft took the sequence: a feature draft's features stayed there, a token draft drafted
            if (on_pod and result.status == STATUS_OK and not seq.finished
                    and (result.features is None if feats else result.proposal is not None)):
                self.drafting.prefilled_on_pod(seq)
                if result.proposal is not None:
                    self.drafting.keep_proposal(seq, result.proposal, shape)

    async def _step(self, seqs: list[Sequence]) -> None:
        """One step of the running batch (step_time), or one ping-pong phase: half of it verifies, half drafts
        (a phase that only drafts, filling the pipeline, is not a step)."""
        start = time.perf_counter()
        if self.overlap is None:
            await self._sequential_step(seqs)
            self.metrics.step_time.observe(time.perf_counter() - start)
            return
        mode = self.overlap.mode_for(len(seqs))
        self.metrics.overlap_iterations.labels(mode).inc()
        # Steady iterations only: a sequence's first steps include the draft's catch-up over its prompt.
        steady = all(s.verify_steps >= 2 for s in seqs)
        before = sum(s.num_output for s in seqs)
        # The choice weighs whole loop iterations (release, admission and the loop's own work included, since the
        # end of the previous step when that was the last iteration): ping-pong runs twice the iterations per token.
        since = self._last_step_end if self._last_step_end[0] == self.num_steps else (self.num_steps, start)
        verified = await self._pingpong_step(seqs) if mode == PINGPONG else await self._sequential_step(seqs)
        end = time.perf_counter()
        self._last_step_end = (self.num_steps + 1, end)  # the loop counts this step next
        if verified is not False:
            self.metrics.step_time.observe(end - start)
        if steady:
            self.overlap.observe(len(seqs), mode, sum(s.num_output for s in seqs) - before, end - since[1])

    async def _pingpong_step(self, seqs: list[Sequence]) -> bool:
        """One phase of the two ping-ponging halves (gateway/overlap.py): the half drafted last phase verifies on
        the target pods while the other half drafts on the draft pods. Starting from nothing pending, half the batch
        drafts alone (filling the pipeline)."""
        pending = self._take_pending(seqs)
        verifying = [s for s in seqs if s.seq_id in pending]
        drafting = drafting_all = [s for s in seqs if s.seq_id not in pending]
        if not verifying:
            drafting = drafting[: (len(seqs) + 1) // 2]

        async def draft_half() -> None:
            trees = await self.drafting.propose(drafting) if drafting else {}
            for seq in drafting:  # no tree (no draft pod, STALE): the next phase verifies it as a plain decode step
                if not seq.finished:
                    self._pending[seq.seq_id] = trees.get(seq.seq_id, DraftTree([], []))

        verify = asyncio.gather(*self._verifies(verifying, pending))
        both = asyncio.ensure_future(asyncio.gather(_span(verify), _span(draft_half())))
        await asyncio.sleep(0)  # the calls go out; then the drafting half's outputs are delivered meanwhile
        self._deliver(drafting_all)
        spans = await both
        if verifying and drafting:  # both pods in flight at once: the time the split bought
            self.metrics.overlap_busy.inc(_overlap(*spans))
        return bool(verifying)

    async def _propose_delivering(self, seqs: list[Sequence], to_propose: list[Sequence],
                                  shape: SpecShape | None = None) -> dict[str, DraftTree]:
        """Propose for `to_propose` and, while that call is in flight, deliver the held outputs of `seqs`."""
        if not to_propose:
            self._deliver(seqs)
            return {}
        task = asyncio.ensure_future(self.drafting.propose(to_propose, *([shape] if shape else [])))
        await asyncio.sleep(0)  # the task's first step sends the call (several draft pods: their tasks', next)
        await asyncio.sleep(0)  # before the host work below
        self._deliver(seqs)
        return await task

    async def _verify_delivering(self, seqs: list[Sequence], trees=None, next_shape: SpecShape | None = None) -> None:
        """Verify `seqs` (plain decode steps without trees) and, while those calls are in flight, deliver their held
        outputs. A sequence a stop string ends meanwhile ignores its step's result (Sequence.commit) and is released."""
        task = asyncio.ensure_future(asyncio.gather(*self._verifies(seqs, trees or {}, next_shape)))
        await asyncio.sleep(0)  # let the calls go out before the host work below
        self._deliver(seqs)
        await task

    @staticmethod
    def _deliver(seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.deliver()

    def _take_pending(self, seqs: list[Sequence]) -> dict[str, DraftTree]:
        """Trees drafted in an earlier ping-pong phase for these sequences (drafted from their committed tokens as
        they still are: nothing verifies a sequence while its tree is pending)."""
        if not self._pending:
            return {}
        return {s.seq_id: self._pending.pop(s.seq_id) for s in seqs if s.seq_id in self._pending}

    async def _sequential_step(self, seqs: list[Sequence]) -> None:
        overlap = self.drafting.overlap_enabled
        adaptive_steps = self.adaptive.steps_for(len(seqs)) if self.adaptive is not None else None
        accepted_before = ({s.seq_id: (s.accepted_draft_tokens, s.verify_steps) for s in seqs}
                           if adaptive_steps is not None else None)
        if overlap:
            trees = self.drafting.take_predrafts(seqs)
            trees.update(await self._propose_delivering(seqs, [s for s in seqs if s.seq_id not in trees]))
        elif adaptive_steps == 0 or self._drafts_nothing:
            # plain decode steps through Verify (no draft, or this batch size's tier does not speculate): the held
            # outputs are delivered while the Verify is in flight
            await self._verify_delivering(seqs)
            if adaptive_steps is not None:
                self.adaptive.observe(len(seqs), adaptive_steps, None)
            return
        else:
            # this step's shape: the adaptive tier's chain, else the configured one; a draft in the target's process
            # drafts the next tree with it in this step's Verify (one call per step; a tier that moves drafts afresh)
            shape = self._shape_for(len(seqs))
            trees = self._take_pending(seqs)  # left by ping-pong phases before the switch to sequential steps
            trees.update(self.drafting.take_proposals(seqs, shape))  # drafted by the last Verify (drafts on target)
            to_propose = [s for s in seqs if s.seq_id not in trees]
            if not to_propose:  # every tree came with the last Verify: deliver while this one is in flight
                await self._verify_delivering(seqs, trees, next_shape=shape)
                self._observe_adaptive(seqs, adaptive_steps, trees, accepted_before)
                return
            trees.update(await self._propose_delivering(seqs, to_propose, shape))
        seqs = [s for s in seqs if not s.finished]  # a stop string found while delivering ends a sequence here
        verifies = self._verifies(seqs, trees, None if overlap else shape)
        if overlap:  # built before any await: the guesses extend the committed tokens as they are now
            predraft = self.drafting.predraft(self.drafting.predraft_items(seqs, trees))
            self.metrics.overlap_busy.inc(_overlap(*await asyncio.gather(_span(asyncio.gather(*verifies)),
                                                                         _span(predraft))))
        else:
            await asyncio.gather(*verifies)
        self._observe_adaptive(seqs, adaptive_steps, trees, accepted_before)

    def _shape_for(self, batch_size: int) -> SpecShape | None:
        """The draft shape of a step over batch_size sequences: the configured one, or the adaptive tier's chain
        (None: the tier does not draft)."""
        if self.adaptive is None:
            return self.spec.shape
        steps = self.adaptive.steps_for(batch_size)
        return SpecShape(steps, 1, steps + 1) if steps else None

    def _observe_adaptive(self, seqs: list[Sequence], steps: int | None, trees, accepted_before) -> None:
        """--speculative-adaptive: the drafts the target accepted per speculative step this call (a co-located draft
        may run several per call: --num-continuous-decode-steps), for the batch size's tier."""
        if steps is None:
            return
        drafted = [s for s in seqs if s.seq_id in trees]
        accepted = sum(s.accepted_draft_tokens - accepted_before[s.seq_id][0] for s in drafted)
        run = sum(s.verify_steps - accepted_before[s.seq_id][1] for s in drafted)
        self.adaptive.observe(len(seqs), steps, accepted / run if run else None)

    def _verifies(self, seqs: list[Sequence], trees, next_shape: SpecShape | None = None) -> list:
        """One Verify call per target pod for these sequences (coroutines to await together); sequences without a
        reachable target pod wait for one. next_shape: a pod that drafts in its own process drafts the next tree of
        this shape in the same call (the sequential loop; not for pre-drafts)."""
        groups: dict[object, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            if self._route_target(seq) and not seq.needs_target_prefill:
                groups[seq.target].append(seq)
            elif seq.target is None:
                self._wait_for_target(seq)
        return [self._verify_on(pod, group, trees, next_shape) for pod, group in groups.items()]

    async def _verify_on(self, pod: TargetClient, seqs: list[Sequence], trees,
                         next_shape: SpecShape | None = None) -> None:
        items = []
        for seq in seqs:
            tree = trees.get(seq.seq_id, DraftTree([], []))  # an empty tree is a plain decode step
            propose_next = self.drafting.fused(seq, next_shape) if next_shape is not None else None
            # speculative steps with a draft in the pod's process, one verify of a tree, or plain decode steps
            steps = (self.config.speculative_steps_per_call if propose_next is not None
                     else 1 if tree.token_ids else self.config.num_continuous_decode_steps)
            # a draft in the verifying pod's process takes this step's features there: they stay off the wire
            items.append(VerifyInput(seq.seq_id, len(seq.committed), seq.committed[-1], tree, seq.params.sampling,
                                     seq.stop, self.spec.needs_features and propose_next is None, steps,
                                     _logprobs(seq), propose_next))
        try:
            results = await self.metrics.timed("verify", pod.verify(items, batch_may_grow=bool(self._waiting)))
        except ValueError as exc:  # INVALID_ARGUMENT for the call: find the sequence(s) it is about, fail only those
            if len(seqs) > 1:
                await asyncio.gather(*(self._verify_on(pod, [seq], trees, next_shape) for seq in seqs))
            else:
                seqs[0].fail(GatewayError(f"target rejected the step: {exc}"))
            return
        except PodUnavailable as exc:
            self.targets.mark_down(pod, str(exc))
            for seq in seqs:  # next iteration re-prefills them on another pod from the committed tokens
                seq.target_failures += 1
                if seq.target_failures > self.config.max_pod_failures:
                    seq.fail(Unavailable(f"target unavailable: {exc}"))
            return
        for seq, item, result in zip(seqs, items, results):
            if seq.finished:  # aborted while the step was in flight
                continue
            if result.status == STATUS_STALE:
                seq.needs_target_prefill = True
            elif result.status == STATUS_OOM:
                seq.fail(Overloaded(f"KV cache exhausted: {result.error}"))
            elif result.status != STATUS_OK:
                seq.fail(GatewayError(f"target rejected the step: {result.error}"))
            else:
                seq.record_step(result.num_accepted_drafts, result.num_draft_tokens, result.num_steps)
                self.metrics.on_verify(result.num_accepted_drafts, result.num_draft_tokens, result.num_steps)
                if result.features is not None and seq.features.end == len(seq.committed) - 1:  # (else a gap: the
                    seq.features.append(result.features)  # rows would land at the wrong positions)
                seq.commit(result.token_ids, result.finish_reason, result.logprobs, defer=self.config.defer_delivery)
                if item.propose_next is not None and self.spec.needs_features and result.features is None:
                    # the draft took them on the pod: the gateway's log holds the rows of later steps only
                    seq.features.reset(None, start=len(seq.committed) - 1)
                if result.proposal is not None and not seq.finished:
                    self.drafting.keep_proposal(seq, result.proposal, item.propose_next)


async def _span(work) -> tuple[float, float]:
    """(start, end) perf_counter of awaiting `work`."""
    start = time.perf_counter()
    await work
    return start, time.perf_counter()


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two (start, end) spans were both in flight."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _logprobs(seq: Sequence) -> int:
    """The target-side logprobs request of a sequence: -1 none, else the number of alternatives."""
    return -1 if seq.params.logprobs is None else seq.params.logprobs
