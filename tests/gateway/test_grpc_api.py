"""Public gRPC Gateway on an in-process grpc.aio server (port 0): Generate streaming, Abort, Info, cancellation,
input errors as INVALID_ARGUMENT, backend errors as their status, the health and reflection services."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.errors import ErrorInterceptor
from gateway.grpc_api import GatewayServicer, serve_gateway_grpc
from gateway.types import GenerateParams, Overloaded
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc

INFO = dict(model="tiny-test", speculative_algorithm="STANDALONE", num_steps=3, topk=1, num_draft_tokens=4,
            max_context_len=256, target_addresses=["t:1"], draft_addresses=["d:1"])


@pytest.fixture
async def grpc_server(backend, tokenizer):
    server = await serve_gateway_grpc(GatewayServicer(backend, tokenizer, INFO), "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}")
    yield server, channel
    await channel.close()
    await server.stop(grace=None)


@pytest.fixture
def stub(grpc_server):
    return pb_grpc.GatewayStub(grpc_server[1])


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


async def test_generate_text_streams_tokens_text_and_usage(stub, backend, tokenizer):
    prompt = "hello world hello there"
    responses = [r async for r in stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=12, ignore_eos=True,
                                                                   request_id="req-1"))]
    expected_ids = backend.output_ids(GenerateParams("x", tokenizer.encode(prompt), 12))
    assert [t for r in responses for t in r.token_ids] == expected_ids
    assert "".join(r.text for r in responses) == tokenizer.decode(expected_ids)
    assert len(responses) > 1 and all(r.request_id == "req-1" for r in responses)
    assert [r.finish_reason for r in responses[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.HasField("usage")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(tokenizer.encode(prompt)), 12)
    assert last.usage.mean_accept_length == pytest.approx(12 / (last.usage.verify_steps + 1))
    params = backend.requests[-1]
    assert params.sampling.temperature == 0.0 and params.sampling.top_k == -1 and params.sampling.top_p == 1.0


async def test_generate_token_ids_with_stop_string_and_defaults(stub, backend, tokenizer):
    ids = tokenizer.encode("general kenobi there hello world")
    full = tokenizer.decode(backend.output_ids(GenerateParams("x", ids, 16)))
    stop = full[3:6]
    responses = [r async for r in stub.Generate(pb.GenerateRequest(token_ids=ids, stop=[stop], seed=7, top_k=5))]
    assert backend.requests[-1].max_new_tokens == 16  # 0 on the wire = the server default
    assert backend.requests[-1].sampling.seed == 7 and backend.requests[-1].sampling.top_k == 5
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].matched_stop == stop


async def test_generate_returns_logprobs_per_token_when_asked(stub, backend, tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    responses = [r async for r in stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=6, ignore_eos=True,
                                                                    return_logprobs=True, top_logprobs=2))]
    assert backend.requests[-1].logprobs == 2
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)
        for t, e in zip(r.token_ids, r.logprobs):
            lp, top_ids, top_vals = backend.fake_logprob(t, 2)
            assert e.logprob == pytest.approx(lp) and list(e.top_token_ids) == top_ids
    plain = [r async for r in stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=4))]
    assert all(len(r.logprobs) == 0 for r in plain) and backend.requests[-1].logprobs is None


@pytest.mark.parametrize("request_kwargs", [
    dict(max_new_tokens=4),  # neither text nor token_ids
    dict(text="hi", token_ids=[1, 2]),  # both
    dict(text="hi", temperature=-1.0),
    dict(text="hi", max_new_tokens=10_000),
    dict(text="hi", stop=["x"], skip_detokenize=True),
    dict(text="hi", return_logprobs=True, top_logprobs=21),
    dict(text="hi", presence_penalty=2.5),
    dict(text="hi", repetition_penalty=-1.0),
    # issue 15 §6: refused as REST refuses them, not silently reset
    dict(text="hi", top_p=1.5), dict(text="hi", top_p=-0.2), dict(text="hi", top_k=-7),
    dict(text="hi", stop=[f"s{i}" for i in range(17)]), dict(text="hi", seed=2**63),
])
async def test_bad_input_is_invalid_argument(stub, backend, request_kwargs):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in stub.Generate(pb.GenerateRequest(**request_kwargs))]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
    assert backend.requests == []


async def test_backend_errors_keep_their_status(stub, backend):
    backend.admission_error = Overloaded("queue full")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in stub.Generate(pb.GenerateRequest(text="hi"))]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details() == "queue full"
    backend.admission_error = RuntimeError("boom")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in stub.Generate(pb.GenerateRequest(text="hi"))]
    assert err.value.code() == grpc.StatusCode.INTERNAL


async def test_abort_ends_a_running_generate_with_finish_reason_abort(stub, backend):
    backend.hang_after_chunks = 1
    call = stub.Generate(pb.GenerateRequest(text="hello world", request_id="to-abort", max_new_tokens=50))
    first = await call.read()
    assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).aborted
    rest = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        rest.append(msg)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).aborted  # no longer running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Abort(pb.AbortRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_client_cancel_closes_the_backend_stream(stub, backend):
    backend.hang_after_chunks = 1
    call = stub.Generate(pb.GenerateRequest(text="hello world", request_id="to-cancel", max_new_tokens=50))
    await call.read()
    call.cancel()
    await _until(lambda: backend.closed_early == ["to-cancel"])


async def test_info_reports_the_configuration(stub):
    info = await stub.Info(pb.InfoRequest())
    assert (info.model, info.speculative_algorithm, info.max_context_len) == ("tiny-test", "STANDALONE", 256)
    assert (info.spec.num_steps, info.spec.topk, info.spec.num_draft_tokens) == (3, 1, 4)
    assert list(info.target_addresses) == ["t:1"] and list(info.draft_addresses) == ["d:1"]
    assert info.protocol == "tandem.v1"


async def test_health_and_reflection_services(grpc_server):
    channel = grpc_server[1]
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Gateway"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflect.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in (await call.read()).list_services_response.service}
    await call.done_writing()
    assert {"tandem.v1.Gateway", "grpc.health.v1.Health"} <= names


async def test_error_interceptor_maps_unary_exceptions_for_any_servicer(backend, tokenizer):
    class Broken(GatewayServicer):
        async def Info(self, request, context):
            raise Overloaded("busy")

    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    pb_grpc.add_GatewayServicer_to_server(Broken(backend, tokenizer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.GatewayStub(channel).Info(pb.InfoRequest())
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    finally:
        await server.stop(grace=None)


async def test_generate_passes_penalties_to_the_backend(stub, backend):
    [r async for r in stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2, presence_penalty=0.5,
                                                       frequency_penalty=0.25, repetition_penalty=1.1,
                                                       logit_bias={3: -100.0}))]
    [r async for r in stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=2))]
    set_, unset = backend.requests[-2].sampling, backend.requests[-1].sampling
    assert (set_.presence_penalty, set_.frequency_penalty, round(set_.repetition_penalty, 5)) == (0.5, 0.25, 1.1)
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0.0, 0.0, 1.0)
    assert dict(set_.logit_bias) == {3: -100.0} and unset.logit_bias == ()
