"""Issue 15 §4: the gateway probes every pod (grpc.health.v1) and a pod that fails its probe stays down until one
succeeds; /health answers 503 and gRPC health NOT_SERVING while no target pod is up, and pod_up shows a dead draft
as down for as long as it is dead (not just for the retry window after a failed call)."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.grpc_api import GatewayServicer, follow_health, serve_gateway_grpc
from gateway.openai_api import build_app
from tests.ops.conftest import parse_metrics
from tests.stack import generate_ids, local_stack


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("health"), vocab_size=256, num_hidden_layers=2)


async def _until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.05)


async def test_health_follows_the_targets_and_pod_up_follows_the_probes(model):
    async with local_stack(model, algorithm="NGRAM", num_draft_tokens=4) as scheduler:
        assert scheduler.config.pod_probe_interval_s > 0 and scheduler.config.pod_retry_s == 5.0
        app = build_app(scheduler, None, "tiny", max_model_len=256)
        grpc_server = await serve_gateway_grpc(GatewayServicer(scheduler, None), "127.0.0.1", 0)
        follower = asyncio.create_task(follow_health(grpc_server, scheduler.health, 0.05))
        import grpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.bound_port}")
        health = health_pb2_grpc.HealthStub(channel)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                async def rest_status() -> int:
                    return (await http.get("/health")).status_code

                async def grpc_status() -> int:
                    return (await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Gateway"))).status

                def pod_up() -> dict[str, float]:
                    got = parse_metrics(scheduler.metrics.render().decode())
                    return {re.search(r'kind="(\w+)"', k).group(1): v for k, v in got.items()
                            if k.startswith("tandem:pod_up")}

                assert await rest_status() == 200 and await grpc_status() == health_pb2.HealthCheckResponse.SERVING
                out, _, _ = await generate_ids(scheduler, [1, 2, 3, 1, 2], 4)
                assert len(out) == 4
                target_server, draft_server = scheduler.test_servers
                await draft_server.stop(grace=None)

                async def draft_down() -> bool:
                    return pod_up()["draft"] == 0.0

                await _until(draft_down)
                await asyncio.sleep(6.0)  # past the 5 s window a failed call's mark would last
                assert pod_up() == {"target": 1.0, "draft": 0.0} and await rest_status() == 200
                out, _, _ = await generate_ids(scheduler, [1, 2, 3, 1, 2], 4, request_id="target-only")
                assert len(out) == 4  # no draft: target-only steps

                await target_server.stop(grace=None)

                async def unhealthy() -> bool:
                    return (await rest_status() == 503
                            and await grpc_status() == health_pb2.HealthCheckResponse.NOT_SERVING)

                await _until(unhealthy)
                body = (await http.get("/health")).json()
                assert body["error"]["type"] == "service_unavailable"
        finally:
            follower.cancel()
            await channel.close()
            await grpc_server.stop(grace=None)


async def test_requests_wait_for_a_target_that_comes_back(model):
    """All target pods gone (restarting): running and new requests wait (bounded) with their committed tokens and
    finish, token for token as without the outage, once a target answers again on the same address."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    async with local_stack(model) as scheduler:
        want, _, _ = await generate_ids(scheduler, [5, 6, 7], 40, request_id="reference")
        target_server = scheduler.test_servers[0]
        port = int(scheduler.targets.clients[0].address.rsplit(":", 1)[1])
        first = asyncio.create_task(generate_ids(scheduler, [5, 6, 7], 40, request_id="running"))
        while not scheduler._running:
            await asyncio.sleep(0.01)
        await target_server.stop(grace=None)
        second = asyncio.create_task(generate_ids(scheduler, [5, 6, 7], 40, request_id="new"))
        await _until(_async(lambda: not scheduler.health()))
        await asyncio.sleep(1.0)  # both requests are waiting, not failed
        assert not first.done() and not second.done()
        runner = ModelRunner(str(model), EngineConfig(device="cpu", dtype="float32", max_total_tokens=8192))
        server, _ = await serve_target(TargetEngine(runner), str(model), "127.0.0.1", port)
        try:
            results = await asyncio.wait_for(asyncio.gather(first, second), 60)
            assert [r[0] for r in results] == [want, want]
        finally:
            await server.stop(grace=None)


def _async(fn):
    async def call():
        return fn()

    return call
