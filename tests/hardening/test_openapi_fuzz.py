"""Issue 15 "keep it tested": the REST API serves its OpenAPI document (/openapi.json, from the request models) and a
bounded property-based fuzz (hypothesis; a few hundred requests, seconds) drives the real stack (gateway + target
service in-process) with bodies drawn from that document — valid ones, edge values (huge and negative integers, NaN,
lone surrogates, wrong types) and junk in any field. Properties: no 5xx, and every response matches the document's
schema for its status."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.openai_schema import openapi_document

DOC = openapi_document()
SCHEMAS = DOC["components"]["schemas"]
NUM_EXAMPLES = 200  # per route: bounded so the fuzz takes seconds

JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
EDGE_INTS = st.sampled_from([0, -1, -2, 1, 2**31, 2**63, 2**64 + 1, 10**12, -(2**63)])
EDGE_FLOATS = st.sampled_from([0.0, -0.5, 1.5, 1e12, -1e12, float("nan"), float("inf"), 1e-30])
TEXT = st.text(max_size=12) | st.sampled_from(["def f(x):", "", "🙂🙂", "hello world", "x" * 40, "\ud800", "a \udfff"])


def _strategy(schema: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a JSON schema (the subset pydantic emits), biased to edges; at any depth sometimes junk."""
    if "$ref" in schema:
        return _strategy(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]], depth)
    if "anyOf" in schema:
        return st.one_of([_strategy(s, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | TEXT
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(-3, 12) | EDGE_INTS
    if kind == "number":
        return st.floats(-3, 3) | EDGE_FLOATS | st.integers(-3, 3)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "string":
        return TEXT
    if kind == "array":
        return st.lists(_strategy(schema.get("items", {}), depth + 1), max_size=3 if depth else 4)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: _strategy(v, depth + 1) for k, v in props.items() if k in required},
            optional={k: _strategy(v, depth + 1) for k, v in props.items() if k not in required})
    return JUNK


BASES = {"CompletionRequest": {"prompt": "def f(x):", "max_tokens": 3},
         "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}


def _bodies(name: str) -> st.SearchStrategy:
    """A valid request with one field drawn from its schema (most reach generation), whole bodies drawn from the
    schema, and either with a junk value under any key."""
    props = SCHEMAS[name]["properties"]
    one_field = st.sampled_from(sorted(props)).flatmap(
        lambda key: _strategy(props[key]).map(lambda value: {**BASES[name], key: value}))
    whole = _strategy(SCHEMAS[name])
    mutated = st.tuples(one_field | whole, st.sampled_from(sorted(props)) | st.text(max_size=8), JUNK).map(
        lambda t: {**t[0], t[1]: t[2]})
    return one_field | whole | mutated


def _check_response(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    spec = DOC["paths"][path]["post"]["responses"][str(response.status_code)]
    content_type = response.headers.get("content-type", "").split(";")[0]
    schema = spec["content"][content_type]["schema"]
    if content_type == "text/event-stream":
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-200:]
        for event in events[:-1]:
            json.loads(event)
        return
    jsonschema.validate(response.json(), {"$ref": schema["$ref"], "components": DOC["components"]})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The real gateway app over a real in-process target service, on its own event loop thread."""
    import threading

    from gateway.openai_api import build_app
    from gateway.scheduler import SchedulerConfig
    from gateway.tokenizer import Tokenizer
    from tests.e2e.helpers import tiny_model_with_tokenizer
    from tests.ops.conftest import ops_stack

    tiny_model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("fuzz"), max_position_embeddings=2048,
                                           num_hidden_layers=2)

    loop = asyncio.new_event_loop()
    ready, done = threading.Event(), None
    holder: dict = {}

    async def run():
        nonlocal done
        done = asyncio.Event()
        async with ops_stack(tiny_model, scheduler_config=SchedulerConfig(request_timeout_s=30)) as st_:
            holder["app"] = build_app(st_.scheduler, Tokenizer(str(tiny_model)), "tiny", max_model_len=2048,
                                      default_max_tokens=4, max_body_bytes=1 << 16)
            ready.set()
            await done.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    assert ready.wait(120), "the stack did not start"

    def post(path: str, content: bytes) -> httpx.Response:
        async def call():
            transport = httpx.ASGITransport(app=holder["app"], raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
                return await client.post(path, content=content, headers={"content-type": "application/json"})

        return asyncio.run_coroutine_threadsafe(call(), loop).result(120)

    holder["post"] = post
    holder["stats"] = {"tried": 0, "5xx": 0}
    yield holder
    loop.call_soon_threadsafe(done.set)
    thread.join(60)


def test_openapi_json_is_served_and_documents_the_request_models(tokenizer):
    from gateway.openai_api import build_app
    from tests.gateway.conftest import MODEL_NAME, FakeBackend

    app = build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, max_model_len=256, api_key="k")

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/openapi.json")  # open, like /health

    response = asyncio.run(get())
    assert response.status_code == 200 and response.json() == json.loads(json.dumps(DOC))
    props = SCHEMAS["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "seed", "top_k", "stop_token_ids", "logit_bias"} <= set(props)
    assert SCHEMAS["ChatCompletionRequest"]["required"] == ["messages"]


@pytest.mark.parametrize("path,model", [("/v1/completions", "CompletionRequest"),
                                        ("/v1/chat/completions", "ChatCompletionRequest")])
def test_fuzz_no_5xx_and_responses_match_the_schema(stack, path, model):
    stats = {"tried": 0, "5xx": 0, "2xx": 0}

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=_bodies(model))
    def one(body):
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 4:
            body["n"] = 4  # keeps the fuzz in seconds; n's bounds are checked by the schema anyway
        response = stack["post"](path, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"))
        stats["tried"] += 1
        stats["5xx"] += response.status_code >= 500
        stats["2xx"] += response.status_code == 200
        _check_response(path, response)

    one()
    print(f"fuzz {path}: requests tried {stats['tried']}, 2xx {stats['2xx']}, 5xx {stats['5xx']}")
    assert stats["2xx"] > 0  # the strategy reaches generation, not only validation errors
