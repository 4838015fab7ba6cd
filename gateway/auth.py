"""API-key checks of the public fronts: an ASGI middleware for the OpenAI REST app (`Authorization: Bearer <key>`,
401 with OpenAI's error body) and a gRPC server interceptor for Generate (`authorization` metadata, UNAUTHENTICATED).

Probes stay open: `/health` and `/metrics` over HTTP, `grpc.health.v1.Health` over gRPC. Keys are compared in
constant time. It knows nothing about requests beyond their headers.
"""
from __future__ import annotations

import hmac
import json

import grpc

from gateway.errors import error_body

OPEN_PATHS = ("/health", "/metrics")
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer_matches(header: str | None, api_key: str) -> bool:
    """True when `header` is `Bearer <api_key>` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, so SSE disconnect detection is untouched)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"").decode("latin-1")
        if bearer_matches(header, self.api_key):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if header else
                   "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health checks without `authorization: Bearer <key>` metadata."""

    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self.api_key):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or invalid API key (send metadata authorization: Bearer <key>)"

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
