"""Model pods the gateway can route to: a pool per kind (target, draft) with health state and consistent routing.

Routing is rendezvous (highest-random-weight) hashing of the sequence id over the live pods: every gateway that sees
the same live set picks the same pod, and losing a pod only moves the sequences that were on it. A pod whose call
failed is marked down and tried again after `retry_s`; a pod that fails its active health probe (the scheduler's
probe loop) stays down until a probe succeeds.
"""
from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

C = TypeVar("C")
PROBE_FAILURES = 2  # consecutive failed health probes that take a pod out


def rendezvous_weight(seq_id: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seq_id}|{address}".encode(), digest_size=8).digest(), "big")


class PodPool(Generic[C]):
    def __init__(self, clients: list[C], retry_s: float = 5.0):
        self.clients = list(clients)
        self.retry_s = retry_s
        self._down_until: dict[str, float] = {}
        self._retired: set[str] = set()  # pods that left the address list: never routed to again
        self._failing_probe: set[str] = set()  # pods whose health probes failed: down until one succeeds
        self._probe_failures: dict[str, int] = {}  # consecutive failed probes per pod

    def __len__(self) -> int:
        return len(self.clients)

    def live(self) -> list[C]:
        return [c for c in self.clients if not self.is_down(c)]

    def route(self, seq_id: str) -> C | None:
        """The live pod for this sequence, or None when every pod is down."""
        live = self.live()
        if not live:
            return None
        return max(live, key=lambda c: rendezvous_weight(seq_id, c.address))

    def mark_down(self, client: C, reason: str) -> None:
        logger.warning("pod %s marked down for %.1fs: %s", client.address, self.retry_s, reason)
        self._down_until[client.address] = time.monotonic() + self.retry_s

    def mark_up(self, client: C) -> None:
        self._down_until.pop(client.address, None)

    def is_down(self, client: C) -> bool:
        address = client.address
        return (address in self._retired or address in self._failing_probe
                or self._down_until.get(address, 0.0) > time.monotonic())

    def set_probe_result(self, client: C, ok: bool) -> None:
        """The outcome of an active health probe: a pod that fails PROBE_FAILURES in a row stays down until one
        succeeds (a failed call's mark lasts only `retry_s`, so without probes a dead pod would look up again between
        calls); one slow answer on a loaded host does not take a pod out."""
        address = client.address
        if ok:
            self._probe_failures.pop(address, None)
            if address in self._failing_probe:
                self._failing_probe.discard(address)
                logger.info("pod %s answers its health probe again", address)
            return
        self._probe_failures[address] = self._probe_failures.get(address, 0) + 1
        if self._probe_failures[address] >= PROBE_FAILURES and address not in self._failing_probe:
            self._failing_probe.add(address)
            logger.warning("pod %s fails its health probe; down until it answers", address)

    def update(self, addresses: list[str], make_client: Callable[[str], C]) -> tuple[list[str], list[str]]:
        """Make the pool follow a new address list (DNS re-resolution): new pods join, vanished pods retire (their
        sequences move on their next step). Returns (added, removed)."""
        current = {c.address for c in self.clients}
        wanted = set(addresses)
        added = sorted(wanted - current)
        removed = sorted(current - wanted)
        for address in added:
            self.clients.append(make_client(address))
            self._retired.discard(address)
        self._retired.update(removed)
        self.clients = [c for c in self.clients if c.address not in self._retired]
        if added or removed:
            logger.info("pods changed: +%s -%s", added, removed)
        return added, removed


def resolve(target: str) -> list[str]:
    """`dns:///host:port` → one `ip:port` per address the name resolves to (a headless Service lists every pod);
    a plain `host:port` stays as it is."""
    if not target.startswith("dns:///"):
        return [target]
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    found = []
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return sorted(found)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
