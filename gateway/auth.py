"""API-key checks of the public fronts: an ASGI middleware for the OpenAI REST app (`Authorization: Bearer <key>`,
401 with OpenAI's error body) and a gRPC server interceptor for Generate (`authorization` metadata, UNAUTHENTICATED).

Probes stay open: `/health` and `/metrics` over HTTP, `grpc.health.v1.Health` over gRPC. Keys are compared in
constant time. It knows nothing about requests beyond their headers.
"""
from __future__ import annotations

import json

from gateway.errors import error_body
from protos.service_auth import OPEN_GRPC_PREFIXES, BearerTokenInterceptor, bearer_matches  # noqa: F401

OPEN_PATHS = ("/health", "/metrics", "/openapi.json")


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
        values = [v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"]
        header = values[0].decode("latin-1") if values else ""
        if len(values) == 1 and bearer_matches(header, self.api_key):
            return await self.app(scope, receive, send)
        message = ("Send one Authorization header, not several." if len(values) > 1 else
                   "Incorrect API key provided." if header else
                   "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


class ApiKeyInterceptor(BearerTokenInterceptor):
    """Refuses every RPC but health checks without exactly one `authorization: Bearer <key>` metadata entry."""

    def __init__(self, api_key: str):
        super().__init__(api_key, "API key")
