"""Who owns each sequence a model service holds, and when it was last used (issue 15 §7).

A sequence belongs to the gateway that created it (its id travels as `x-tandem-owner` call metadata): another
caller's Prefill, step or Release of it is refused. A sequence no call has touched for `idle_ttl_s` is abandoned (its
gateway died or lost track of it) and the servicer frees it (`free_idle`, swept by `free_idle_forever`). Plain
bookkeeping: no grpc, no model (the servicer hands in its model worker and release call).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TTL_S = 300.0


class SeqLeases:
    def __init__(self, idle_ttl_s: float = DEFAULT_IDLE_TTL_S, clock=time.monotonic):
        if idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {idle_ttl_s}")
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._owner: dict[str, str] = {}
        self._last_used: dict[str, float] = {}

    def allows(self, seq_id: str, owner: str) -> bool:
        """True when `owner` may use this sequence: it owns it, or nobody does."""
        return self._owner.get(seq_id, owner) == owner

    def claim(self, seq_ids: list[str], owner: str) -> None:
        """These sequences now belong to `owner` (prefill), used now."""
        now = self._clock()
        for seq_id in seq_ids:
            self._owner[seq_id] = owner
            self._last_used[seq_id] = now

    def touch(self, seq_ids: list[str]) -> None:
        now = self._clock()
        for seq_id in seq_ids:
            if seq_id in self._owner:
                self._last_used[seq_id] = now

    def forget(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._owner.pop(seq_id, None)
            self._last_used.pop(seq_id, None)

    def idle(self) -> list[str]:
        """Sequences unused for longer than the TTL."""
        limit = self._clock() - self.idle_ttl_s
        return [seq_id for seq_id, used in self._last_used.items() if used < limit]

    def __len__(self) -> int:
        return len(self._owner)


def caller(context) -> str:
    """The owner id a gRPC call carries (empty when it carries none, or for a direct in-process call: no context)."""
    from protos.wire import OWNER_METADATA

    if context is None:
        return ""
    for key, value in context.invocation_metadata() or ():
        if key == OWNER_METADATA:
            return value if isinstance(value, str) else ""
    return ""


async def free_idle(leases: SeqLeases, worker, release: Callable[[list[str]], int]) -> int:
    """Free the sequences no call has used within the idle TTL (their gateway is gone) through the service's model
    worker (protos/model_worker.py) and its release(seq_ids) -> count; returns how many."""
    idle = leases.idle()
    if not idle:
        return 0
    released = await worker.run(release, idle, inline=True)
    leases.forget(idle)
    if released:
        logger.warning("freed %d sequences idle for more than %.0fs", released, leases.idle_ttl_s)
    return released


async def free_idle_forever(free: Callable[[], object], idle_ttl_s: float) -> None:
    """Call the awaitable `free()` a few times per TTL until cancelled (the servicer's idle sweeper task)."""
    while True:
        await asyncio.sleep(min(idle_ttl_s / 4, 10.0))
        try:
            await free()
        except Exception:  # never let one failed sweep end the sweeping
            logger.exception("freeing idle sequences failed")
