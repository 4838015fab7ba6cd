"""Gateway metrics and request logs: Prometheus series in the vLLM/SGLang vocabulary (prefix `tandem:`), filled by
hooks the scheduler calls (admission, every chunk a client receives, stream end, each verify result, step RPC times),
plus one structured log line when a request starts and one when it ends.

Speculative counters follow vLLM's `SpecDecodingProm`: mean accept length = 1 + rate(accepted) / rate(drafts);
per-position acceptance = per_pos{position} / drafts. For trees `num_draft_tokens` counts every verified tree node,
so accepted / draft_tokens is the fraction of verified nodes accepted. Scrape-time gauges read the scheduler's queues
and pod pools through callables, so this module knows nothing of the loop itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gateway.types import GatewayError, GenerateChunk

P = "tandem:"
request_log = logging.getLogger("gateway.requests")
T = TypeVar("T")

# vLLM's buckets, with finer low ends for small models on CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class _Live:
    """Timing of one admitted request."""

    start: float
    first_token: float | None = None
    last_token: float | None = None
    reported: bool = False  # the finish or the error has been counted


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason (stop, length, "
                                       "abort; abort includes clients that went away)", ["finished_reason"],
                                       registry=r)
        self.request_failure = Counter(P + "request_failure", "Admitted requests that ended with an error",
                                       ["error_type"], registry=r)
        self.request_rejected = Counter(P + "request_rejected", "Requests refused at admission (queue full, limits)",
                                        ["error_type"], registry=r)
        self.http_requests = Counter(P + "http_requests", "REST responses by route and HTTP status",
                                     ["path", "status"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens streamed to clients", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Admission to first output token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between consecutive output chunks of a request "
                             "(one per step; a step may carry several accepted tokens)", registry=r,
                             buckets=ITL_BUCKETS)
        self.tpot = Histogram(P + "request_time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1)",
                              registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Admission to the last chunk", registry=r,
                             buckets=E2E_BUCKETS)
        self.request_prompt_tokens = Histogram(P + "request_prompt_tokens", "Prompt length per request", registry=r,
                                               buckets=TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = Histogram(P + "request_generation_tokens", "Output length per request",
                                                   registry=r, buckets=TOKEN_COUNT_BUCKETS)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Verified drafts (one per sequence per step with a "
                                  "non-empty tree)", registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified",
                                        registry=r)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus "
                                           "excluded)", registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Drafts whose accepted path "
                                        "reaches depth position+1", ["position"], registry=r)
        self._per_pos: list = []  # accepted_per_pos children by position
        self.accept_length = Histogram(P + "spec_decode_accept_length", "Tokens committed per verify step, bonus "
                                       "included", registry=r, buckets=ACCEPT_LENGTH_BUCKETS)
        self.num_target_only_steps = Counter(P + "spec_decode_num_target_only_steps", "Sequence steps verified "
                                             "without a draft (no draft pod, stale draft, plain decoding)",
                                             registry=r)
        self.draft_time = Histogram(P + "draft_time_seconds", "One batched Propose RPC (draft pod), as the gateway "
                                    "sees it", registry=r, buckets=RPC_BUCKETS)
        self.verify_time = Histogram(P + "verify_time_seconds", "One batched Verify RPC (target pod), as the "
                                     "gateway sees it", registry=r, buckets=RPC_BUCKETS)
        self.prefill_time = Histogram(P + "prefill_time_seconds", "One batched target Prefill RPC", registry=r,
                                      buckets=RPC_BUCKETS)
        self.step_time = Histogram(P + "step_time_seconds", "One speculative step of the whole running batch (or "
                                   "one ping-pong phase: half the batch verifies while the other half drafts)",
                                   registry=r, buckets=RPC_BUCKETS)
        self.overlap_iterations = Counter(P + "overlap_iterations", "Loop iterations by overlap mode (gateway/"
                                          "overlap.py): sequential steps, or ping-pong phases of two half batches",
                                          ["mode"], registry=r)
        self.overlap_busy = Counter(P + "overlap_both_busy_seconds", "Time a draft Propose and a target Verify were "
                                    "in flight at once (ping-pong phases, pre-drafts)", registry=r)
        self.predrafts = Counter(P + "predrafts", "Pre-drafted trees (--enable-overlap-drafting) by outcome: used "
                                 "(hit: the guess came true) or dropped (miss)", ["outcome"], registry=r)
        self._live: dict[str, _Live] = {}
        self._histograms = {"draft": self.draft_time, "verify": self.verify_time, "prefill": self.prefill_time,
                            "step": self.step_time}

    # ------------------------------------------------------------------ scrape-time state
    def bind(self, *, num_waiting: Callable[[], int], num_running: Callable[[], int], pools: dict) -> None:
        """Gauges read at scrape time: queue depth, running sequences, and pod up/down per pool (kind -> PodPool)."""
        Gauge(P + "num_requests_waiting", "Requests waiting for admission", registry=self.registry
              ).set_function(num_waiting)
        Gauge(P + "num_requests_running", "Sequences in the running batch", registry=self.registry
              ).set_function(num_running)
        self.registry.register(_PodCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ request lifecycle
    def on_rejected(self, request_id: str, exc: GatewayError) -> None:
        self.request_rejected.labels(exc.error_type).inc()
        request_log.info("request rejected", extra={"request_id": request_id, "error_type": exc.error_type,
                                                    "error": str(exc)})

    def on_admitted(self, seq) -> None:
        self._live[seq.seq_id] = _Live(time.monotonic())
        self.prompt_tokens.inc(seq.prompt_len)
        self.request_prompt_tokens.observe(seq.prompt_len)
        request_log.info("request started", extra={"request_id": seq.request_id, "seq_id": seq.seq_id,
                                                   "prompt_tokens": seq.prompt_len,
                                                   "max_new_tokens": seq.params.max_new_tokens})

    def on_item(self, seq, item: GenerateChunk | BaseException) -> None:
        """Every item the client is handed: a chunk (maybe the last one) or the error that ends the request."""
        live = self._live.get(seq.seq_id)
        if live is None or live.reported:
            return
        now = time.monotonic()
        if isinstance(item, BaseException):
            live.reported = True
            error_type = getattr(item, "error_type", "internal_error")
            self.request_failure.labels(error_type).inc()
            request_log.warning("request failed", extra={**self._summary(seq, live, now), "error_type": error_type,
                                                         "error": str(item)})
            return
        if item.token_ids:
            self.generation_tokens.inc(len(item.token_ids))
            if live.first_token is None:
                live.first_token = now
                self.ttft.observe(now - live.start)
            else:
                self.itl.observe(now - live.last_token)
            live.last_token = now
        if item.finish_reason is not None:
            live.reported = True
            self._finished(seq, live, now, item.finish_reason.value, item.usage)

    def on_closed(self, seq) -> None:
        """The client's stream is closed; a request that never reported its end was cancelled by the client."""
        live = self._live.pop(seq.seq_id, None)
        if live is not None and not live.reported:
            self._finished(seq, live, time.monotonic(), "abort", None, cancelled=True)

    def _finished(self, seq, live: _Live, now: float, reason: str, usage, cancelled: bool = False) -> None:
        self.request_success.labels(reason).inc()
        self.e2e.observe(now - live.start)
        self.request_generation_tokens.observe(seq.num_output)
        if live.first_token is not None and seq.num_output > 1:
            self.tpot.observe((now - live.first_token) / (seq.num_output - 1))
        extra = {**self._summary(seq, live, now), "finish_reason": reason}
        if usage is not None:
            extra["accept_length"] = round(usage.mean_accept_length, 3)
        if cancelled:
            extra["cancelled_by_client"] = True
        request_log.info("request finished", extra=extra)

    @staticmethod
    def _summary(seq, live: _Live, now: float) -> dict:
        return {"request_id": seq.request_id, "seq_id": seq.seq_id, "prompt_tokens": seq.prompt_len,
                "completion_tokens": seq.num_output, "verify_steps": seq.verify_steps,
                "accepted_draft_tokens": seq.accepted_draft_tokens, "e2e_ms": round((now - live.start) * 1e3, 2),
                "ttft_ms": None if live.first_token is None else round((live.first_token - live.start) * 1e3, 2)}

    # ------------------------------------------------------------------ the loop
    def on_verify(self, num_accepted_drafts: int, num_draft_tokens: int, num_steps: int = 1) -> None:
        """One sequence's verify result, covering num_steps target steps (a Verify call runs several: continuous
        decode steps, or the speculative steps of a draft in the target's process): each step counts as one draft
        (or one target-only step), so 1 + accepted / drafts stays the mean accept length per step. Position i of a
        step's accepted path was accepted iff that step accepted more than i drafts; a result of several steps
        reports only their sum, so its steps count as paths as even as that sum allows (exact for one step, and
        for the totals and the mean always)."""
        num_steps = max(1, num_steps)
        if num_draft_tokens <= 0:
            self.num_target_only_steps.inc(num_steps)
            return
        self.num_drafts.inc(num_steps)
        self.num_draft_tokens.inc(num_draft_tokens)
        self.num_accepted_tokens.inc(num_accepted_drafts)
        depth, longer = divmod(num_accepted_drafts, num_steps)  # `longer` steps accepted depth + 1 drafts
        for position in range(depth):
            self._accepted_at(position).inc(num_steps)
        if longer:
            self._accepted_at(depth).inc(longer)
        for length, steps in ((depth + 1, num_steps - longer), (depth + 2, longer)):
            for _ in range(steps):
                self.accept_length.observe(length)

    def _accepted_at(self, position: int):
        """The per-position counter's child for `position` (labels() looked up once: a batch-64 call counts
        hundreds of positions)."""
        while len(self._per_pos) <= position:
            self._per_pos.append(self.accepted_per_pos.labels(str(len(self._per_pos))))
        return self._per_pos[position]

    async def timed(self, what: str, work: Awaitable[T]) -> T:
        """Await `work` and observe its wall time in the `what` histogram (draft, verify, prefill, step)."""
        start = time.perf_counter()
        try:
            return await work
        finally:
            self._histograms[what].observe(time.perf_counter() - start)


class _PodCollector:
    """tandem:pod_up{kind,address} (1 up, 0 marked down) and tandem:num_pods_{up,down}{kind}, read at scrape."""

    def __init__(self, pools: dict):
        self.pools = pools

    def collect(self):
        pod_up = GaugeMetricFamily(P + "pod_up", "1 when the pod is routable, 0 while it is marked down",
                                   labels=["kind", "address"])
        num_up = GaugeMetricFamily(P + "num_pods_up", "Routable pods per kind", labels=["kind"])
        num_down = GaugeMetricFamily(P + "num_pods_down", "Pods marked down per kind", labels=["kind"])
        for kind, pool in self.pools.items():
            up = 0
            for client in pool.clients:
                is_up = not pool.is_down(client)
                up += is_up
                pod_up.add_metric([kind, client.address], float(is_up))
            num_up.add_metric([kind], up)
            num_down.add_metric([kind], len(pool.clients) - up)
        yield from (pod_up, num_up, num_down)

    def describe(self):
        return []


class HttpMetricsMiddleware:
    """Pure ASGI middleware counting REST responses in tandem:http_requests_total{path,status}; unknown paths are
    folded into path="other" so scanners cannot blow up the label set."""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        label = path if path in self.ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
