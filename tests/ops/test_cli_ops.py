"""The operations flags through the CLI: the launcher hands metrics ports, TLS files, limits and the log format to the
right children (and the API key only through the environment); and one real `tandem serve` with mTLS between every
hop, an API key, JSON logs and service metrics ports, driven by the openai client.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tandem.cli import build_parser
from tandem.launch import commands
from tests.ops.conftest import parse_metrics
from tandem.launch import free_port as _free_port


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _args(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    args.speculative_algorithm, args.speculative_num_steps = args.speculative_algorithm or "NONE", 3
    args.speculative_eagle_topk, args.speculative_num_draft_tokens = 1, 4
    return args


def test_launcher_passes_ops_flags_to_the_right_children():
    args = _args("--speculative-algorithm", "STANDALONE", "--num-target-replicas", "2", "--metrics-port", "9400",
                 "--tls-cert", "s.pem", "--tls-key", "s.key", "--tls-ca", "ca.pem", "--service-tls-ca", "ca.pem",
                 "--service-tls-cert", "c.pem", "--service-tls-key", "c.key", "--api-key", "secret",
                 "--max-prompt-tokens", "100", "--log-format", "json")
    cmds = commands(args)
    assert [_flag(cmds[n], "--metrics-port") for n in ("target-0", "target-1", "draft-0")] == ["9400", "9401", "9402"]
    for name in ("target-0", "target-1", "draft-0"):
        assert (_flag(cmds[name], "--tls-cert"), _flag(cmds[name], "--tls-key"), _flag(cmds[name], "--tls-ca")) == (
            "s.pem", "s.key", "ca.pem")
        assert "--service-tls-ca" not in cmds[name]
    gateway = cmds["gateway"]
    assert (_flag(gateway, "--service-tls-ca"), _flag(gateway, "--service-tls-cert"),
            _flag(gateway, "--service-tls-key")) == ("ca.pem", "c.pem", "c.key")
    assert _flag(gateway, "--max-prompt-tokens") == "100" and "--metrics-port" not in gateway
    assert all(_flag(c, "--log-format") == "json" for c in cmds.values())
    assert not any("secret" in part for c in cmds.values() for part in c)  # the key goes through the environment


def test_metrics_off_and_plaintext_by_default():
    cmds = commands(_args("--speculative-algorithm", "STANDALONE"))
    assert not any(f in c for c in cmds.values() for f in ("--metrics-port", "--tls-cert", "--service-tls-ca"))


@pytest.mark.slow
def test_serve_with_mtls_api_key_json_logs_and_metrics(tiny_model, certs, tmp_path):
    http, grpc_port, metrics = _free_port(), _free_port(), _free_port()
    log_file = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(tiny_model),
           "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(tiny_model),
           "--port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
           "--metrics-host", "127.0.0.1", "--log-format", "json", "--log-level", "info",
           "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca),
           "--service-tls-ca", str(certs.ca), "--service-tls-cert", str(certs.client_cert),
           "--service-tls-key", str(certs.client_key),
           "--no-colocate-draft"]  # a draft process of its own: the draft hop over mTLS
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_API_KEY="sk-e2e"))
    base_url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_file.read_text()[-3000:]
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stack did not become healthy"
            time.sleep(0.3)
        assert httpx.get(base_url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-e2e", max_retries=0,
                               _strict_response_validation=True, timeout=60)
        resp = client.completions.create(model=tiny_model.name, prompt="def f(x):", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 12
        assert resp.usage.completion_tokens_details.accepted_prediction_tokens > 0  # the draft hop works over mTLS
        target = parse_metrics(httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text)
        draft = parse_metrics(httpx.get(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=10).text)
        assert target['tandem:rpc_requests_total{code="OK",rpc="Verify",service="target"}'] > 0
        assert draft['tandem:rpc_requests_total{code="OK",rpc="Propose",service="draft"}'] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    lines = [json.loads(line) for line in log_file.read_text().splitlines() if line.startswith("{")]
    finished = [e for e in lines if e["msg"] == "request finished"]
    assert len(finished) == 1 and finished[0]["request_id"].startswith("cmpl-")
    assert finished[0]["completion_tokens"] == 12 and finished[0]["finish_reason"] == "length"
    assert finished[0]["seq_id"] and finished[0]["accept_length"] > 1.0
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in lines)


def test_free_ports_come_from_below_the_ephemeral_range_and_bind():
    """tandem serve's ports for the services it starts (and the tests'): free when picked, and below the range the OS
    takes outgoing connections' local ports from (a port there can be taken before the service binds it)."""
    from tandem.launch import _ephemeral_low

    low = _ephemeral_low()
    ports = [_free_port() for _ in range(20)]
    if low > 12000:
        assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 1  # picked at random, not one fixed port
    first = _free_port(span=3)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # each of the span is free
