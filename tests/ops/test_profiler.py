"""protos/profiler.py: one process's profile (torch profiler + Python profile + summary), its errors, and the stop
after num_steps step calls."""
from __future__ import annotations

import gzip
import json
import pstats
import threading
from pathlib import Path

import pytest
import torch

from protos.profiler import PROFILE_DIR_ENV, ProcessProfiler, ProfileError, ProfileOptions, profile_dir


def _work(n: int = 3) -> None:
    x = torch.randn(64, 64)
    for _ in range(n):
        x = torch.nn.functional.silu(x @ x.T / 64)


def test_a_profile_writes_a_trace_a_host_profile_and_a_summary(tmp_path):
    prof = ProcessProfiler("target", str(tmp_path / "prof"))
    state = prof.start(ProfileOptions(profile_id="run1"))
    assert state.active and prof.active
    for _ in range(4):
        _work()
        assert not prof.step()  # num_steps 0: runs until stop()
    state = prof.stop()
    assert not state.active and state.num_steps == 4
    names = sorted(Path(f).name for f in state.files)
    stem = f"target-{Path(state.files[0]).name.split('-')[1]}-run1"
    assert names == sorted([f"{stem}.host.prof", f"{stem}.summary.txt", f"{stem}.trace.json.gz"])
    files = {Path(f).suffixes[-1]: Path(f) for f in state.files}
    trace = json.loads(gzip.decompress(files[".gz"].read_bytes()))
    assert any("mm" in e.get("name", "") for e in trace["traceEvents"])  # the matmuls were recorded
    stats = pstats.Stats(str(files[".prof"]))
    assert any(name == "_work" for (_, _, name) in stats.stats)
    summary = files[".txt"].read_text()
    assert "4 step calls" in summary and "_work" in summary and "aten::mm" in summary
    assert prof.stop() == state  # nothing running: the last profile's files again


def test_num_steps_ends_the_profile_and_a_new_one_can_start(tmp_path):
    prof = ProcessProfiler("draft", str(tmp_path), "cpu")
    prof.start(ProfileOptions(num_steps=2, activities=("CPU",), profile_id="a"))
    assert not prof.step()
    assert prof.step()  # the caller stops now
    assert prof.stop().num_steps == 2
    prof.start(ProfileOptions(activities=("GPU",), profile_id="b"))  # GPU only on a CPU process: just the summary
    state = prof.stop()
    assert [Path(f).name.endswith(".summary.txt") for f in state.files] == [True]


def test_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    off = ProcessProfiler("gateway", profile_dir(None))
    with pytest.raises(ProfileError, match="profiling is off.*--profile-dir"):
        off.start(ProfileOptions())
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    assert profile_dir(None) == str(tmp_path) and profile_dir("/x") == "/x"
    prof = ProcessProfiler("gateway", str(tmp_path))
    for bad, match in ((ProfileOptions(activities=("TPU",)), "unknown profiler activities"),
                       (ProfileOptions(num_steps=-1), "num_steps"),
                       (ProfileOptions(profile_id="../etc"), "profile_id")):
        with pytest.raises(ValueError, match=match):
            prof.start(bad)
    assert not prof.active
    prof.start(ProfileOptions())
    with pytest.raises(ProfileError, match="already profiling"):
        prof.start(ProfileOptions())
    prof.stop()


def test_another_threads_python_is_profiled_too(tmp_path):
    """The model worker thread joins the Python profile (profile_this_thread / release_this_thread on it)."""
    prof = ProcessProfiler("target", str(tmp_path))
    prof.start(ProfileOptions(activities=("CPU",), profile_id="threads"))

    def worker_call():
        prof.profile_this_thread()

        def _on_the_worker():
            _work(1)

        _on_the_worker()
        prof.release_this_thread()

    t = threading.Thread(target=worker_call)
    t.start()
    t.join()
    state = prof.stop()
    stats = pstats.Stats(next(f for f in state.files if f.endswith(".host.prof")))
    assert any(name == "_on_the_worker" for (_, _, name) in stats.stats)


def test_a_forgotten_profile_stops_by_itself(tmp_path, monkeypatch):
    import protos.profiler as profiler

    monkeypatch.setattr(profiler, "MAX_PROFILE_STEPS", 3)
    prof = ProcessProfiler("gateway", str(tmp_path))
    prof.start(ProfileOptions(activities=("CPU",)))  # no num_steps, never stopped by its caller
    assert [prof.step() for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="num_steps must be in 0..3"):
        ProcessProfiler("x", str(tmp_path)).start(ProfileOptions(num_steps=4))
    assert prof.stop().num_steps == 3


def test_a_gpu_profile_summary_names_the_kernels_busy_time(tmp_path):
    """The summary of a CUDA profile (faked here: no GPU) adds the kernels' ms per step beside the Python busy ms."""
    from types import SimpleNamespace

    from torch.autograd.profiler_util import FunctionEventAvg

    key = "self_device_time_total" if hasattr(FunctionEventAvg(), "self_device_time_total") else "self_cuda_time_total"

    class Events(list):
        def table(self, sort_by, row_limit):
            assert sort_by == key
            return "kernel table"

    prof = ProcessProfiler("target", str(tmp_path), "cuda")
    prof._torch = SimpleNamespace(activities=["ProfilerActivity.CUDA"],
                                  key_averages=lambda: Events([SimpleNamespace(**{key: 1500.0}),
                                                               SimpleNamespace(**{key: 500.0})]))
    summary = prof._summary(None, 4, 0.01)
    assert "GPU kernels: 0.500 ms per step" in summary and "kernel table" in summary


def test_output_dir_stays_inside_the_profile_dir(tmp_path):
    prof = ProcessProfiler("draft", str(tmp_path / "prof"))
    prof.start(ProfileOptions(activities=("CPU",), profile_id="a", output_dir="run/1"))
    assert all(Path(f).parent == (tmp_path / "prof" / "run" / "1").resolve() for f in prof.stop().files)
    prof.start(ProfileOptions(activities=("CPU",), output_dir=str(tmp_path / "prof" / "abs")))  # absolute, inside
    assert all("/prof/abs/" in f for f in prof.stop().files)
    for outside in ("../elsewhere", "/etc", str(tmp_path)):
        with pytest.raises(ValueError, match="outside this server's profile directory"):
            prof.start(ProfileOptions(output_dir=outside))
    assert not prof.active


def test_the_gpu_timeline_names_the_device_idle_gaps():
    """Busy time is the union of overlapping device events; only gaps over the threshold count, per step."""
    from protos.profiler import gpu_timeline

    assert gpu_timeline([], 1) is None
    # two steps: busy 0-100 (two overlapping kernels), 105-200, gap 300 µs, 500-600 -> busy 295 of a 600 µs span
    line = gpu_timeline([(0, 60), (40, 100), (105, 200), (500, 600)], 2)
    assert "busy 0.147 ms of a 0.300 ms span per step (49%)" in line, line
    assert "0.5 per step, 0.150 ms per step, the longest 0.300 ms" in line, line
