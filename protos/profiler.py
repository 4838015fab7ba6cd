"""Profiling a running service process: the gateway's `/start_profile` and `/stop_profile` (SGLang's and vLLM's
endpoints) start one `ProcessProfiler` in the gateway and, through the `Profiler` gRPC service, one in every model pod.

A profile records, for the calls the process serves while it runs:
- the torch profiler (`torch.profiler`): host ops and, on CUDA, the kernels; written as a Chrome trace
  (`<process>-<id>.trace.json.gz`, open it in Perfetto or chrome://tracing);
- a Python profile (cProfile) of the threads that run the process's calls (the event-loop thread, where steps run
  inline, and the model worker thread): `<process>-<id>.host.prof` (pstats);
- a summary (`<process>-<id>.summary.txt`): steps profiled, wall ms per step, the hottest Python functions (by own and
  by cumulative time, per step) and the top torch ops / CUDA kernels.

It is off unless the process was started with `--profile-dir` (or TANDEM_TORCH_PROFILER_DIR); every file goes there.
One profile at a time per process. `num_steps` stops it by itself after that many step calls (a target's Verify, a
draft pod's Propose, a gateway iteration), so a profile can cover a window of a long run; every profile stops by
itself after MAX_PROFILE_STEPS (the torch profiler holds its events in memory until it stops).
"""
from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PROFILE_DIR_ENV = "TANDEM_TORCH_PROFILER_DIR"
ACTIVITIES = ("CPU", "GPU")
# A profile forgotten by its caller stops by itself here: the torch profiler keeps every event in memory until it
# stops (an 8B model launches thousands of kernels per step), so an unbounded one would grow until the host runs out.
MAX_PROFILE_STEPS = 2000
_PROFILE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ProfileError(Exception):
    """A profile request this process cannot serve (profiling off, one already running): FAILED_PRECONDITION."""


def profile_dir(flag: str | None) -> str | None:
    """The --profile-dir value, else TANDEM_TORCH_PROFILER_DIR, else None (profiling off)."""
    return flag or os.environ.get(PROFILE_DIR_ENV) or None


@dataclass
class ProfileOptions:
    num_steps: int = 0  # stop by itself after this many step calls; 0 = until stop()
    activities: tuple[str, ...] = ()  # CPU, GPU; () = both (GPU only on CUDA)
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str = ""  # names the files; "" = a timestamp
    output_dir: str = ""  # a directory for the files inside the process's profile dir (SGLang's name); "" = that dir

    def validate(self) -> None:
        """ValueError (INVALID_ARGUMENT / HTTP 400) for options no profile can take."""
        if not 0 <= self.num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps must be in 0..{MAX_PROFILE_STEPS}, got {self.num_steps}")
        bad = [a for a in self.activities if a not in ACTIVITIES]
        if bad:
            raise ValueError(f"unknown profiler activities {bad}: use {list(ACTIVITIES)}")
        if self.profile_id and not _PROFILE_ID.match(self.profile_id):
            raise ValueError("profile_id must be 1-64 letters, digits, '-' or '_'")


@dataclass
class ProfileState:
    active: bool
    files: list[str] = field(default_factory=list)
    num_steps: int = 0
    process: str = ""


