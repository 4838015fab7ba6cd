"""Soak on real processes: `tandem serve` (target, STANDALONE draft, gateway) on a tiny random Llama takes two waves
of 128 OpenAI streams (32 concurrent) from bench/serve.py, a quarter of them abandoned mid-stream. Every stream that was
not abandoned finishes with its full length and no error; afterwards every KV slot is back on the target and the
draft (Info: free == total, no sequences) and the metrics agree; the target's RSS does not grow from the first wave
to the second beyond a small tolerance.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from bench.serve import LoadConfig, run_load, summarize
from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.ops.conftest import parse_metrics
from tests.e2e.helpers import free_port as _free_port
from tests.e2e.helpers import tiny_model_with_tokenizer

pytestmark = pytest.mark.slow
SERVICE_KEY = "e2e-service-key"  # the model services' credential (tandem serve would generate one)
SERVICE_AUTH = (("authorization", f"Bearer {SERVICE_KEY}"),)
CONCURRENCY = 32
MAX_TOKENS = 48
RSS_TOLERANCE_BYTES = 48 << 20  # allocator noise; a leak of KV or per-sequence state grows far past it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("soak"), max_position_embeddings=2048,
                                     num_hidden_layers=2)


class ServeStack:
    def __init__(self, model: Path):
        self.ports = {name: _free_port() for name in ("http", "grpc", "target", "draft")}
        self.ports["metrics"] = _free_port(span=2)
        self.ports["draft_metrics"] = self.ports["metrics"] + 1  # the launcher counts up: targets, then drafts
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model-path", str(model),
               "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
               "--port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
               "--target-port", str(self.ports["target"]), "--draft-port", str(self.ports["draft"]),
               "--metrics-port", str(self.ports["metrics"]), "--metrics-host", "127.0.0.1",
               "--max-running-requests", "64", "--log-level", "warning",
               "--no-colocate-draft"]  # the three-process topology: a draft process and its metrics port
        env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_SERVICE_API_KEY=SERVICE_KEY)
        self.proc = subprocess.Popen(cmd, env=env)
        self.base_url = f"http://127.0.0.1:{self.ports['http']}"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode}"
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the stack did not become healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=30)

    def memory(self, kind: str) -> pb.MemoryState:
        stub = pb_grpc.TargetServiceStub if kind == "target" else pb_grpc.DraftServiceStub
        with grpc.insecure_channel(f"127.0.0.1:{self.ports[kind]}") as ch:
            return stub(ch).Info(pb.InfoRequest(), timeout=10, metadata=SERVICE_AUTH).memory

    def wait_all_kv_free(self, timeout_s: float = 30.0) -> dict[str, pb.MemoryState]:
        deadline = time.monotonic() + timeout_s
        while True:
            mem = {kind: self.memory(kind) for kind in ("target", "draft")}
            if all(m.free_kv_tokens == m.total_kv_tokens and m.num_seqs == 0 for m in mem.values()):
                return mem
            assert time.monotonic() < deadline, f"KV not returned: {mem}"
            time.sleep(0.2)

    def child_rss(self, service: str) -> int:
        """RSS in bytes of the `tandem.cli <service>` child of the launcher."""
        for pid in _children(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"tandem.cli" in cmdline and service.encode() in cmdline:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        raise AssertionError(f"no {service} child of pid {self.proc.pid}")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry.name))
    return out


@pytest.fixture(scope="module")
def stack(model_dir):
    s = ServeStack(model_dir)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _wave(stack: ServeStack) -> dict:
    cfg = LoadConfig(stack.base_url, concurrency=CONCURRENCY, num_requests=4 * CONCURRENCY, max_tokens=MAX_TOKENS,
                     cancel_ratio=0.25, cancel_after_chunks=2, timeout_s=120)
    records, wall_s = asyncio.run(run_load(cfg))
    summary = summarize(records, wall_s, cfg)
    print(f"soak wave: {summary}")
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["cancelled"] == CONCURRENCY  # a quarter of 4 * CONCURRENCY
    for rec in records:
        if not rec.cancelled:
            assert rec.finish_reason == "length" and rec.completion_tokens == MAX_TOKENS, rec
    return summary


def test_soak_two_waves_without_errors_leaks_or_growth(stack):
    first = _wave(stack)
    stack.wait_all_kv_free()
    rss_after_first = stack.child_rss("target")

    second = _wave(stack)
    mem = stack.wait_all_kv_free()
    rss_after_second = stack.child_rss("target")
    print(f"target RSS after wave 1: {rss_after_first >> 20} MiB, after wave 2: {rss_after_second >> 20} MiB")
    assert rss_after_second - rss_after_first < RSS_TOLERANCE_BYTES, (rss_after_first, rss_after_second)
    assert mem["target"].total_kv_tokens > 0 and mem["draft"].total_kv_tokens > 0

    gateway = parse_metrics(httpx.get(stack.base_url + "/metrics", timeout=10).text)
    completed = first["completed"] + second["completed"]
    cancelled = first["cancelled"] + second["cancelled"]
    length = gateway['tandem:request_success_total{finished_reason="length"}']
    aborted = gateway['tandem:request_success_total{finished_reason="abort"}']
    # A slow client may abandon a stream the server had already finished writing: that one counts as "length".
    assert length + aborted == completed + cancelled and length >= completed and 0 < aborted <= cancelled
    assert not any(k.startswith("tandem:request_failure_total") for k in gateway)
    assert gateway["tandem:num_requests_running"] == 0 and gateway["tandem:num_requests_waiting"] == 0
    assert gateway["tandem:spec_decode_num_accepted_tokens_total"] > 0  # the draft is the target itself
    for kind in ("metrics", "draft_metrics"):
        service = parse_metrics(httpx.get(f"http://127.0.0.1:{stack.ports[kind]}/metrics", timeout=10).text)
        name = "target" if kind == "metrics" else "draft"
        assert service[f'tandem:kv_cache_usage_perc{{service="{name}"}}'] == 0
        assert service[f'tandem:num_running_seqs{{service="{name}"}}'] == 0
