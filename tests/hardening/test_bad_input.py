"""Issue 15 §5/§10: input that used to be a 500 or was silently coerced is a 400 with OpenAI's error body — deeply
nested JSON, lone UTF-16 surrogates anywhere in the body, non-integer token ids and booleans for integers, two
Authorization headers."""
from __future__ import annotations

import httpx
import pytest

from gateway.openai_api import build_app
from tests.gateway.conftest import MODEL_NAME, FakeBackend


@pytest.fixture
def app(tokenizer):
    return build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, max_model_len=256)


async def _post(app, path: str, content: bytes, headers=None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})


def _assert_openai_400(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "max_tokens": 2, "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "x", "extra": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}",
], ids=["list-nesting", "object-nesting"])
async def test_deeply_nested_json_is_a_400(app, body):
    _assert_openai_400(await _post(app, "/v1/completions", body))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}'),
], ids=["prompt", "message", "content-part", "model", "stop"])
async def test_lone_surrogates_are_a_400(app, path, body):
    _assert_openai_400(await _post(app, path, body))


async def test_a_surrogate_pair_is_still_text(app):
    response = await _post(app, "/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field", [{"max_tokens": True}, {"prompt": [[False]]}, {"prompt": [1.0, 2]},
                                   {"n": True}, {"seed": 1.5}, {"stream": "yes"}, {"top_k": 1e12},
                                   {"stop_token_ids": [1e12]}, {"logprobs": True}])
async def test_strict_types(app, field):
    import json

    body = {"prompt": "hello", "max_tokens": 2, **field}
    error = _assert_openai_400(await _post(app, "/v1/completions", json.dumps(body).encode()))
    assert error["param"] and error["param"].split(".")[0] == next(iter(field))


async def test_two_authorization_headers_are_refused(tokenizer):
    app = build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, max_model_len=256, api_key="k")
    transport = httpx.ASGITransport(app=app)
    body = {"prompt": "hello", "max_tokens": 2}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        ok = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200
        for pair in (["Bearer k", "Bearer wrong"], ["Bearer wrong", "Bearer k"], ["Bearer k", "Bearer k"]):
            headers = httpx.Headers([("authorization", v) for v in pair])
            response = await client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