class ProcessProfiler:
    """One process's profiler. start(), step() (after each step call) and stop() run on the event loop thread;
    profile_this_thread() / release_this_thread() add and remove another thread that serves calls (the model
    worker)."""

    def __init__(self, service: str, directory: str | None, device_type: str = "cpu") -> None:
        self.process = f"{service}-{os.getpid()}"
        self.directory = directory
        self.device_type = device_type
        self._torch = None  # torch.profiler.profile while running
        self._host: list[tuple[int, cProfile.Profile]] = []  # (thread, its profile)
        self._options: ProfileOptions | None = None
        self._out: Path | None = None  # the running profile's output directory
        self._steps = 0
        self._started = 0.0
        self._last = ProfileState(active=False, process=self.process)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @property
    def active(self) -> bool:
        return self._options is not None

    def state(self) -> ProfileState:
        if self.active:
            return ProfileState(active=True, num_steps=self._steps, process=self.process)
        return self._last

    def start(self, options: ProfileOptions) -> ProfileState:
        options.validate()
        if not self.enabled:
            raise ProfileError(f"profiling is off in {self.process}: start it with --profile-dir DIR "
                               f"(or {PROFILE_DIR_ENV})")
        with self._lock:
            if self.active:
                raise ProfileError(f"{self.process} is already profiling; stop that profile first")
            self._out = self._output_dir(options.output_dir)
            self._out.mkdir(parents=True, exist_ok=True)
            import torch

            activities = set(options.activities or ACTIVITIES)
            kinds = []
            if "CPU" in activities:
                kinds.append(torch.profiler.ProfilerActivity.CPU)
            if "GPU" in activities and self.device_type == "cuda":
                kinds.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=kinds, record_shapes=options.record_shapes,
                                                 with_stack=options.with_stack) if kinds else None
            if self._torch is not None:
                self._torch.start()
            self._options, self._steps, self._started = options, 0, time.perf_counter()
            self._host = []
            if "CPU" in activities:
                self.profile_this_thread()
        logger.info("%s: profiling started (%s)", self.process, options)
        return self.state()

    def _output_dir(self, output_dir: str) -> Path:
        """Where this profile's files go: the profile dir, or output_dir inside it (relative to it, or an absolute
        path under it); ValueError for one outside (a request never writes elsewhere on the machine)."""
        root = Path(self.directory).resolve()
        if not output_dir:
            return root
        target = (root / output_dir).resolve()
        if target != root and root not in target.parents:
            raise ValueError(f"output_dir {output_dir!r} is outside this server's profile directory ({root}): give a "
                             "directory inside it, or a name relative to it")
        return target

    def profile_this_thread(self) -> None:
        """Add the calling thread to the Python profile (run it on each thread that serves calls)."""
        if not self.active or (self._options.activities and "CPU" not in self._options.activities):
            return
        prof = cProfile.Profile()
        try:
            prof.enable()
        except ValueError:  # Python >= 3.12: one cProfile per process (sys.monitoring), and it sees every thread
            return
        self._host.append((threading.get_ident(), prof))

    def release_this_thread(self) -> None:
        """Stop profiling the calling thread (a cProfile is disabled on the thread it profiles: run this on each
        thread profile_this_thread ran on, before stop() on the event loop thread)."""
        for ident, prof in self._host:
            if ident == threading.get_ident():
                prof.disable()

    def step(self) -> bool:
        """After a step call: counts it; True when the profile reached num_steps (the caller then calls stop())."""
        if not self.active:
            return False
        self._steps += 1
        if self._steps >= (self._options.num_steps or MAX_PROFILE_STEPS):
            if not self._options.num_steps:
                logger.warning("%s: the profile reached %d steps without /stop_profile: stopping it", self.process,
                               MAX_PROFILE_STEPS)
            return True
        return False

    def stop(self) -> ProfileState:
        """Stop the running profile and write its files (the cProfile of another thread is disabled and read from
        here: a Profile object's data is complete once disabled); with none running, the last profile's state."""
        with self._lock:
            if not self.active:
                return self._last
            options, steps = self._options, self._steps
            wall_s = time.perf_counter() - self._started
            self.release_this_thread()
            if self._torch is not None:
                self._torch.stop()
            stem = self._out / f"{self.process}-{options.profile_id or time.strftime('%Y%m%d-%H%M%S')}"
            files = []
            stats = None
            if self._host:
                stats = pstats.Stats(self._host[0][1], stream=io.StringIO())
                for _, prof in self._host[1:]:
                    stats.add(prof)
                stats.dump_stats(f"{stem}.host.prof")
                files.append(f"{stem}.host.prof")
            if self._torch is not None:
                self._torch.export_chrome_trace(f"{stem}.trace.json.gz")
                files.append(f"{stem}.trace.json.gz")
            Path(f"{stem}.summary.txt").write_text(self._summary(stats, steps, wall_s))
            files.append(f"{stem}.summary.txt")
            self._last = ProfileState(active=False, files=[str(Path(f).resolve()) for f in files], num_steps=steps,
                                      process=self.process)
            self._torch, self._host, self._options = None, [], None
        logger.info("%s: profile of %d steps written: %s", self.process, steps, ", ".join(files))
        return self._last

    def _summary(self, stats: pstats.Stats | None, steps: int, wall_s: float) -> str:
        per = max(steps, 1)
        lines = [f"# {self.process}: {steps} step calls in {wall_s * 1e3:.1f} ms of wall time", ""]
        if stats is not None:
            rows, idle = [], 0.0
            for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
                if _IDLE.search(name):
                    idle += own
                    continue
                if (Path(file).name, name) in _DRIVERS:
                    continue
                where = f"{Path(file).name}:{line}({name})" if line else name
                rows.append((own, cum, calls, where))
            busy = sum(r[0] for r in rows)
            lines += [f"Python busy: {busy * 1e3 / per:.3f} ms per step over the profiled threads (their own time "
                      f"outside waits; waiting: {idle * 1e3 / per:.3f} ms per step)", ""]
            for title, key in (("own", 0), ("cumulative", 1)):
                lines.append(f"## Python functions by {title} time (ms per step; calls per step; waits and the "
                             "event loop's driver left out)")
                for row in sorted(rows, key=lambda r: r[key], reverse=True)[:40]:
                    lines.append(f"{row[0] * 1e3 / per:9.3f} own {row[1] * 1e3 / per:9.3f} cum "
                                 f"{row[2] / per:8.1f}  {row[3]}")
                lines.append("")
        if self._torch is not None:
            from torch.autograd.profiler_util import FunctionEventAvg

            cuda = any("CUDA" in str(a) for a in self._torch.activities)
            events = self._torch.key_averages()
            device_key = ("self_device_time_total" if hasattr(FunctionEventAvg(), "self_device_time_total")
                          else "self_cuda_time_total")  # (torch renamed it)
            key = device_key if cuda else "self_cpu_time_total"
            if cuda:  # the device's busy time beside the host's: what a step costs the GPU
                gpu_us = sum(getattr(e, device_key, 0) for e in events)
                lines.insert(3, f"GPU kernels: {gpu_us / 1e3 / per:.3f} ms per step (self time of every kernel)")
                timeline = gpu_timeline(device_intervals(self._torch), per)
                if timeline:
                    lines.insert(4, timeline)
            lines.append(f"## torch ops{' and CUDA kernels' if cuda else ''} by {key} (whole profile)")
            lines.append(events.table(sort_by=key, row_limit=30) if len(events) else "(none)")
        return "\n".join(lines) + "\n"


