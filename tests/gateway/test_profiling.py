"""gateway/profiling.py: /start_profile and /stop_profile fan out to every pod once (a pod serving both roles is
asked once), a pod that cannot profile is reported without stopping the others, and a gateway that cannot profile
asks no pod."""
from __future__ import annotations

import pytest

from gateway.clients import PodUnavailable
from gateway.profiling import ClusterProfiler
from protos.profiler import ProcessProfiler, ProfileError, ProfileOptions, ProfileState


class FakePod:
    def __init__(self, address: str, fail: Exception | None = None) -> None:
        self.address, self.fail, self.calls = address, fail, []

    async def start_profile(self, options: ProfileOptions) -> ProfileState:
        self.calls.append(("start", options.profile_id))
        if self.fail is not None:
            raise self.fail
        return ProfileState(True, [], 0, f"pod-{self.address}")

    async def stop_profile(self) -> ProfileState:
        self.calls.append(("stop",))
        if self.fail is not None:
            raise self.fail
        return ProfileState(False, [f"/p/{self.address}.summary.txt"], 3, f"pod-{self.address}")


async def test_every_pod_once_and_failures_reported_per_pod(tmp_path):
    ok, down, off = FakePod("a:1"), FakePod("b:1", PodUnavailable("b:1: UNAVAILABLE")), FakePod("c:1", ProfileError(
        "profiling is off in target-9: start it with --profile-dir DIR"))
    cluster = ClusterProfiler(ProcessProfiler("gateway", str(tmp_path)), lambda: [ok, down, off, ok])  # ok twice
    started = await cluster.start(ProfileOptions(profile_id="x"))
    assert started["status"] == "started"
    entries = started["processes"]
    assert entries[0]["process"].startswith("gateway-") and entries[0]["active"]
    assert [e.get("address") for e in entries[1:]] == ["a:1", "b:1", "c:1"]
    assert entries[1]["active"] and not entries[2]["active"] and "UNAVAILABLE" in entries[2]["error"]
    assert "--profile-dir" in entries[3]["error"]
    assert ok.calls == [("start", "x")]  # asked once
    stopped = await cluster.stop()
    assert stopped["processes"][0]["files"] and stopped["processes"][1]["files"] == ["/p/a:1.summary.txt"]
    assert "error" in stopped["processes"][2]


async def test_a_gateway_that_cannot_profile_asks_no_pod(tmp_path):
    pod = FakePod("a:1")
    off = ClusterProfiler(ProcessProfiler("gateway", None), lambda: [pod])
    with pytest.raises(ProfileError, match="profiling is off"):
        await off.start(ProfileOptions())
    with pytest.raises(ValueError, match="activities"):
        await ClusterProfiler(ProcessProfiler("gateway", str(tmp_path)), lambda: [pod]).start(
            ProfileOptions(activities=("TPU",)))
    assert pod.calls == []
