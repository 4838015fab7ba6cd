"""One error policy for the model services' gRPC handlers: an exception that escapes a handler ends that call with a
typed status and a message that names it, instead of grpc's UNKNOWN "Unexpected <class ...>":

    ValueError / TypeError (a request the convert modules refused as a whole) -> INVALID_ARGUMENT
    TimeoutError                                                            -> DEADLINE_EXCEEDED
    anything else (a bug, a device error)                                   -> INTERNAL, logged with its traceback

Per-sequence problems never get here (they are INVALID results beside the others); aborts, cancellations and the
auth interceptor's refusals pass through untouched. The service keeps serving the next call either way.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

logger = logging.getLogger(__name__)

_CODES = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT), (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
          (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED))


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a call ends with for an exception its handler raised."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _passes(exc: BaseException) -> bool:
    # context.abort() raises AbortError; a client going away cancels the handler
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit, KeyboardInterrupt,
                            SystemExit))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps what escapes the unary and bidi-stream handlers (the model services use those) to typed statuses."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except BaseException as exc:
                    if _passes(exc):
                        raise
                    await _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(unary, des, ser)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(request_iterator, context):
                try:
                    async for response in inner_stream(request_iterator, context):
                        yield response
                except BaseException as exc:
                    if _passes(exc):
                        raise
                    await _abort(context, method, exc)

            return grpc.stream_stream_rpc_method_handler(stream, des, ser)
        return handler


async def _abort(context, method: str, exc: BaseException) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=exc)
    else:
        logger.info("%s refused: %s (%s)", method, message, code.name)
    await context.abort(code, message)
