"""OpenAI REST wire shapes: pydantic request models (validation only) and the response / stream-chunk builders.

Requests accept and ignore unknown fields (as vLLM does); fields we cannot honour yet are rejected by
`unsupported_fields` with a clear message rather than silently ignored. Responses are plain dicts shaped exactly as
openai-python's strict models expect. Nothing here knows about the backend or the tokenizer.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.types import Usage

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and legacy completions (including the vLLM/SGLang extensions we support)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None = the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None  # None = 1.0; 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # extension; None, 0 and -1 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    # Accepted for compatibility, rejected below unless they keep their neutral value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Any]  # roles and content parts are checked by Tokenizer.apply_chat_template (clear messages)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def unsupported_fields(req: _SamplingRequest) -> list[str]:
    """Names of fields set to a value this server cannot honour."""
    checks = {
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "logit_bias": bool(req.logit_bias),
        "logprobs": bool(getattr(req, "logprobs", None)),
        "top_logprobs": bool(getattr(req, "top_logprobs", None)),
        "tools": bool(getattr(req, "tools", None)),
        "tool_choice": getattr(req, "tool_choice", None) not in (None, "none", "auto"),
        "functions": bool(getattr(req, "functions", None)),
        "response_format": (getattr(req, "response_format", None) or {"type": "text"}).get("type") != "text",
        "prediction": bool(getattr(req, "prediction", None)),
        "echo": bool(getattr(req, "echo", False)),
        "suffix": bool(getattr(req, "suffix", None)),
        "best_of": (getattr(req, "best_of", None) or 1) != 1,
    }
    return [name for name, bad in checks.items() if bad]


# ------------------------------------------------------------------------------------------------- responses
def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI usage; speculative stats go to `completion_tokens_details.*_prediction_tokens` (OpenAI's own
    Predicted Outputs fields) and, in full, to the extra object `usage.spec` (extra keys pass strict clients)."""
    rejected = max(usage.proposed_draft_tokens - usage.accepted_draft_tokens, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
            "rejected_prediction_tokens": rejected,
            "reasoning_tokens": 0,
        },
        "spec": {
            "verify_steps": usage.verify_steps,
            "accepted_draft_tokens": usage.accepted_draft_tokens,
            "proposed_draft_tokens": usage.proposed_draft_tokens,
            "mean_accept_length": round(usage.mean_accept_length, 4),
            "predraft_hits": usage.predraft_hits,
            "predraft_misses": usage.predraft_misses,
        },
    }


class ResponseFormatter:
    """Builds the response and stream chunks of one request; `chat` selects the chat or legacy-completion shape."""

    def __init__(self, *, chat: bool, request_id: str, created: int, model: str):
        self.chat = chat
        self.request_id = request_id
        self.created = created
        self.model = model

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        return self.response_choices([(text, finish_reason)], usage)

    def response_choices(self, choices: list[tuple[str, str]], usage: Usage) -> dict[str, Any]:
        """(text, finish_reason) per choice index (n >= 1)."""
        if self.chat:
            body = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish} for i, (text, finish) in enumerate(choices)]
            return self._envelope("chat.completion", body, system_fingerprint=None, usage=usage_body(usage))
        body = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                for i, (text, finish) in enumerate(choices)]
        return self._envelope("text_completion", body, system_fingerprint=None, usage=usage_body(usage))

    def role_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The chat stream's opening chunk (per choice); legacy completions have none."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def text_chunk(self, text: str, finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"content": text} if text else {}, finish_reason, index)
        return self._chunk(text, finish_reason, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage_body(usage))

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], usage=None)
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=None)
