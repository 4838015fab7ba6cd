"""Model pods the gateway can route to: a pool per kind (target, draft) with health state and consistent routing.

Routing is rendezvous (highest-random-weight) hashing of the sequence id over the live pods: every gateway that sees
the same live set picks the same pod, and losing a pod only moves the sequences that were on it. A pod whose call
failed is marked down and probed again after `retry_s`.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

C = TypeVar("C")


def _weight(seq_id: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seq_id}|{address}".encode(), digest_size=8).digest(), "big")


class PodPool(Generic[C]):
    def __init__(self, clients: list[C], retry_s: float = 5.0):
        self.clients = list(clients)
        self.retry_s = retry_s
        self._down_until: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.clients)

    def live(self) -> list[C]:
        now = time.monotonic()
        return [c for c in self.clients if self._down_until.get(c.address, 0.0) <= now]

    def route(self, seq_id: str) -> C | None:
        """The live pod for this sequence, or None when every pod is down."""
        live = self.live()
        if not live:
            return None
        return max(live, key=lambda c: _weight(seq_id, c.address))

    def mark_down(self, client: C, reason: str) -> None:
        logger.warning("pod %s marked down for %.1fs: %s", client.address, self.retry_s, reason)
        self._down_until[client.address] = time.monotonic() + self.retry_s

    def mark_up(self, client: C) -> None:
        self._down_until.pop(client.address, None)

    def is_down(self, client: C) -> bool:
        return self._down_until.get(client.address, 0.0) > time.monotonic()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
