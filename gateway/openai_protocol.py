"""OpenAI REST wire shapes: pydantic request models (validation only) and the response / stream-chunk builders.

Requests accept and ignore unknown fields (as vLLM does); fields we cannot honour yet are rejected by
`unsupported_fields` with a clear message rather than silently ignored. Responses are plain dicts shaped exactly as
openai-python's strict models expect. Nothing here knows about the backend; token texts for logprobs come in
as a callable.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.types import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, Usage  # noqa: F401  (limits re-exported)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and legacy completions (including the vLLM/SGLang extensions we support).

    Strict types: JSON's true is not the integer 1 and 4.0 is not a token id (a float field still takes an integer)."""

    model_config = ConfigDict(extra="allow", strict=True)

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
    presence_penalty: float | None = None  # [-2, 2], exact under speculation (the target applies it in verify)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM/HF), > 0, 1 = off
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]


_MESSAGE_SCHEMA = {  # documents the shape only (OpenAPI); Tokenizer.apply_chat_template checks it with clear messages
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"}}}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Any] = Field(json_schema_extra={"items": _MESSAGE_SCHEMA})  # checked by the tokenizer
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def unsupported_fields(req: _SamplingRequest) -> list[str]:
    """Names of fields set to a value this server cannot honour."""
    checks = {
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
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
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
    """Builds the response and stream chunks of one request; `chat` selects the chat or legacy-completion shape.
    token_text: id -> token string, needed when the request asked for logprobs (`logprobs` is then True)."""

    def __init__(self, *, chat: bool, request_id: str, created: int, model: str,
                 token_text: Callable[[int], str] | None = None, logprobs: bool = False):
        self.chat = chat
        self.request_id = request_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs and token_text is not None
        self._offsets: dict[int, int] = {}  # legacy completions' text_offset, per choice, across stream chunks

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int] | None = None,
                 logprobs: list | None = None) -> dict[str, Any]:
        return self.response_choices([(text, finish_reason, token_ids or [], logprobs)], usage)

    def response_choices(self, choices: list[tuple], usage: Usage) -> dict[str, Any]:
        """(text, finish_reason[, token ids, logprob entries]) per choice index (n >= 1)."""
        body = []
        for i, choice in enumerate(choices):
            text, finish = choice[0], choice[1]
            lp = self.logprobs_body(i, choice[2], choice[3]) if len(choice) > 3 else None
            if self.chat:
                body.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": lp, "finish_reason": finish})
            else:
                body.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, body, system_fingerprint=None, usage=usage_body(usage))

    def logprobs_body(self, index: int, token_ids: list[int], entries: list | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (chat: content list; completions: parallel lists), or None when
        the request did not ask. entries: (logprob, top ids, top logprobs) per token."""
        if not self.logprobs or entries is None:
            return None
        texts = [self.token_text(t) for t in token_ids]
        if self.chat:
            def entry(tok: str, lp: float) -> dict[str, Any]:
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            content = [{**entry(tok, lp), "top_logprobs": [entry(self.token_text(i), v) for i, v in zip(ids, vals)]}
                       for tok, (lp, ids, vals) in zip(texts, entries)]
            return {"content": content, "refusal": None}
        offsets, pos = [], self._offsets.get(index, 0)
        for tok in texts:
            offsets.append(pos)
            pos += len(tok)
        self._offsets[index] = pos
        return {"tokens": texts, "token_logprobs": [lp for lp, _, _ in entries],
                "top_logprobs": [{self.token_text(i): v for i, v in zip(ids, vals)} for _, ids, vals in entries],
                "text_offset": offsets}

    def role_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The chat stream's opening chunk (per choice); legacy completions have none."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def text_chunk(self, text: str, finish_reason: str | None = None, index: int = 0,
                   token_ids: list[int] | None = None, logprobs: list | None = None) -> dict[str, Any]:
        lp = self.logprobs_body(index, token_ids or [], logprobs) if logprobs else None
        if self.chat:
            return self._chunk({"content": text} if text else {}, finish_reason, index, lp)
        return self._chunk(text, finish_reason, index, lp)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage_body(usage))

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], usage=None)
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=None)
