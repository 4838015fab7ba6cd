"""/start_profile and /stop_profile through `tandem serve` (three real processes: gateway, target, draft): every
process profiles at once and writes a torch trace, a Python profile and a summary into --profile-dir; num_steps
ends the pods' profiles by themselves; bad options and a second start get an error body; without --profile-dir the
endpoints say how to turn profiling on."""
from __future__ import annotations

import gzip
import json
import pstats
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_serve import Stack

pytestmark = pytest.mark.slow


def _completion(stack: Stack, max_tokens: int) -> dict:
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                   json={"prompt": "def add(a, b):\n    ", "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_profiling_every_process_of_a_running_stack(tmp_path):
    out = tmp_path / "profiles"
    s = Stack("--speculative-algorithm", "STANDALONE", "--no-colocate-draft", "--profile-dir", str(out))
    try:
        s.wait_ready()
        _completion(s, 8)  # warm
        r = httpx.post(f"{s.base_url}/start_profile", json={"profile_id": "whole"}, timeout=60)
        assert r.status_code == 200, r.text
        started = r.json()["processes"]
        assert [p["process"].split("-")[0] for p in started] == ["gateway", "target", "draft"]
        assert all(p["active"] for p in started), started
        again = httpx.post(f"{s.base_url}/start_profile", json={}, timeout=60)
        assert again.status_code == 400 and "already profiling" in again.json()["error"]["message"]
        bad = httpx.post(f"{s.base_url}/start_profile", json={"activities": ["TPU"]}, timeout=60)
        assert bad.status_code == 400 and "activities" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{s.base_url}/start_profile", json={"merge_profiles": True}, timeout=60)
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "merge_profiles"

        _completion(s, 16)
        r = httpx.post(f"{s.base_url}/stop_profile", timeout=120)
        assert r.status_code == 200, r.text
        stopped = {p["process"].split("-")[0]: p for p in r.json()["processes"]}
        for name, hot in (("gateway", "_step"), ("target", "_verify"), ("draft", "_propose")):
            p = stopped[name]
            assert not p["active"] and p["num_steps"] >= 2, p
            files = {Path(f).name.split(".", 1)[1]: Path(f) for f in p["files"]}
            assert set(files) == {"host.prof", "trace.json.gz", "summary.txt"}, p
            assert all(f.parent == out and f.name.endswith(("whole.host.prof", "whole.trace.json.gz",
                                                            "whole.summary.txt")) for f in files.values())
            assert "Python busy:" in files["summary.txt"].read_text(), name
            assert any(n == hot for (_, _, n) in pstats.Stats(str(files["host.prof"])).stats), name  # its step code
            assert json.loads(gzip.decompress(files["trace.json.gz"].read_bytes()))["traceEvents"]

        # num_steps: the pods stop by themselves after 3 step calls; /stop_profile then names their files
        outside = httpx.post(f"{s.base_url}/start_profile", json={"output_dir": "/etc"}, timeout=60)
        assert outside.status_code == 400 and "outside" in outside.json()["error"]["message"]
        r = httpx.post(f"{s.base_url}/start_profile", json={"num_steps": 3, "profile_id": "three",
                                                            "activities": ["CPU"], "output_dir": "run2"}, timeout=60)
        assert r.status_code == 200, r.text
        _completion(s, 24)
        stopped = {p["process"].split("-")[0]: p for p in
                   httpx.post(f"{s.base_url}/stop_profile", timeout=120).json()["processes"]}
        for name in ("gateway", "target", "draft"):
            assert stopped[name]["num_steps"] == 3, stopped[name]
            assert all("three" in f for f in stopped[name]["files"])
        assert (out / "run2" / Path(stopped["target"]["files"][0]).name).exists()  # SGLang's output_dir, inside
    finally:
        assert s.stop() == 0


def test_profiling_is_off_without_a_profile_dir(monkeypatch):
    monkeypatch.delenv("TANDEM_TORCH_PROFILER_DIR", raising=False)
    s = Stack("--speculative-algorithm", "NGRAM")
    try:
        s.wait_ready()
        r = httpx.post(f"{s.base_url}/start_profile", timeout=60)
        assert r.status_code == 400
        assert "--profile-dir" in r.json()["error"]["message"]
        r = httpx.post(f"{s.base_url}/stop_profile", timeout=60)  # nothing running: nothing written
        assert r.status_code == 200 and r.json()["processes"][0]["files"] == []
    finally:
        assert s.stop() == 0
