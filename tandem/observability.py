"""Operations plumbing shared by every service: JSON/text logging setup, the Prometheus metrics of the model services
(KV usage, running sequences, forward time, RPC counts), the tiny `/metrics` HTTP server they expose on
`--metrics-port`, and a gRPC server interceptor counting RPCs by method and status.

Every metrics object owns its own `CollectorRegistry`, so tests can run several services in one process. Nothing here
knows about models or the speculative loop.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX = "tandem:"
# Forward passes of small models on CPU take ~1 ms, big ones on GPU up to seconds (vLLM-like spread).
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# LogRecord attributes that are not `extra` fields.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, any `extra=` fields (request_id, seq_id, ...), exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: msg key=value ...`: the `extra=` fields (tokens, accept length, TTFT, ...) on the line."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [f"{k}={v}" for k, v in vars(record).items()
                  if k not in _RESERVED and k != "color_message" and not k.startswith("_")]
        return f"{line} {' '.join(fields)}" if fields else line


def setup_logging(level: str = "info", log_format: str = "text") -> None:
    """Configure the root logger once per process (`--log-level`, `--log-format json|text`)."""
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


def start_metrics_server(registry: CollectorRegistry, host: str, port: int):
    """Serve `registry` at http://host:port/metrics from a daemon thread; returns the HTTP server (port 0 = any free
    port: read `server.server_port`)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


class ServiceMetrics:
    """Metrics of one model service (target or draft); every series carries a `service` label."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None):
        self.service = service
        self.registry = registry or CollectorRegistry()
        labels = ["service"]
        r = self.registry
        self.kv_free = Gauge(PREFIX + "kv_cache_free_tokens", "Free KV cache slots, in tokens", labels, registry=r)
        self.kv_total = Gauge(PREFIX + "kv_cache_total_tokens", "KV cache capacity, in tokens", labels, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of the KV cache in use (1 = full)", labels,
                              registry=r)
        self.num_seqs = Gauge(PREFIX + "num_running_seqs", "Sequences holding KV on this service", labels,
                              registry=r)
        self.forward_time = Histogram(PREFIX + "forward_time_seconds", "Model time of one batched RPC",
                                      [*labels, "rpc"], buckets=FORWARD_BUCKETS, registry=r)
        self.batch_size = Histogram(PREFIX + "rpc_batch_size", "Sequences in one batched step RPC",
                                    [*labels, "rpc"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.rpc_requests = Counter(PREFIX + "rpc_requests", "RPCs served, by method and gRPC status code",
                                    [*labels, "rpc", "code"], registry=r)
        self.rpc_duration = Histogram(PREFIX + "rpc_duration_seconds", "Wall time of an RPC in the server",
                                      [*labels, "rpc"], buckets=FORWARD_BUCKETS, registry=r)
        self.run_ahead = Counter(PREFIX + "run_ahead", "Verify calls a target pod had run ahead (--enable-run-ahead), "
                                 "by outcome: hit (the call asked exactly that) or miss (rolled back)",
                                 [*labels, "outcome"], registry=r)

    def bind_memory(self, memory: Callable[[], tuple[int, int, int]]) -> None:
        """memory() -> (free_kv_tokens, total_kv_tokens, num_seqs), read at scrape time."""
        self.kv_free.labels(self.service).set_function(lambda: memory()[0])
        self.kv_total.labels(self.service).set_function(lambda: memory()[1])
        self.kv_usage.labels(self.service).set_function(lambda: _usage(*memory()[:2]))
        self.num_seqs.labels(self.service).set_function(lambda: memory()[2])

    def bind_prefix_cache(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        """stats() -> (prompt tokens looked up, of those found cached, tokens held by cached blocks), read at scrape
        time: vLLM's prefix_cache_queries / prefix_cache_hits counters (hit rate = hits / queries)."""
        self.registry.register(_PrefixCacheCollector(self.service, stats))

    def observe_forward(self, rpc: str, seconds: float, batch_size: int) -> None:
        self.forward_time.labels(self.service, rpc).observe(seconds)
        self.batch_size.labels(self.service, rpc).observe(batch_size)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return RpcMetricsInterceptor(self.rpc_requests.labels, self.rpc_duration.labels, self.service)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts unary-unary RPCs by method and final status code and times them (health and reflection excluded)."""

    def __init__(self, requests_labels, duration_labels, service: str):
        self._requests = requests_labels
        self._duration = duration_labels
        self._service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method.startswith("/grpc."):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        inner = handler.unary_unary

        async def unary(request, context):
            start = time.perf_counter()
            code = "OK"
            try:
                return await inner(request, context)
            except BaseException:  # abort(), a code set by the handler, cancellation, or an uncaught error
                code = ("CANCELLED" if context.cancelled() else
                        context.code().name if context.code() is not None else "UNKNOWN")
                raise
            finally:
                self._requests(self._service, rpc, code).inc()
                self._duration(self._service, rpc).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


class _PrefixCacheCollector:
    def __init__(self, service: str, stats: Callable[[], tuple[int, int, int]]):
        self.service, self.stats = service, stats

    def describe(self):
        return []  # no names reserved up front: collected only once bound

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        queries, hits, cached = self.stats()
        for name, doc, value in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries),
                                 ("prefix_cache_hits", "Prompt tokens served from the prefix cache", hits)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["service"])
            family.add_metric([self.service], value)
            yield family
        gauge = GaugeMetricFamily(PREFIX + "prefix_cache_tokens", "Tokens held by cached KV blocks", labels=["service"])
        gauge.add_metric([self.service], cached)
        yield gauge


def _usage(free: int, total: int) -> float:
    return 0.0 if total <= 0 else 1.0 - free / total
