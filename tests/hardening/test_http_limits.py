"""Issue 15 §8: the REST front bounds slow clients. A connection whose request headers are incomplete after the
header timeout is closed (slowloris: 250 half-open connections are all dropped and a normal request still works);
a body that does not arrive within the body timeout is a 408; a client that disconnects mid-body is a 499 line in
the log and the metrics, not an ERROR traceback and a 500."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from gateway.http_server import uvicorn_config
from gateway.metrics import GatewayMetrics
from gateway.openai_api import build_app
from tests.gateway.conftest import MODEL_NAME, FakeBackend
from tests.ops.conftest import parse_metrics

HEADER_TIMEOUT_S = 1.0


@pytest.fixture
async def server(tokenizer):
    import uvicorn

    metrics = GatewayMetrics()
    app = build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, max_model_len=256, metrics=metrics,
                    body_timeout_s=1.0)
    http = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S,
                                         log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    task = asyncio.create_task(http.serve())
    deadline = time.monotonic() + 20
    while not (http.started and http.servers):
        assert time.monotonic() < deadline and not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    port = http.servers[0].sockets[0].getsockname()[1]
    yield port, metrics
    http.should_exit = True
    await task


async def _closed_by_server(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(4096):
                pass
        return True
    except TimeoutError:
        return False  # still held
    except OSError:  # reset / broken pipe: the server dropped it
        return True


async def test_slowloris_connections_are_closed_and_service_goes_on(server):
    port, _ = server
    conns = []
    for i in range(250):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")  # half of them: nothing
        except OSError:
            pass  # already dropped by the server (a slow, loaded box)
        conns.append((reader, writer))
    for _ in range(3):  # keep trickling header bytes: that must not extend the deadline
        await asyncio.sleep(0.3)
        for _, writer in conns[1::2]:
            try:
                writer.write(b"X")
            except (BrokenPipeError, ConnectionResetError):
                pass  # on a loaded box the deadline may already have closed it: what the test wants anyway
    # Without the header deadline they are held forever; with it they go after ~1-5 s (60 s: slack for a loaded box;
    # 1 of 250 outlived 21 s once in a full run on 2 busy cores).
    closed = await asyncio.gather(*(_closed_by_server(r, HEADER_TIMEOUT_S + 60) for r, _ in conns))
    held = len(closed) - sum(closed)
    print(f"slowloris: 250 half-open connections, {held} still held after the header timeout")
    assert held == 0
    for _, writer in conns:
        writer.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert response.status_code == 200


async def test_slow_body_is_a_408_and_a_disconnect_mid_body_is_a_499(server, caplog):
    port, metrics = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    await writer.drain()
    async with asyncio.timeout(10):
        status_line = await reader.readline()
    assert b" 408 " in status_line, status_line
    writer.close()

    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"abc")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    await writer.wait_closed()

    async def counted() -> dict[str, float]:
        return {k: v for k, v in parse_metrics(metrics.render().decode()).items()
                if k.startswith("tandem:http_requests_total")}

    deadline = time.monotonic() + 10
    while not any('status="499"' in k for k in await counted()):
        assert time.monotonic() < deadline, await counted()
        await asyncio.sleep(0.05)
    got = await counted()
    assert not any('status="500"' in k for k in got), got
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("499" in r.getMessage() for r in caplog.records)
