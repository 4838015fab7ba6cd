"""Issue 15 regressions on real processes, through `tandem serve` with two target replicas and a STANDALONE draft:
the model services refuse unauthenticated calls on their ports; a poisoned batch loses no valid request; slowloris
connections are dropped; killing a target replica mid-stream loses nothing and the launcher restarts it; with every
target down /health is 503, and requests sent meanwhile finish once the launcher has restarted them.
Each test prints its numbers (requests tried, 5xx seen, requests lost)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.e2e.helpers import free_port, tiny_model_with_tokenizer
from tests.hardening.test_poisoned_batch import POISON

pytestmark = pytest.mark.slow
SERVICE_KEY = "e2e-hardening-key"
HEADER_TIMEOUT_S = 1.0


def _two_free_ports() -> int:
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


class Serve:
    def __init__(self, model: Path):
        self.http, self.grpc, self.draft = free_port(), free_port(), free_port()
        self.target = _two_free_ports()
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(model),
               "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
               "--num-target-replicas", "2", "--port", str(self.http), "--grpc-port", str(self.grpc),
               "--target-port", str(self.target), "--draft-port", str(self.draft), "--log-level", "warning",
               "--http-header-timeout", str(HEADER_TIMEOUT_S), "--pod-probe-interval", "0.5",
               "--routing-policy", "consistent_hash", "--no-colocate-draft"]  # a draft process of its own
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                   TANDEM_SERVICE_API_KEY=SERVICE_KEY))
        self.base_url = f"http://127.0.0.1:{self.http}"

    def health(self) -> int:
        try:
            return httpx.get(self.base_url + "/health", timeout=2.0).status_code
        except httpx.HTTPError:
            return 0

    def wait_health(self, status: int, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != status:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"/health never answered {status}"
            time.sleep(0.2)

    def target_pid(self, index: int) -> int:
        port = str(self.target + index).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tandem.cli" in argv and b"target" in argv and port in argv:
                return int(entry.name)
        raise AssertionError(f"no target-{index} process")

    def wait_serving(self, port: int, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            assert time.monotonic() < deadline, f"port {port} never served again"
            time.sleep(0.3)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("hardening-e2e"), max_position_embeddings=2048,
                                      num_hidden_layers=2)
    s = Serve(model)
    try:
        s.wait_health(200)
        s.wait_serving(s.target + 1)
        yield s
    finally:
        assert s.stop() == 0


async def _complete(client: httpx.AsyncClient, prompt: str, num_tokens: int, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return await client.post("/v1/completions", json=body)


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, on_chunk) -> tuple[int, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, ""
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, ""
                text.append(event["choices"][0]["text"])
                on_chunk()
    return 200, "".join(text)


def test_model_service_ports_refuse_unauthenticated_calls(serve):
    tried = 0
    for port, stub_cls in ((serve.target, pb_grpc.TargetServiceStub), (serve.target + 1, pb_grpc.TargetServiceStub),
                           (serve.draft, pb_grpc.DraftServiceStub)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for metadata in ((), (("authorization", "Bearer guess"),)):
                tried += 1
                with pytest.raises(grpc.RpcError) as info:
                    stub_cls(ch).Release(pb.ReleaseRequest(seq_ids=["anything"]), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    print(f"unauthenticated calls: tried {tried}, refused {tried}")


def test_poisoned_batches_lose_no_valid_request(serve):
    async def run():
        tried = five_xx = lost = 0
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=120) as client:
            for poison in POISON:
                responses = await asyncio.gather(_complete(client, "def f(x):", 8, **poison),
                                                 *(_complete(client, f"def g{i}(y):", 8) for i in range(8)))
                tried += len(responses)
                five_xx += sum(r.status_code >= 500 for r in responses)
                lost += sum(r.status_code != 200 for r in responses[1:])
                assert responses[0].status_code == (200 if poison == {"seed": -1} else 400), (poison, responses[0].text)
        return tried, five_xx, lost

    tried, five_xx, lost = asyncio.run(run())
    print(f"poisoned batches (e2e): requests tried {tried}, 5xx {five_xx}, valid requests lost {lost}")
    assert (five_xx, lost) == (0, 0)


def test_slowloris_connections_are_dropped(serve):
    async def run():
        conns = []
        for i in range(250):
            reader, writer = await asyncio.open_connection("127.0.0.1", serve.http)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le" if i % 2 else b"G")
            conns.append((reader, writer))

        async def closed(reader) -> bool:
            try:
                async with asyncio.timeout(HEADER_TIMEOUT_S + 20):
                    while await reader.read(4096):
                        pass
                return True
            except (TimeoutError, ConnectionResetError):
                return False

        result = await asyncio.gather(*(closed(r) for r, _ in conns))
        for _, writer in conns:
            writer.close()
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=60) as client:
            ok = await _complete(client, "def f(x):", 4)
        return len(result) - sum(result), ok.status_code

    held, status = asyncio.run(run())
    print(f"slowloris (e2e): 250 half-open connections, {held} held after the header timeout")
    assert held == 0 and status == 200


def test_a_killed_target_replica_loses_nothing_and_is_restarted(serve):
    prompts = [f"def task_{i}(a, b):" for i in range(8)]

    async def run():
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=240) as client:
            want = await asyncio.gather(*(_stream(client, p, 120, lambda: None) for p in prompts))
            assert all(status == 200 for status, _ in want)
            chunks = [0]
            streams = [asyncio.create_task(_stream(client, p, 120, lambda: chunks.__setitem__(0, chunks[0] + 1)))
                       for p in prompts]
            while chunks[0] < len(prompts):
                await asyncio.sleep(0.01)
            old_pid = serve.target_pid(0)
            os.kill(old_pid, signal.SIGKILL)
            got = await asyncio.gather(*streams)
            return want, got, old_pid

    want, got, old_pid = asyncio.run(run())
    lost = sum(g != w for g, w in zip(got, want))
    five_xx = sum(status >= 500 for status, _ in got)
    print(f"target replica killed mid-stream: requests tried {len(got)}, 5xx {five_xx}, lost or changed {lost}")
    assert (five_xx, lost) == (0, 0)
    serve.wait_serving(serve.target)  # the launcher restarted it on its port
    assert serve.target_pid(0) != old_pid and serve.proc.poll() is None
    serve.wait_health(200)


def test_with_no_target_health_is_503_and_waiting_requests_finish_after_restart(serve):
    async def run():
        async with httpx.AsyncClient(base_url=serve.base_url, timeout=240) as client:
            for index in (0, 1):
                os.kill(serve.target_pid(index), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (await client.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, "/health stayed 200 with every target dead"
                await asyncio.sleep(0.1)
            body = (await client.get("/health")).json()
            assert body["error"]["type"] == "service_unavailable"
            waiting = await asyncio.gather(*(_complete(client, f"def w{i}():", 8) for i in range(4)))
            return waiting

    waiting = asyncio.run(run())
    statuses = [r.status_code for r in waiting]
    print(f"no target (both killed): requests sent meanwhile {len(waiting)}, 5xx {sum(s >= 500 for s in statuses)}, "
          f"lost {sum(s != 200 for s in statuses)}")
    assert statuses == [200] * 4
    serve.wait_health(200)
