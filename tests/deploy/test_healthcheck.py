"""`python -m tandem.healthcheck`: SERVING / NOT_SERVING / nothing listening, and DNS replica discovery."""
from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.healthcheck import check, resolve, serving_pods
from tests.deploy.conftest import free_port


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("tandem.v1.Gateway", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_check_reports_serving_per_service(health_server):
    assert check(health_server)
    assert not check(health_server, "tandem.v1.Gateway")
    assert not check(health_server, "no.such.Service")
    assert not check(f"127.0.0.1:{free_port()}", timeout_s=1.0)


def test_cli_exit_code_follows_health(health_server):
    ok = subprocess.run([sys.executable, "-m", "tandem.healthcheck", "--address", health_server], timeout=30)
    bad = subprocess.run([sys.executable, "-m", "tandem.healthcheck", "--address", health_server,
                          "--service", "tandem.v1.Gateway"], capture_output=True, timeout=30)
    assert (ok.returncode, bad.returncode) == (0, 1)


def test_resolve_lists_serving_replicas_behind_a_name(health_server):
    port = health_server.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in resolve(f"localhost:{port}")
    assert serving_pods(f"127.0.0.1:{port}", "", wait_s=0, min_pods=1, timeout_s=1.0) == [health_server]
    out = subprocess.run([sys.executable, "-m", "tandem.healthcheck", "--resolve", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == health_server
    assert resolve("no-such-host.invalid:1") == []
