"""Issue 15 §2/§7: the model services refuse every RPC but health checks without the service credential (one
`authorization: Bearer` entry, constant-time compared); the gateway sends it. Sequences belong to the gateway that
prefilled them: another caller's steps and Release are refused; sequences unused past the idle TTL are freed."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.steps import DraftPrefillInput, PrefillInput, VerifyInput
from core.types import DraftTree
from gateway.clients import STATUS_INVALID, STATUS_OK, DraftClient, StopRule, TargetClient
from gateway.types import request_sampling
from protos.leases import SeqLeases
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc

KEY = "service-key-for-tests"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("auth"), vocab_size=256, num_hidden_layers=2)


async def _servers(model, key=KEY):
    from draft_service.ngram import NgramConfig
    from draft_service.ngram_draft import NgramDraft
    from draft_service.server import serve_draft
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    runner = ModelRunner(str(model), EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048))
    target, tport = await serve_target(TargetEngine(runner), str(model), "127.0.0.1", 0, service_api_key=key)
    draft, dport = await serve_draft(NgramDraft(NgramConfig(num_draft_tokens=4)), "", "127.0.0.1", 0,
                                     service_api_key=key)
    return (target, tport), (draft, dport)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),),
                                      (("authorization", f"Bearer {KEY}"), ("authorization", "Bearer x")),
                                      (("authorization", "Bearer x"), ("authorization", f"Bearer {KEY}"))],
                         ids=["none", "wrong", "no-scheme", "two-first-right", "two-last-right"])
async def test_services_refuse_calls_without_the_service_credential(model, metadata):
    (target, tport), (draft, dport) = await _servers(model)
    try:
        for port, stub_cls, prefill in ((tport, pb_grpc.TargetServiceStub, pb.TargetPrefillRequest()),
                                        (dport, pb_grpc.DraftServiceStub, pb.DraftPrefillRequest())):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub, profiler = stub_cls(channel), pb_grpc.ProfilerStub(channel)
                for call in (stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata),
                             stub.Prefill(prefill, timeout=10, metadata=metadata),
                             stub.Release(pb.ReleaseRequest(seq_ids=["x"]), timeout=10, metadata=metadata),
                             profiler.StartProfile(pb.StartProfileRequest(), timeout=10, metadata=metadata),
                             profiler.StopProfile(pb.StopProfileRequest(), timeout=10, metadata=metadata)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stream = (stub.VerifyStream if port == tport else stub.ProposeStream)(metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
                ok = await stub.Info(pb.InfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {KEY}"),))
                assert ok.protocol == "tandem.v1"
    finally:
        await target.stop(grace=None)
        await draft.stop(grace=None)


async def test_gateway_clients_carry_the_credential_and_sequences_have_an_owner(model):
    (target, tport), (draft, dport) = await _servers(model)
    mine = TargetClient(f"127.0.0.1:{tport}", service_api_key=KEY, owner="gw-a")
    other = TargetClient(f"127.0.0.1:{tport}", service_api_key=KEY, owner="gw-b")
    keyless = TargetClient(f"127.0.0.1:{tport}", owner="gw-a")
    my_draft = DraftClient(f"127.0.0.1:{dport}", service_api_key=KEY, owner="gw-a")
    other_draft = DraftClient(f"127.0.0.1:{dport}", service_api_key=KEY, owner="gw-b")
    sampling, stop = request_sampling(temperature=0.0), StopRule(16, [], True, 3)
    try:
        from gateway.clients import PodUnavailable

        with pytest.raises(PodUnavailable, match="UNAUTHENTICATED"):
            await keyless.info()
        [first] = await mine.prefill([PrefillInput("s", [1, 2, 3], True, sampling, stop)])
        assert first.status == STATUS_OK
        # Another gateway can neither free nor step nor re-prefill the sequence.
        assert await other.release(["s"]) == 0
        step = VerifyInput("s", 4, first.token_ids[-1], DraftTree([], []), sampling, stop)
        assert (await other.verify([step]))[0].status == STATUS_INVALID
        [again] = await other.prefill([PrefillInput("s", [9, 9], True, sampling, stop)])
        assert again.status == STATUS_INVALID and "another gateway" in again.error
        assert target.servicer.engine.num_seqs == 1
        assert (await mine.verify([step]))[0].status == STATUS_OK
        assert await mine.release(["s"]) == 1 and target.servicer.engine.num_seqs == 0

        assert await my_draft.prefill([DraftPrefillInput("d", [5, 6, 7, 5, 6])]) == [STATUS_OK]
        assert await other_draft.release(["d"]) == 0 and draft.servicer.proposer.num_seqs == 1
        assert await my_draft.release(["d"]) == 1
    finally:
        for c in (mine, other, keyless, my_draft, other_draft):
            await c.close()
        await target.stop(grace=None)
        await draft.stop(grace=None)


async def test_abandoned_sequences_are_freed_after_the_idle_ttl(model):
    (target, tport), (draft, dport) = await _servers(model)
    now = [0.0]
    for server in (target, draft):
        server.servicer.leases = SeqLeases(30.0, clock=lambda: now[0])
    client = TargetClient(f"127.0.0.1:{tport}", service_api_key=KEY, owner="gone")
    dclient = DraftClient(f"127.0.0.1:{dport}", service_api_key=KEY, owner="gone")
    sampling, stop = request_sampling(temperature=0.0), StopRule(16, [], True, 3)
    try:
        await client.prefill([PrefillInput(f"s{i}", [1, 2, 3], True, sampling, stop) for i in range(3)])
        await dclient.prefill([DraftPrefillInput("d", [5, 6, 7])])
        now[0] = 20.0
        [kept] = await client.prefill([PrefillInput("fresh", [4, 5], True, sampling, stop)])
        now[0] = 40.0  # s0..s2 and d unused for 40 s > 30 s; "fresh" for 20 s
        assert await target.servicer.free_idle() == 3 and await draft.servicer.free_idle() == 1
        assert target.servicer.engine.num_seqs == 1 and draft.servicer.proposer.num_seqs == 0
        assert target.servicer.engine.runner.num_free_tokens() < target.servicer.engine.runner.num_total_tokens()
        assert await client.release(["fresh"]) == 1
    finally:
        await client.close()
        await dclient.close()
        await target.stop(grace=None)
        await draft.stop(grace=None)


def test_the_service_key_stays_off_the_command_lines_of_tandem_serve():
    from tandem.cli import build_parser
    from tandem.launch import commands

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "NGRAM", "--service-api-key", "k-secret"])
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 0, 1, 8
    assert not any("k-secret" in " ".join(cmd) for cmd in commands(args).values())  # it travels in the environment


def test_a_service_on_a_public_address_needs_a_credential():
    import argparse

    from tandem.services import _check_service_auth

    base = dict(service_api_key=None, tls_ca=None, allow_unauthenticated=False)
    with pytest.raises(SystemExit, match="--service-api-key"):
        _check_service_auth(argparse.Namespace(service_host="0.0.0.0", **base))
    _check_service_auth(argparse.Namespace(service_host="127.0.0.1", **base))
    _check_service_auth(argparse.Namespace(service_host="0.0.0.0", **{**base, "service_api_key": "k"}))
    _check_service_auth(argparse.Namespace(service_host="0.0.0.0", **{**base, "tls_ca": "ca.pem"}))


@pytest.mark.parametrize("service", ["target", "draft"])
def test_model_service_metrics_bind_the_service_host_by_default(service, monkeypatch):
    """Issue 15 §9: /metrics of a model service listens where the service does unless --metrics-host says else."""
    import tandem.observability as observability
    from tandem.cli import build_parser
    from tandem.services import _service_metrics

    bound = []

    class _Server:
        server_port = 1

    monkeypatch.setattr(observability, "start_metrics_server", lambda registry, host, port: bound.append(host) or
                        _Server())
    for flags, host in ((["--service-host", "127.0.0.1"], "127.0.0.1"), (["--service-host", "10.1.2.3"], "10.1.2.3"),
                        (["--metrics-host", "0.0.0.0"], "0.0.0.0")):
        args = build_parser().parse_args([service, "--metrics-port", "9400", *flags])
        _service_metrics(args, service)
        assert bound[-1] == host
