"""The public gRPC front (`tandem.v1.Gateway`): Generate (server streaming), Abort, Info, plus the server with the
standard health and reflection services.

It converts between the wire and `GenerateParams` / `GenerateChunk`; errors leave through `gateway.errors`. A client
cancelling Generate closes the backend's iterator, which aborts the request. It knows nothing about the speculative
loop.
"""
from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from core import algorithms
from gateway.auth import ApiKeyInterceptor
from gateway.errors import ErrorInterceptor
from gateway.tokenizer import Tokenizer
from gateway.types import (
    FinishReason,
    GenerateChunk,
    GenerateParams,
    GenerationBackend,
    MAX_STOP_STRINGS,
    InvalidRequest,
    request_sampling,
)
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc

DEFAULT_MAX_NEW_TOKENS = 16  # GenerateRequest.max_new_tokens == 0
MAX_TOP_LOGPROBS = 20  # GenerateRequest.top_logprobs, as the OpenAI front
MAX_MESSAGE_BYTES = 256 << 20
SERVICE_NAME = "tandem.v1.Gateway"

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}

InfoSource = Mapping[str, Any] | Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]


class GatewayServicer(pb_grpc.GatewayServicer):
    """Generate / Abort / Info over a GenerationBackend.

    info: a dict, or a (sync or async) callable returning one, with the keys model, speculative_algorithm,
    num_steps, topk, num_draft_tokens, max_context_len, target_addresses, draft_addresses (all optional).
    """

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer | None, info: InfoSource | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.info = info if info is not None else {}

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        params = self._params(request)
        chunks = self.backend.generate(params)
        try:
            async for chunk in chunks:
                yield _response(params.request_id, chunk)
                if chunk.finish_reason is not None:
                    break
        finally:  # cancellation by the client lands here too: closing the iterator aborts the request
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidRequest("request_id is required", "request_id")
        return pb.AbortResponse(aborted=bool(await self.backend.abort(request.request_id)))

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.GatewayInfo:
        info = self.info() if callable(self.info) else self.info
        if inspect.isawaitable(info):
            info = await info
        return pb.GatewayInfo(
            model=str(info.get("model", getattr(self.backend, "model_name", ""))),
            speculative_algorithm=str(info.get("speculative_algorithm") or algorithms.NONE.name),
            spec=pb.SpecParams(num_steps=int(info.get("num_steps") or 0), topk=int(info.get("topk") or 0),
                               num_draft_tokens=int(info.get("num_draft_tokens") or 0)),
            max_context_len=int(info.get("max_context_len", getattr(self.backend, "max_context_len", 0))),
            target_addresses=list(info.get("target_addresses") or []),
            draft_addresses=list(info.get("draft_addresses") or []),
            protocol=str(info.get("protocol", "tandem.v1")),
        )

    def _params(self, request: pb.GenerateRequest) -> GenerateParams:
        has_text, has_ids = bool(request.text), len(request.token_ids) > 0
        if has_text == has_ids:
            raise InvalidRequest("exactly one of text / token_ids must be set", "text")
        if has_text:
            if self.tokenizer is None:
                raise InvalidRequest("this server has no tokenizer; send token_ids", "text")
            prompt_ids = self.tokenizer.encode(request.text, getattr(self.backend, "max_context_len", None))
            if not prompt_ids:
                raise InvalidRequest("the prompt is empty", "text")
        else:
            prompt_ids = list(request.token_ids)
        max_new_tokens = request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        max_context_len = getattr(self.backend, "max_context_len", None)
        if max_context_len and len(prompt_ids) + max_new_tokens > max_context_len:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                 f"the maximum context length of {max_context_len} tokens", "max_new_tokens")
        if request.skip_detokenize and request.stop:
            raise InvalidRequest("stop strings need detokenization; unset skip_detokenize", "stop")
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", "top_logprobs")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(request.stop)}",
                                 "stop")
        sampling = request_sampling(  # 0 is proto3's "unset" for top_p / top_k; other values are checked as on REST
            temperature=request.temperature,
            top_p=request.top_p if request.top_p != 0.0 else 1.0,
            top_k=request.top_k if request.top_k != 0 else -1,
            seed=request.seed if request.HasField("seed") else None,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty or 1.0,
            logit_bias=dict(request.logit_bias),
        )
        return GenerateParams(request_id=request.request_id or f"gen-{uuid.uuid4().hex}",
                              prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                              stop=[s for s in request.stop if s], stop_token_ids=list(request.stop_token_ids),
                              ignore_eos=request.ignore_eos, detokenize=not request.skip_detokenize,
                              logprobs=request.top_logprobs if request.return_logprobs else None)


async def serve_gateway_grpc(servicer: GatewayServicer, host: str, port: int, *,
                             max_message_bytes: int = MAX_MESSAGE_BYTES, api_key: str | None = None
                             ) -> grpc.aio.Server:
    """Start a grpc.aio server with the Gateway, grpc.health.v1 (SERVING for "" and tandem.v1.Gateway) and
    reflection. Returns the started server; `server.bound_port` is the port bound (useful with port 0) and
    `server.health` the health servicer (call `enter_graceful_shutdown()` on it before stopping).
    api_key: when set, every RPC but health checks needs `authorization: Bearer <api_key>` metadata."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=options)
    pb_grpc.add_GatewayServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound_port = server.add_insecure_port(address)
    if bound_port == 0:
        raise OSError(f"could not bind the gateway gRPC server to {address}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    server.bound_port = bound_port
    server.health = health
    return server


async def follow_health(server: grpc.aio.Server, healthy: Callable[[], bool], interval_s: float = 0.5) -> None:
    """Keep the server's grpc.health.v1 status (service "" and tandem.v1.Gateway) equal to `healthy()`: SERVING,
    or NOT_SERVING e.g. while no target pod is reachable. Runs until cancelled."""
    serving = None
    while True:
        now = bool(healthy())
        if now != serving:
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE_NAME):
                await server.health.set(service, status)
            serving = now
        await asyncio.sleep(interval_s)


def _response(request_id: str, chunk: GenerateChunk) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                                   finish_reason=_FINISH_TO_PB[chunk.finish_reason],
                                   matched_stop=chunk.matched_stop or "",
                                   logprobs=[pb.TokenLogprob(logprob=lp, top_token_ids=ids, top_logprobs=vals)
                                             for lp, ids, vals in chunk.logprobs or ()])
    if chunk.usage is not None:
        u = chunk.usage
        response.usage.CopyFrom(pb.GenerateUsage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, verify_steps=u.verify_steps,
            accepted_draft_tokens=u.accepted_draft_tokens, proposed_draft_tokens=u.proposed_draft_tokens,
            mean_accept_length=u.mean_accept_length, predraft_hits=u.predraft_hits,
            predraft_misses=u.predraft_misses, cached_prompt_tokens=u.cached_prompt_tokens))
    return response
