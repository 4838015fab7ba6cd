"""`python -m tandem.healthcheck` against a TLS / mTLS service port (services started with --tls-cert/--tls-key
[--tls-ca]): plaintext probes fail, probes with the CA (and a client certificate for mTLS) see SERVING."""
from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.wire import channel_credentials, server_credentials
from tandem.healthcheck import check


@pytest.fixture(params=["tls", "mtls"])
def tls_health_server(request, certs):
    mtls = request.param == "mtls"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = server_credentials(str(certs.server_cert), str(certs.server_key), str(certs.ca) if mtls else None)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", mtls
    server.stop(grace=None)


def test_tls_probe_needs_the_ca_and_for_mtls_a_client_certificate(tls_health_server, certs):
    address, mtls = tls_health_server
    assert not check(address, timeout_s=2.0)  # plaintext against a TLS port
    assert not check(address, timeout_s=2.0, credentials=channel_credentials(str(certs.other_ca)))  # wrong CA
    ca_only = channel_credentials(str(certs.ca))
    assert check(address, timeout_s=2.0, credentials=ca_only) is (not mtls)
    full = channel_credentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    assert check(address, timeout_s=2.0, credentials=full)


def test_cli_probes_over_tls(tls_health_server, certs):
    address, mtls = tls_health_server
    flags = ["--tls-ca", str(certs.ca)] + (["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
                                           if mtls else [])
    run = lambda extra: subprocess.run([sys.executable, "-m", "tandem.healthcheck", "--address", address,  # noqa: E731
                                        "--timeout", "2", *extra], capture_output=True, timeout=60)
    assert run(flags).returncode == 0
    assert run([]).returncode == 1
    bad = run(["--tls-cert", str(certs.client_cert)])
    assert bad.returncode == 2 and b"go together" in bad.stderr
