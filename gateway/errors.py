"""Where exceptions become wire errors: OpenAI error envelopes (REST) and gRPC statuses, in one place.

`GatewayError` subclasses carry their own `http_status` / `grpc_code` / `error_type`; anything else is an internal
error. `ErrorInterceptor` applies the gRPC mapping to every handler of a `grpc.aio` server, so servicers just raise.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, NoReturn

import grpc

from gateway.types import GatewayError

log = logging.getLogger(__name__)


class RequestAborted(GatewayError):
    """The server aborted the request (Abort RPC, shutdown) before it finished. 499 is nginx's / google.rpc's code
    for CANCELLED; it is not retried by the openai SDK, which is right since some output was already generated."""

    http_status = 499
    grpc_code = "CANCELLED"
    error_type = "request_aborted"


# ------------------------------------------------------------------------------------------------------ REST
def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope; all four keys are always present."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, envelope) for an exception raised while serving a request."""
    if isinstance(exc, GatewayError):
        code = getattr(exc, "code", None)
        return exc.http_status, error_body(str(exc) or exc.error_type, exc.error_type, getattr(exc, "param", None),
                                           code)
    return 500, error_body("internal server error", "internal_error")


# ------------------------------------------------------------------------------------------------------ gRPC
def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, GatewayError):
        return getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.INTERNAL), str(exc) or exc.error_type
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with_error(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status that `exc` maps to (raises, as `context.abort` does)."""
    code, message = grpc_status(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error in a gRPC handler", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # pragma: no cover


def _passes_through(exc: BaseException) -> bool:
    """Errors that already are a status (context.abort) or a cancellation must not be remapped."""
    return isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, grpc.RpcError))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any unary or server-streaming handler to a gRPC status via `grpc_status`."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        return handler  # client-streaming / bidi handlers map their own errors with abort_with_error


def _wrap_unary(fn):
    async def unary(request, context):
        try:
            return await fn(request, context)
        except Exception as exc:
            if _passes_through(exc):
                raise
            await abort_with_error(context, exc)

    return unary


def _wrap_stream(fn):
    if inspect.isasyncgenfunction(fn):
        async def stream(request, context):
            responses = fn(request, context)
            try:
                async for response in responses:
                    yield response
            except Exception as exc:
                if _passes_through(exc):
                    raise
                await abort_with_error(context, exc)
            finally:
                await responses.aclose()  # deterministic cleanup of the handler (it may hold a backend stream)

        return stream

    async def writer(request, context):  # handlers that use context.write()
        try:
            return await fn(request, context)
        except Exception as exc:
            if _passes_through(exc):
                raise
            await abort_with_error(context, exc)

    return writer
