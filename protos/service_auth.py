"""Bearer-token checks of gRPC servers: the model services' shared service credential (`--service-api-key`) and the
gateway's public API key use the same interceptor. Health checks stay open (probes carry no credential).

A call passes only with exactly one `authorization: Bearer <key>` metadata entry (two entries are refused rather than
taking either); keys are compared in constant time. It knows nothing about the services behind it.
"""
from __future__ import annotations

import hmac

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer_matches(header: str | None, api_key: str) -> bool:
    """True when `header` is `Bearer <api_key>` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the key (empty without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health checks (UNAUTHENTICATED) without exactly one matching bearer token."""

    def __init__(self, api_key: str, what: str = "API key", open_prefixes: tuple[str, ...] = OPEN_GRPC_PREFIXES):
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.api_key = api_key
        self.open_prefixes = open_prefixes
        self.message = f"missing or invalid {what} (send metadata authorization: Bearer <key>)"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.open_prefixes):
            return handler
        values = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == "authorization"]
        if len(values) == 1 and isinstance(values[0], str) and bearer_matches(values[0], self.api_key):
            return handler
        return refusal(handler, self.message)


def refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)