def device_intervals(torch_profile) -> list[tuple[float, float]]:
    """(start, end) in µs of every device event (kernels, copies, memsets) of a stopped torch profile."""
    events = getattr(torch_profile, "events", None)
    if events is None:
        return []
    out = []
    for e in events() or ():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, "time_range", None) is not None:
            out.append((float(e.time_range.start), float(e.time_range.end)))
    return out


def gpu_timeline(intervals: list[tuple[float, float]], steps: int, gap_us: float = 20.0) -> str | None:
    """One summary line on whether the device waited for the host: the union of the device's busy intervals (µs)
    against the span from its first event to its last, and the idle gaps longer than gap_us between them (a GPU-bound
    step has few; a host-bound one shows its host time here). None without device events."""
    if not intervals:
        return None
    intervals = sorted(intervals)
    busy, gaps = 0.0, []
    cur_start, cur_end = intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end > gap_us:
                gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - intervals[0][0]  # the merged runs are disjoint and ordered: the last one ends last
    longest = max(gaps, default=0.0)
    per = max(steps, 1)
    return (f"GPU timeline: busy {busy / 1e3 / per:.3f} ms of a {span / 1e3 / per:.3f} ms span per step "
            f"({100 * busy / max(span, 1e-9):.0f}%); idle gaps over {gap_us:.0f} µs: {len(gaps) / per:.1f} per step, "
            f"{sum(gaps) / 1e3 / per:.3f} ms per step, the longest {longest / 1e3:.3f} ms")


# Functions that only wait (their own time is idle time) and the event loop's drivers (their cumulative time is
# everything, idle included), left out of a summary's tables.
_IDLE = re.compile(r"^<(built-in )?method '?(poll' of 'select\.|select' of 'select\.|get' of '_queue\.|acquire' of "
                   r"'_thread\.|time\.sleep)")
_DRIVERS = {("base_events.py", "_run_once"), ("base_events.py", "run_forever"), ("base_events.py",
            "run_until_complete"), ("selectors.py", "select"), ("runners.py", "run"), ("thread.py", "_worker"),
            ("threading.py", "run"), ("threading.py", "_bootstrap_inner"), ("threading.py", "_bootstrap")}


class ProfilerServicer:
    """The `Profiler` gRPC service of a model pod over its ProcessProfiler. `worker`: the pod's ModelWorker, whose
    thread joins the Python profile. Registered by add_to_server."""

    def __init__(self, profiler: ProcessProfiler, worker) -> None:
        self.profiler = profiler
        self.worker = worker

    async def StartProfile(self, request, context):
        import grpc

        options = ProfileOptions(num_steps=request.num_steps, activities=tuple(request.activities),
                                 record_shapes=request.record_shapes, with_stack=request.with_stack,
                                 profile_id=request.profile_id, output_dir=request.output_dir)
        try:
            state = self.profiler.start(options)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProfileError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        await self.worker.run(self.profiler.profile_this_thread)  # the worker thread (prefills, long calls)
        return state_to_pb(state)

    async def StopProfile(self, request, context):
        return state_to_pb(await self._stop())

    async def step(self) -> None:
        """After a step call: stop (and write the files) once num_steps are done."""
        if self.profiler.step():
            await self._stop()

    async def _stop(self) -> ProfileState:
        if self.profiler.active:
            await self.worker.run(self.profiler.release_this_thread)  # after the call in progress, on its thread
        return self.profiler.stop()


def state_to_pb(state: ProfileState):
    from protos.tandem.v1 import tandem_pb2 as pb

    return pb.ProfileState(active=state.active, files=state.files, num_steps=state.num_steps, process=state.process)


def add_to_server(servicer: ProfilerServicer, server) -> None:
    from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc

    pb_grpc.add_ProfilerServicer_to_server(servicer, server)
