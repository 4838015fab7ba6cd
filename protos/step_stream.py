"""Server side of the persistent step streams (VerifyStream / ProposeStream): one response per request, in order.

Each streamed request runs through the service's unary handler body, so validation, the model worker thread (and
with it the ordering against Prefill/Release) and the per-step metrics are the same as for the unary RPC. The RPC
counters of a streamed step are filled here under the unary method's name, because the server interceptor
(tandem.observability) only sees the stream as one long call.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc


async def serve_step_stream(request_iterator: AsyncIterator, context, handle: Callable[..., Awaitable], rpc: str,
                            metrics=None) -> AsyncIterator:
    """Yield handle(request, context) for every request of the stream. A handler that aborts (INVALID_ARGUMENT)
    ends the stream with that status, as documented in tandem.proto; the client opens a new stream."""
    async for request in request_iterator:
        start = time.perf_counter()
        code = "OK"
        try:
            response = await handle(request, context)
        except BaseException:  # abort(), cancellation (the client went away) or an uncaught error
            code = ("CANCELLED" if context.cancelled() else
                    context.code().name if isinstance(context.code(), grpc.StatusCode) else "UNKNOWN")
            raise
        finally:
            if metrics is not None:
                metrics.rpc_requests.labels(metrics.service, rpc, code).inc()
                metrics.rpc_duration.labels(metrics.service, rpc).observe(time.perf_counter() - start)
        yield response
