"""The gateway's `/start_profile` and `/stop_profile`: profile this process (its event loop: the speculative loop,
streaming, the clients) and, through each model pod's `Profiler` service, every target and draft process, at once.

Each process writes its own files into its own --profile-dir (protos/profiler.py): a torch profiler trace, a Python
profile and a summary. The answer names, per process, what it wrote or why it could not profile; a pod that cannot
(down, started without --profile-dir) does not stop the others.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict

from protos.profiler import ProcessProfiler, ProfileError, ProfileOptions, ProfileState


class ClusterProfiler:
    def __init__(self, profiler: ProcessProfiler, pods) -> None:
        """profiler: the gateway's own; pods: a callable giving the pod clients now (targets and drafts; a pod
        serving both roles is profiled once)."""
        self.profiler = profiler
        self._pods = pods

    def _unique_pods(self) -> list:
        seen, pods = set(), []
        for client in self._pods():
            if client.address not in seen:
                seen.add(client.address)
                pods.append(client)
        return pods

    async def start(self, options: ProfileOptions) -> dict:
        """ValueError for bad options, ProfileError when the gateway cannot profile (off, one running); a pod's
        failure is reported in its entry."""
        self.profiler.start(options)  # raises before any pod is asked
        pods = self._unique_pods()
        results = await asyncio.gather(*(pod.start_profile(options) for pod in pods), return_exceptions=True)
        return {"status": "started", "processes": [self._entry(self.profiler.state()),
                                                   *(self._entry(r, pod) for pod, r in zip(pods, results))]}

    async def stop(self) -> dict:
        """Stop every profile (each process writes its files) and name the files."""
        pods = self._unique_pods()
        results = await asyncio.gather(*(pod.stop_profile() for pod in pods), return_exceptions=True)
        state = self.profiler.stop()
        return {"status": "stopped", "processes": [self._entry(state),
                                                   *(self._entry(r, pod) for pod, r in zip(pods, results))]}

    def step(self) -> None:
        """After a scheduler iteration that ran a step: the gateway's own profile stops at its num_steps."""
        if self.profiler.step():
            self.profiler.stop()

    @staticmethod
    def _entry(result, pod=None) -> dict:
        entry = {} if pod is None else {"address": pod.address}
        if isinstance(result, ProfileState):
            entry.update(asdict(result))
        else:
            entry.update(active=False, error=str(result) if isinstance(result, (ProfileError, ValueError))
                         else f"{type(result).__name__}: {result}")
        return entry
