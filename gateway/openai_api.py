"""OpenAI-compatible REST front: /v1/chat/completions, /v1/completions (plain JSON or SSE), /v1/models, /health,
/openapi.json (gateway/openai_schema.py), and SGLang's /start_profile and /stop_profile where the backend profiles.

It validates and tokenizes requests, turns them into `GenerateParams`, and renders the backend's `GenerateChunk`s as
OpenAI responses; every error leaves as OpenAI's error envelope. A client that disconnects closes the backend's
iterator, which aborts the request. It knows nothing about pods, drafts or the speculative loop.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from core.corpus import read_corpus_documents
from gateway.auth import ApiKeyMiddleware
from gateway.errors import error_body, http_error
from gateway.metrics import GatewayMetrics, HttpMetricsMiddleware
from gateway.openai_fanout import fan_out, merge
from gateway.openai_schema import openapi_document
from gateway.openai_stream import (DISCONNECTED, SSEResponse, close_stream, collect, collect_n, first_chunk,
                                    sse_events, sse_events_n, unless_disconnected)
from gateway.openai_protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatter,
    _SamplingRequest,
    unsupported_fields,
)
from gateway.tokenizer import Tokenizer
from protos.profiler import ProfileError, ProfileOptions
from gateway.types import (
    GatewayError,
    GenerateParams,
    GenerationBackend,
    InvalidRequest,
    ModelNotFound,
    request_sampling,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions
_NO_RETRY = {"x-should-retry": "false"}  # generation is not idempotent
# A corpus file read by the gateway: the pods' --speculative-ngram-external-corpus-max-tokens caps what they keep.
MAX_CORPUS_TOKENS = 100_000_000


class StartProfileRequest(BaseModel):
    """Body of POST /start_profile (SGLang's names; every field optional)."""
    model_config = ConfigDict(extra="forbid")

    num_steps: int | None = Field(None, ge=0, description="stop by itself after this many steps (0/None: at "
                                                             "/stop_profile)")
    activities: list[str] | None = Field(None, description='"CPU" and/or "GPU" (default both)')
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str | None = Field(None, description="names the files (letters, digits, '-', '_')")
    output_dir: str | None = Field(None, description="a directory for the files inside each process's --profile-dir "
                                                     "(relative to it, or an absolute path under it)")


class AddExternalCorpusRequest(BaseModel):
    """Body of POST /add_external_corpus (SGLang's): exactly one of file_path (a JSONL file on the gateway's host, one
    JSON string per line), documents (texts) or token_chunks (token ids, one document each)."""
    model_config = ConfigDict(extra="forbid")

    corpus_id: str | None = Field(None, description="default: file_path, else a new id")
    file_path: str | None = None
    documents: list[str] | None = None
    token_chunks: list[list[int]] | None = None


class RemoveExternalCorpusRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corpus_id: str


class PayloadTooLarge(GatewayError):
    http_status = 413
    grpc_code = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class RequestTimeout(GatewayError):
    http_status = 408
    grpc_code = "DEADLINE_EXCEEDED"
    error_type = "invalid_request_error"


DEFAULT_BODY_TIMEOUT_S = 30.0


def build_app(backend: GenerationBackend, tokenizer: Tokenizer, served_model_name: str, *, max_model_len: int,
              default_max_tokens: int | None = None,
              health_check: Callable[[], Awaitable[bool] | bool] | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
              metrics: GatewayMetrics | None = None, served_model_names: Sequence[str] = (),
              model_aliases: Sequence[str] = (), body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The OpenAI REST app over `backend`.

    default_max_tokens: default for chat requests without max_tokens (None = up to the context limit) and for
    completions (None = 16); defaults are clipped to the room left in the context, explicit values are not.
    health_check: /health answers 200 when it returns true; without one, `backend.health()` is used if it exists.
    api_key: when set, every route but /health and /metrics needs `Authorization: Bearer <api_key>` (else 401).
    metrics: served at /metrics (default: `backend.metrics` if the backend has one); counts responses by status.
    served_model_names: more names listed by /v1/models and accepted in requests (responses name served_model_name).
    model_aliases: names requests may use without being listed (the model's path, its folder name).
    body_timeout_s: a request body not received within this many seconds is a 408.
    """
    server = _OpenAIServer(backend, tokenizer, served_model_name, max_model_len=max_model_len,
                           default_max_tokens=default_max_tokens, health_check=health_check,
                           max_body_bytes=max_body_bytes, served_model_names=served_model_names,
                           model_aliases=model_aliases, body_timeout_s=body_timeout_s)
    app = FastAPI(title="Tandem OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.openai_server = server
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", server.retrieve_model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    if hasattr(backend, "start_profile"):  # SGLang's / vLLM's profiler endpoints (gateway/profiling.py)
        app.add_api_route("/start_profile", server.start_profile, methods=["POST"])
        app.add_api_route("/stop_profile", server.stop_profile, methods=["POST"])
    if hasattr(backend, "add_external_corpus"):  # SGLang's NGRAM corpus endpoints (gateway/scheduler.py)
        app.add_api_route("/add_external_corpus", server.add_external_corpus, methods=["POST"])
        app.add_api_route("/remove_external_corpus", server.remove_external_corpus, methods=["POST"])
        app.add_api_route("/list_external_corpora", server.list_external_corpora, methods=["GET", "POST"])
    document = openapi_document()

    async def openapi() -> JSONResponse:
        return JSONResponse(document)

    app.add_api_route("/openapi.json", openapi, methods=["GET"])
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    metrics = metrics if metrics is not None else getattr(backend, "metrics", None)
    if metrics is not None:
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

        app.add_api_route("/metrics", prometheus, methods=["GET"])
        app.add_middleware(HttpMetricsMiddleware, counter=metrics.http_requests)  # outermost: sees 401s too

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(error_body("internal server error", "internal_error"), status_code=500,
                            headers=_NO_RETRY)

    return app


class _OpenAIServer:
    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, served_model_name: str, *,
                 max_model_len: int, default_max_tokens: int | None, health_check, max_body_bytes: int,
                 served_model_names: Sequence[str] = (), model_aliases: Sequence[str] = (),
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.listed_names = list(dict.fromkeys([served_model_name, *served_model_names]))
        self.accepted_names = {*self.listed_names, *model_aliases}
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.health_check = health_check
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------ routes
    async def chat_completions(self, request: Request) -> Response:
        return await self._guard(self._chat_completions, request)

    async def completions(self, request: Request) -> Response:
        return await self._guard(self._completions, request)

    async def list_models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.listed_names]})

    async def retrieve_model(self, model: str) -> JSONResponse:
        if model not in self.accepted_names:
            return self._error_response(self._model_not_found(model))
        return JSONResponse(self._model_card(model if model in self.listed_names else self.model_name))

    async def health(self) -> Response:
        try:
            healthy = await self._is_healthy()
        except Exception as exc:  # a failing probe is an unhealthy server, not a 500
            log.warning("health check failed: %s", exc)
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the backend is not healthy", "service_unavailable"), status_code=503)

    # ------------------------------------------------------------------------------------------ profiling
    async def start_profile(self, request: Request) -> Response:
        return await self._guard(self._start_profile, request)

    async def stop_profile(self, request: Request) -> Response:
        return await self._guard(self._stop_profile, request)

    async def _start_profile(self, request: Request) -> Response:
        req = await self._validated(request, StartProfileRequest, empty_ok=True)
        options = ProfileOptions(num_steps=req.num_steps or 0, activities=tuple(req.activities or ()),
                                 record_shapes=req.record_shapes, with_stack=req.with_stack,
                                 profile_id=req.profile_id or "", output_dir=req.output_dir or "")
        try:
            return JSONResponse(await self.backend.start_profile(options))
        except (ValueError, ProfileError) as exc:
            raise InvalidRequest(str(exc)) from None

    async def _stop_profile(self, request: Request) -> Response:
        return JSONResponse(await self.backend.stop_profile())

    # ------------------------------------------------------------------------------------ external corpora
    async def add_external_corpus(self, request: Request) -> Response:
        return await self._guard(self._add_external_corpus, request)

    async def remove_external_corpus(self, request: Request) -> Response:
        return await self._guard(self._remove_external_corpus, request)

    async def list_external_corpora(self, request: Request) -> Response:
        return await self._guard(self._list_external_corpora, request)

    async def _list_external_corpora(self, request: Request) -> Response:
        return JSONResponse(await self.backend.list_external_corpora())

    async def _add_external_corpus(self, request: Request) -> Response:
        req = await self._validated(request, AddExternalCorpusRequest)
        given = [name for name in ("file_path", "documents", "token_chunks") if getattr(req, name) is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of file_path, documents, token_chunks", "file_path")
        if req.token_chunks is not None:
            documents = [chunk for chunk in req.token_chunks if chunk]
            if any(t < 0 for chunk in documents for t in chunk):
                raise InvalidRequest("token ids must be non-negative", "token_chunks")
        elif self.tokenizer is None:
            raise InvalidRequest("this server has no tokenizer; send token_chunks", given[0])
        else:
            encode = lambda text: self.tokenizer.hf.encode(text, add_special_tokens=False)  # noqa: E731
            try:
                documents = (read_corpus_documents(req.file_path, encode, MAX_CORPUS_TOKENS) if req.file_path
                             else [ids for ids in map(encode, req.documents) if ids])
            except ValueError as exc:
                raise InvalidRequest(str(exc), "file_path") from None
        if not documents:
            raise InvalidRequest("the corpus has no tokens", given[0])
        corpus_id = req.corpus_id or req.file_path or f"corpus-{uuid.uuid4().hex[:12]}"
        return JSONResponse(await self.backend.add_external_corpus(corpus_id, documents))

    async def _remove_external_corpus(self, request: Request) -> Response:
        req = await self._validated(request, RemoveExternalCorpusRequest)
        return JSONResponse(await self.backend.remove_external_corpus(req.corpus_id))

    # ------------------------------------------------------------------------------------------ generation
    async def _chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        if not req.messages:
            raise InvalidRequest("messages must be a non-empty list", "messages")
        prompt_ids = self.tokenizer.apply_chat_template(req.messages, max_len=self.max_model_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, "chatcmpl-", prompt_ids, max_tokens, self.default_max_tokens, "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        params.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        fmt = ResponseFormatter(chat=True, request_id=params.request_id, created=int(time.time()),
                                model=self.model_name, token_text=self._token_text, logprobs=req.logprobs is True)
        return await self._respond(request, req, params, fmt)

    async def _completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        prompt_ids = self._completion_prompt(req.prompt)
        default = self.default_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        params = self._params(req, "cmpl-", prompt_ids, req.max_tokens, default, "prompt")
        params.logprobs = req.logprobs
        fmt = ResponseFormatter(chat=False, request_id=params.request_id, created=int(time.time()),
                                model=self.model_name, token_text=self._token_text, logprobs=req.logprobs is not None)
        return await self._respond(request, req, params, fmt)

    async def _respond(self, request: Request, req: _SamplingRequest, params: GenerateParams,
                       fmt: ResponseFormatter) -> Response:
        if req.n > 1:
            return await self._respond_n(request, req, params, fmt)
        chunks = self.backend.generate(params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # Wait for the first chunk before sending headers, so admission errors keep their HTTP status.
            first = await unless_disconnected(request, first_chunk(chunks))
            if first is DISCONNECTED:
                await close_stream(chunks)
                return Response(status_code=499)
            return SSEResponse(sse_events(chunks, first, fmt, include_usage),
                                media_type="text/event-stream", headers={"cache-control": "no-cache"})
        result = await unless_disconnected(request, collect(chunks))
        if result is DISCONNECTED:
            return Response(status_code=499)
        text, finish, usage, token_ids, logprobs = result
        return JSONResponse(fmt.response(text, finish, usage, token_ids, logprobs))

    async def _respond_n(self, request: Request, req: _SamplingRequest, params: GenerateParams,
                         fmt: ResponseFormatter) -> Response:
        """n > 1: n generations (gateway/openai_fanout.py) merged into one response or one indexed SSE stream."""
        merged = merge([self.backend.generate(p) for p in fan_out(params, req.n)])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            first = await unless_disconnected(request, first_chunk(merged))
            if first is DISCONNECTED:
                await close_stream(merged)
                return Response(status_code=499)
            return SSEResponse(sse_events_n(merged, first, fmt, include_usage, req.n),
                                media_type="text/event-stream", headers={"cache-control": "no-cache"})
        result = await unless_disconnected(request, collect_n(merged, req.n))
        if result is DISCONNECTED:
            return Response(status_code=499)
        choices, usage = result
        return JSONResponse(fmt.response_choices(choices, usage))

    def _params(self, req: _SamplingRequest, id_prefix: str, prompt_ids: list[int], max_tokens: int | None,
                default_max_tokens: int | None, prompt_param: str) -> GenerateParams:
        prompt_len = len(prompt_ids)
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", prompt_param)
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
            if max_tokens < 1:
                raise _context_error(self.max_model_len, prompt_len, 1, prompt_param)
        elif max_tokens > room:
            raise _context_error(self.max_model_len, prompt_len, max_tokens, prompt_param)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}", "stop")
        stop_token_ids = list(req.stop_token_ids or [])
        if any(t < 0 for t in stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative", "stop_token_ids")
        sampling = request_sampling(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            seed=None if req.seed in (None, -1) else req.seed,  # -1: no seed, as clients send it
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias),
        )
        return GenerateParams(request_id=id_prefix + uuid.uuid4().hex, prompt_token_ids=prompt_ids,
                              max_new_tokens=max_tokens, sampling=sampling, stop=[s for s in stop if s],
                              stop_token_ids=stop_token_ids, ignore_eos=req.ignore_eos)

    def _token_text(self, token_id: int) -> str:
        """A token's text in logprobs (special tokens included, as OpenAI lists them)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_prompt(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, max_len=self.max_model_len)
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            if min(prompt) < 0:
                raise InvalidRequest("prompt token ids must be non-negative", "prompt")
            return list(prompt)
        if len(prompt) > 1:
            raise InvalidRequest("batched prompts are not supported; send one prompt per request", "prompt")
        return self._completion_prompt(prompt[0])

    # ------------------------------------------------------------------------------------------ helpers
    async def _guard(self, handler: Callable[[Request], Awaitable[Response]], request: Request) -> Response:
        """Every error of a generation route becomes an OpenAI envelope with its HTTP status."""
        try:
            return await handler(request)
        except GatewayError as exc:
            return self._error_response(exc)
        except ClientDisconnect:  # the client left while sending its body: nothing to answer, nothing failed here
            log.info("499 %s: the client disconnected before its request body was complete", request.url.path)
            return Response(status_code=499)
        except Exception:
            log.exception("unhandled error serving %s", request.url.path)
            return JSONResponse(error_body("internal server error", "internal_error"), status_code=500,
                                headers=_NO_RETRY)

    def _error_response(self, exc: GatewayError) -> JSONResponse:
        status, body = http_error(exc)
        headers = _NO_RETRY if status >= 500 and status != 503 or status == 499 else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def _validated(self, request: Request, model: type[BaseModel], *, empty_ok: bool = False) -> Any:
        """The request's JSON object body validated as `model` (InvalidRequest / RequestTimeout otherwise);
        empty_ok: an empty body is `{}`."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _read_body(request, self.max_body_bytes)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {self.body_timeout_s:g}s") from None
        try:
            data = json.loads(body) if body.strip() or not empty_ok else {}
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequest("the request body is nested too deeply") from None
        if not isinstance(data, dict):
            raise InvalidRequest("the request body must be a JSON object")
        _check_text(data)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            body = _validation_body(exc.errors())["error"]
            raise InvalidRequest(body["message"], body["param"]) from None

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        req = await self._validated(request, model)
        if req.model is not None and req.model not in self.accepted_names:
            raise self._model_not_found(req.model)
        unsupported = unsupported_fields(req)
        if unsupported:
            name = unsupported[0]
            hint = " (only n=1)" if name == "n" else ""
            raise InvalidRequest(f"'{name}' is not supported by this server{hint}", name)
        return req

    def _model_not_found(self, model: str) -> ModelNotFound:
        exc = ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.model_name}`.")
        exc.param, exc.code = "model", "model_not_found"
        return exc

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tandem",
                "root": self.model_name, "max_model_len": self.max_model_len}

    async def _is_healthy(self) -> bool:
        probe = self.health_check or getattr(self.backend, "health", None)
        if probe is None:
            return True
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        return bool(result)


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    too_large = PayloadTooLarge(f"the request body is larger than {max_body_bytes} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_body_bytes:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _context_error(max_model_len: int, prompt_len: int, max_tokens: int, param: str) -> InvalidRequest:
    exc = InvalidRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the completion). "
        f"Please reduce the length of the {param} or completion.", param)
    exc.code = "context_length_exceeded"
    return exc


def _validation_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more validation errors)"
    return error_body(message, "invalid_request_error", param)


def _check_text(data: Any) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no tokenizer, log line or response can encode:
    refuse it here, for every field at once (and bound the nesting the validators will walk)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the request contains a lone UTF-16 surrogate (invalid Unicode text)") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}; a key that is not a token id is a 400 on logit_bias."""
    out = {}
    for key, bias in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from None
        out[token] = float(bias)
    return out
