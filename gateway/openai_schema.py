"""The REST API's OpenAPI document (`/openapi.json`), generated from the pydantic request models the routes validate
with and from response models that describe exactly what `openai_protocol.ResponseFormatter` and the error envelope
emit. The property-based fuzz (tests/hardening/test_openapi_fuzz.py) draws requests from this document and checks
every response against it, so the document cannot drift from the code unnoticed. Nothing here serves requests.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest

FinishReasonName = Literal["stop", "length", "abort"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx/5xx body."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class UsageBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # prompt/completion token details, `spec`
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReasonName | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: FinishReasonName | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthOk(BaseModel):
    status: Literal["ok"]


_MODELS = (CompletionRequest, ChatCompletionRequest, ErrorResponse, CompletionResponse, ChatCompletionResponse,
           ModelCard, ModelList, HealthOk)
ERROR_STATUSES = ("400", "401", "404", "408", "413", "429", "499", "500", "503", "504")


def openapi_document(title: str = "Tandem OpenAI-compatible API", version: str = "1") -> dict[str, Any]:
    """OpenAPI 3.1 of the REST routes: request bodies from the request models, responses (JSON, or SSE for
    `stream: true`) from the response models, every error status with the error envelope."""
    components: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization"
                                         if model not in (CompletionRequest, ChatCompletionRequest) else "validation")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def responses(ok: dict[str, Any], stream: bool = False) -> dict[str, Any]:
        content = {"application/json": {"schema": ok}}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        out = {"200": {"description": "OK", "content": content}}
        out.update({code: {"description": "error", "content": {"application/json": {"schema": ref("ErrorResponse")}}}
                    for code in ERROR_STATUSES})
        return out

    def post(request: str, response: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "operationId": summary.replace(" ", "_"),
                         "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
                         "responses": responses(ref(response), stream=True)}}

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/completions": post("CompletionRequest", "CompletionResponse", "create completion"),
            "/v1/chat/completions": post("ChatCompletionRequest", "ChatCompletionResponse", "create chat completion"),
            "/v1/models": {"get": {"summary": "list models", "operationId": "list_models",
                                   "responses": responses(ref("ModelList"))}},
            "/health": {"get": {"summary": "health", "operationId": "health", "responses": responses(ref("HealthOk"))}},
        },
        "components": {"schemas": components},
    }
