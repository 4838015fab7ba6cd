"""Pod pools: rendezvous routing is stable and moves only the lost pod's sequences; pools follow address lists."""
from __future__ import annotations

from dataclasses import dataclass

from gateway.pods import PodPool, resolve


@dataclass
class FakeClient:
    address: str

    async def close(self) -> None:
        pass


def test_routing_is_stable_and_only_moves_sequences_of_a_lost_pod():
    pool = PodPool([FakeClient(f"10.0.0.{i}:1") for i in range(4)], retry_s=60)
    seqs = [f"seq-{i}" for i in range(400)]
    before = {s: pool.route(s).address for s in seqs}
    assert len(set(before.values())) == 4  # spread over every pod
    lost = pool.clients[1]
    pool.mark_down(lost, "test")
    after = {s: pool.route(s).address for s in seqs}
    moved = [s for s in seqs if before[s] != after[s]]
    assert moved and all(before[s] == lost.address for s in moved)
    assert lost.address not in after.values()
    pool.mark_up(lost)
    assert {s: pool.route(s).address for s in seqs} == before


def test_update_adds_new_pods_and_retires_vanished_ones():
    pool = PodPool([FakeClient("a:1"), FakeClient("b:1")])
    added, removed = pool.update(["b:1", "c:1"], FakeClient)
    assert (added, removed) == (["c:1"], ["a:1"])
    assert sorted(c.address for c in pool.live()) == ["b:1", "c:1"]
    assert pool.is_down(FakeClient("a:1"))
    assert pool.route("x") is not None


def test_no_live_pod_routes_to_none():
    pool = PodPool([FakeClient("a:1")])
    pool.mark_down(pool.clients[0], "gone")
    assert pool.route("x") is None


def test_resolve_expands_dns_names_and_keeps_plain_addresses():
    assert resolve("10.1.2.3:50") == ["10.1.2.3:50"]
    assert "127.0.0.1:7000" in resolve("dns:///localhost:7000")
    assert resolve("dns:///no-such-host.invalid:7000") == []


def test_a_pod_failing_its_health_probes_stays_down_until_one_succeeds():
    from gateway.pods import PodPool

    class Client:
        def __init__(self, address):
            self.address = address

    a, b = Client("a:1"), Client("b:1")
    pool = PodPool([a, b], retry_s=0.0)
    pool.set_probe_result(a, False)
    assert pool.live() == [a, b]  # one slow answer does not take it out
    pool.set_probe_result(a, False)
    assert pool.live() == [b] and pool.is_down(a)
    pool.set_probe_result(a, False)
    assert pool.is_down(a)  # not a time window: down for as long as it fails
    pool.set_probe_result(a, True)
    assert pool.live() == [a, b]
