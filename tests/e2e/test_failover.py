"""Failover on real processes (DESIGN.md §2): the gateway holds the committed tokens, so losing a pod mid-stream loses
nothing. Two target processes, one draft process and a gateway, each a separate `tandem <service>` process (the
compose / Kubernetes topology); a pod is SIGKILLed while a greedy stream is running and the stream must finish with
exactly the text it has without failures.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.e2e.helpers import free_port as _free_port
from tests.e2e.helpers import tiny_model_with_tokenizer

pytestmark = pytest.mark.slow
SPEC = ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with the bundled tokenizer (cheap enough that a long stream takes a few seconds)."""
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("failover"), max_position_embeddings=4096,
                                     num_hidden_layers=4)


class Topology:
    def __init__(self, model: Path):
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {name: _free_port() for name in ("target-0", "target-1", "draft-0", "grpc", "http")}
        base = [sys.executable, "-m", "tandem.cli"]
        common = ["--model-path", str(model), "--log-level", "warning"]
        for name in ("target-0", "target-1"):
            self._start(name, [*base, "target", *common, "--service-port", str(self.ports[name])])
        self._start("draft-0", [*base, "draft", *common, *SPEC, "--speculative-draft-model-path", str(model),
                                "--service-port", str(self.ports["draft-0"])])
        targets = ",".join(f"127.0.0.1:{self.ports[n]}" for n in ("target-0", "target-1"))
        self._start("gateway", [*base, "gateway", *common, *SPEC, "--target-address", targets,
                                "--draft-address", f"127.0.0.1:{self.ports['draft-0']}",
                                "--port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"])])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.ports['grpc']}")
        deadline = time.monotonic() + 240
        while True:  # ready, or fail at once with the name of a process that died while starting
            dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
            if dead:
                self.close()
                raise RuntimeError(f"processes exited while starting: {dead}")
            try:
                pb_grpc.GatewayStub(self.channel).Info(pb.InfoRequest(), timeout=2, wait_for_ready=True)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    self.close()
                    raise

    def _start(self, name: str, cmd: list[str]) -> None:
        self.procs[name] = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=10)

    def target_holding_sequences(self) -> str:
        for name in ("target-0", "target-1"):
            if self.procs[name].poll() is None:
                with grpc.insecure_channel(f"127.0.0.1:{self.ports[name]}") as ch:
                    if pb_grpc.TargetServiceStub(ch).Info(pb.InfoRequest(), timeout=10).memory.num_seqs > 0:
                        return name
        raise AssertionError("no target holds the running sequence")

    def stream(self, prompt: str, max_new_tokens: int, on_chunk=None) -> tuple[list[int], pb.GenerateResponse]:
        stub = pb_grpc.GatewayStub(self.channel)
        request = pb.GenerateRequest(text=prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        tokens, last = [], None
        for i, response in enumerate(stub.Generate(request, timeout=240)):
            tokens.extend(response.token_ids)
            last = response
            if on_chunk is not None:
                on_chunk(i)
        return tokens, last

    def close(self) -> None:
        self.channel.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def topology(model_dir):
    t = Topology(model_dir)
    try:
        yield t
    finally:
        t.close()


PROMPT = "def parse(path):\n    with open(path) as f:\n"


def test_killing_a_target_mid_stream_resumes_on_the_other_with_the_same_greedy_text(topology):
    expected, _ = topology.stream(PROMPT, 300)
    killed = []

    def kill_holder(i: int) -> None:
        if i == 3 and not killed:
            victim = topology.target_holding_sequences()
            topology.kill(victim)
            killed.append(victim)

    got, last = topology.stream(PROMPT, 300, kill_holder)
    assert killed, "the stream ended before a target could be killed"
    assert got == expected
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 300


def test_killing_the_draft_mid_stream_finishes_target_only_with_the_same_greedy_text(topology):
    expected, first = topology.stream(PROMPT, 300)
    assert first.usage.accepted_draft_tokens > 0
    got, last = topology.stream(PROMPT, 300, lambda i: topology.kill("draft-0") if i == 3 else None)
    assert topology.procs["draft-0"].poll() is not None
    assert got == expected
    assert last.usage.completion_tokens == 300
    # The stream went on without the draft: fewer drafts were proposed than in the undisturbed run.
    assert last.usage.proposed_draft_tokens < first.usage.proposed_draft_tokens
