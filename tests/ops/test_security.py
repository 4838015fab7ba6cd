"""Security and limits: API keys on the REST and gRPC fronts (probes stay open), TLS and mTLS between the gateway and
a real target service with a throwaway CA, prompt-length and body limits, and queue overflow through the real REST
front (429 with OpenAI's body, then recovery).
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.steps import PrefillInput
from gateway.clients import PodUnavailable, StopRule, TargetClient
from gateway.grpc_api import GatewayServicer, serve_gateway_grpc
from gateway.openai_api import build_app
from gateway.scheduler import SchedulerConfig
from gateway.types import request_sampling
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from protos.wire import channel_credentials, server_credentials
from tests.gateway.conftest import MODEL_NAME, FakeBackend, ServerThread, build_tiny_tokenizer
from tests.ops.conftest import ops_stack

KEY = "sk-tandem-test"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from gateway.tokenizer import Tokenizer

    return Tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def keyed_server(tokenizer):
    backend = FakeBackend(tokenizer)
    app = build_app(backend, tokenizer, MODEL_NAME, max_model_len=256, api_key=KEY, max_body_bytes=4096)
    server = ServerThread(app)
    server.thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    yield server
    server.stop()


# ------------------------------------------------------------------------------------------------ API key
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": f"Basic {KEY}"}])
def test_rest_without_the_key_gets_401_with_an_openai_body(keyed_server, headers):
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, keyed_server.base_url + path, headers=headers,
                          json={"model": MODEL_NAME, "prompt": "hi", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"


def test_rest_with_the_key_works_and_probes_stay_open(keyed_server):
    assert httpx.get(keyed_server.base_url + "/health").status_code == 200
    assert httpx.get(keyed_server.base_url + "/metrics").status_code in (200, 404)  # open (the fake has no metrics)
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0,
                           _strict_response_validation=True)
    resp = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5)
    assert resp.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_rest_body_limit_is_413(keyed_server):
    r = httpx.post(keyed_server.base_url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL_NAME, "prompt": "x" * 10_000})
    assert r.status_code == 413 and r.json()["error"]["message"]


async def test_grpc_generate_needs_the_key_and_health_stays_open(tokenizer):
    server = await serve_gateway_grpc(GatewayServicer(FakeBackend(tokenizer), tokenizer), "127.0.0.1", 0,
                                      api_key=KEY)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            stub = pb_grpc.GatewayStub(channel)
            request = pb.GenerateRequest(text="hello world", max_new_tokens=4, ignore_eos=True)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request, metadata=metadata, timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Info(pb.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            responses = [r async for r in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),),
                                                        timeout=10)]
            assert sum(len(r.token_ids) for r in responses) == 4
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=None)


# ------------------------------------------------------------------------------------------------ TLS / mTLS
async def _tls_target(tiny_model, creds):
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    runner = ModelRunner(str(tiny_model), EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048))
    return await serve_target(TargetEngine(runner), str(tiny_model), "127.0.0.1", 0, credentials=creds)


def _prefill_item(seq_id: str) -> PrefillInput:
    return PrefillInput(seq_id, [5, 6, 7], True, request_sampling(temperature=0.0), StopRule(4, [], True, 3))


async def test_gateway_reaches_a_target_over_mtls_and_others_are_refused(tiny_model, certs):
    server, port = await _tls_target(tiny_model, server_credentials(str(certs.server_cert), str(certs.server_key),
                                                                     str(certs.ca)))
    address = f"127.0.0.1:{port}"
    good = TargetClient(address, credentials=channel_credentials(str(certs.ca), str(certs.client_cert),
                                                                 str(certs.client_key)))
    no_client_cert = TargetClient(address, timeout_s=5, credentials=channel_credentials(str(certs.ca)))
    wrong_ca = TargetClient(address, timeout_s=5, credentials=channel_credentials(
        str(certs.other_ca), str(certs.client_cert), str(certs.client_key)))
    plaintext = TargetClient(address, timeout_s=5)
    try:
        info = await good.info()
        assert info.vocab_size == 2048
        [result] = await good.prefill([_prefill_item("tls-0")])
        assert result.status == pb.SEQ_STATUS_OK and len(result.token_ids) == 1
        assert await good.release(["tls-0"]) == 1
        for client in (no_client_cert, wrong_ca, plaintext):
            with pytest.raises(PodUnavailable):
                await client.info(timeout_s=5)
    finally:
        for client in (good, no_client_cert, wrong_ca, plaintext):
            await client.close()
        await server.stop(grace=None)


async def test_server_only_tls_accepts_any_client_that_trusts_the_ca(tiny_model, certs):
    server, port = await _tls_target(tiny_model, server_credentials(str(certs.server_cert), str(certs.server_key)))
    client = TargetClient(f"127.0.0.1:{port}", credentials=channel_credentials(str(certs.ca)))
    try:
        assert (await client.info()).max_context_len > 0
    finally:
        await client.close()
        await server.stop(grace=None)


# ------------------------------------------------------------------------------------------------ limits
async def test_queue_overflow_gets_429_with_an_openai_body_then_recovers(tiny_model):
    config = SchedulerConfig(max_running_requests=1, max_queued_requests=1, request_timeout_s=60)
    async with ops_stack(tiny_model, scheduler_config=config, serve_http=True) as stack:
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}

        async def one(client: httpx.AsyncClient):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, (await r.aread()), r.headers
                text = "".join([line async for line in r.aiter_lines()])
                return 200, text, r.headers

        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            results = await asyncio.gather(*(one(client) for _ in range(12)))
            statuses = sorted(status for status, _, _ in results)
            assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
            for status, payload, headers in results:
                if status == 429:
                    error = json.loads(payload)["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["type"] == "rate_limit_error"
                else:
                    assert "[DONE]" in payload and '"error"' not in payload
            # recovered: the queue drained, a new request is served
            status, payload, _ = await one(client)
            assert status == 200 and "[DONE]" in payload
            metrics = (await client.get("/metrics")).text
        assert f'tandem:request_rejected_total{{error_type="rate_limit_error"}} {float(statuses.count(429))}' \
            in metrics
        assert f'tandem:http_requests_total{{path="/v1/completions",status="429"}} {float(statuses.count(429))}' \
            in metrics


async def test_max_prompt_tokens_rejects_long_prompts_on_rest(tiny_model):
    config = SchedulerConfig(request_timeout_s=60, max_prompt_tokens=8)
    async with ops_stack(tiny_model, scheduler_config=config, serve_http=True) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            long = await client.post("/v1/completions", json={"prompt": list(range(1, 20)), "max_tokens": 2})
            short = await client.post("/v1/completions", json={"prompt": list(range(1, 5)), "max_tokens": 2})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert "--max-prompt-tokens" in long.json()["error"]["message"]
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] <= 2
