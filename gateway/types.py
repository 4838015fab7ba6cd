"""Gateway-internal request and result types, shared by the front ends (OpenAI REST, gRPC Generate) and the scheduler.

These are plain dataclasses: no torch, no protobuf. The front ends turn user requests into `GenerateParams`, the
scheduler (`GenerationBackend`) turns them into a stream of `GenerateChunk`s.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from core.types import MAX_SEED, SamplingParams
from core.types import FinishReason  # noqa: F401  (re-exported: the front ends' finish reasons)


class GatewayError(Exception):
    """Base of errors the front ends map to OpenAI error bodies / gRPC statuses."""

    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "internal_error"


class InvalidRequest(GatewayError):
    """The request is malformed or violates a limit (HTTP 400 / INVALID_ARGUMENT)."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(GatewayError):
    http_status = 404
    grpc_code = "NOT_FOUND"
    error_type = "not_found_error"


class Overloaded(GatewayError):
    """Queue full or KV exhausted (HTTP 429 / RESOURCE_EXHAUSTED)."""

    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    error_type = "rate_limit_error"


class Unavailable(GatewayError):
    """No model pod can serve the request (HTTP 503 / UNAVAILABLE)."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "service_unavailable"


class DeadlineExceeded(GatewayError):
    """The request ran past its deadline (HTTP 504 / DEADLINE_EXCEEDED)."""

    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    error_type = "timeout_error"


MAX_TOP_K = 2**31 - 1  # int32 on the wire; any k >= the vocabulary keeps every token
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # per position, as OpenAI's API


def request_sampling(temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                     logit_bias: dict[int, float] | None = None) -> SamplingParams:
    """The sampling knobs of one request (temperature 0 means greedy), checked once for the REST and gRPC fronts:
    InvalidRequest names the first field out of range, and every value accepted here is accepted by the pods (a seed
    of -1 is turned into None, "no seed", by the fronts before it gets here). logit_bias: OpenAI's {token id: bias}."""
    logit_bias = logit_bias or {}
    if not (0.0 <= temperature <= 100.0):
        raise InvalidRequest(f"temperature must be in [0, 100], got {temperature}", "temperature")
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if not _is_int(top_k) or top_k == 0 or top_k < -1 or top_k > MAX_TOP_K:
        raise InvalidRequest(f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got {top_k}", "top_k")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise InvalidRequest(f"seed must be in [0, 2**63) (-1 or null = no seed), got {seed}", "seed")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2.0 <= value <= 2.0:
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", name)
    if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in logit_bias.items()):
        raise InvalidRequest("logit_bias maps token ids >= 0 to biases in [-100, 100]", "logit_bias")
    if not 0.0 < repetition_penalty <= 100.0:
        raise InvalidRequest(f"repetition_penalty must be in (0, 100] (1 = off), got {repetition_penalty}",
                             "repetition_penalty")
    try:
        return SamplingParams(temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, repetition_penalty,
                              logit_bias)
    except ValueError as exc:  # a value of the wrong type (the checks above bound every number)
        raise InvalidRequest(str(exc)) from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_params(params: "GenerateParams", vocab_size: int) -> None:
    """The request fields beyond sampling that the pods bound, checked once for both fronts (the scheduler's
    admission): InvalidRequest names the first field out of range."""
    if params.max_new_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
    ids = params.prompt_token_ids
    if ids and (max(ids) >= vocab_size or min(ids) < 0):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if any(not _is_int(t) or not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
    if any(token >= vocab_size for token, _ in params.sampling.logit_bias):
        raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(params.stop)}", "stop")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")


@dataclass
class GenerateParams:
    """One generation request after validation and tokenization."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # checked by request_sampling
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS ids
    ignore_eos: bool = False
    detokenize: bool = True
    deadline_s: float | None = None  # absolute time.monotonic() deadline; None = the server default
    logprobs: int | None = None  # None: none; k >= 0: each output token's logprob and its k most likely alternatives


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    verify_steps: int = 0  # target steps after prefill
    accepted_draft_tokens: int = 0
    proposed_draft_tokens: int = 0
    predraft_hits: int = 0  # overlapped drafting: steps whose tree was pre-drafted during the previous verify
    predraft_misses: int = 0  # pre-drafts dropped because the verify outcome differed from the guess
    cached_prompt_tokens: int = 0  # prompt tokens served from the target's prefix cache

    @property
    def mean_accept_length(self) -> float:
        """Tokens committed per target forward, bonus included; the prefill-sampled token counts (SGLang's rule)."""
        steps = self.verify_steps + 1
        return self.completion_tokens / steps if self.completion_tokens else 0.0


@dataclass
class GenerateChunk:
    """Newly committed output of one request; the last chunk has `finish_reason` and `usage` set."""

    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    matched_stop: str | None = None
    # per token of token_ids when the request asked for logprobs: (logprob, top token ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


class GenerationBackend(Protocol):
    """What the front ends need from the scheduler."""

    model_name: str
    max_context_len: int

    def generate(self, params: GenerateParams) -> AsyncIterator[GenerateChunk]:
        """Admit the request and stream its chunks; raises GatewayError subclasses on rejection.

        Closing the iterator early (client disconnect) aborts the request and frees its KV on every pod.
        """
        ...

    async def abort(self, request_id: str) -> bool:
        ...
