"""`tandem target --tp-size 2` as a real process (rank 0 serving gRPC, rank 1 spawned by it, gloo on CPU) behind an
in-process gateway scheduler and STANDALONE draft server: greedy output equals HF `generate` token for token, KV is
freed on release, and SIGTERM stops both ranks.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gateway.clients import DraftClient, PodUnavailable, TargetClient
from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
from target_service.tp import free_port
from tests.stack import generate_ids, perturbed_copy
from tests.test_lossless_greedy import hf_greedy, prompts
from tests.tiny_models import load_hf_model, make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-serve")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.03)


async def _wait_ready(client: TargetClient, proc: subprocess.Popen, deadline_s: float = 90.0):
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, f"tandem target exited with {proc.returncode}"
        try:
            return await client.info(timeout_s=2.0)
        except PodUnavailable:
            if time.monotonic() > deadline:
                raise TimeoutError("tandem target --tp-size 2 did not come up") from None
            time.sleep(0.3)


async def test_tp2_target_process_serves_greedy_equal_to_hf(models):
    from draft_service.server import serve_draft
    from draft_service.standalone import StandaloneProposer
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner

    target_path, draft_path = models
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "target", "--model-path", target_path, "--tp-size", "2",
           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096", "--service-port", str(port),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    target = TargetClient(f"127.0.0.1:{port}")
    draft_server = None
    try:
        info = await _wait_ready(target, proc)
        proposer = StandaloneProposer(ModelRunner(str(draft_path), EngineConfig(device="cpu", dtype="float32",
                                                                                max_total_tokens=4096)))
        draft_server, draft_port = await serve_draft(proposer, str(draft_path), "127.0.0.1", 0)
        draft = DraftClient(f"127.0.0.1:{draft_port}")
        scheduler = Scheduler(targets=[target], drafts=[draft], tokenizer=None, model_name="tiny",
                              max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=[],
                              spec=SpecConfig("STANDALONE", 3, 2, 6), config=SchedulerConfig(request_timeout_s=60))
        await scheduler.start()
        hf = load_hf_model(target_path)
        try:
            for i, prompt in enumerate(prompts(info.vocab_size)[:3]):
                got, usage, _ = await generate_ids(scheduler, prompt, 15, request_id=f"tp{i}")
                assert got == hf_greedy(hf, prompt, 15), f"prompt {i}: TP=2 target diverged from HF greedy"
                assert usage.accepted_draft_tokens > 0
        finally:
            await scheduler.close()
            await draft.close()
        deadline = time.monotonic() + 10
        while (memory := (await target.info()).memory).free_kv_tokens != memory.total_kv_tokens:
            assert time.monotonic() < deadline, "target KV not freed after the requests finished"
            time.sleep(0.1)
    finally:
        await target.close()
        if draft_server is not None:
            await draft_server.stop(grace=None)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, f"tandem target --tp-size 2 exited with {code} on SIGTERM"
    # rank 1 lives in the target's session: nothing of it may survive the target
    deadline = time.monotonic() + 10
    while left := subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"left behind by the TP target: {left}"
        time.sleep(0.2)
