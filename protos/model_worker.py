"""Where a service's model work runs: one call at a time, short step calls inline on the event loop, long ones on a
worker thread. Shared by the target and draft servicers.

Why inline: handing a call to a worker thread and back (run_in_executor) wakes two threads and costs 0.1-0.2 ms per
call (measured 0.20 ms on the 2-core CI box), a few percent of an 8B decode step and the largest single piece of the
per-step gRPC overlay after the transport itself. A step RPC's work is bounded (one verify forward, or a few decode or
draft steps), so running it on the loop thread delays other calls (health checks, Info) by at most one step, as in
TGI's shard server. Calls whose work is unbounded (prompt prefills, long catch-ups) still go to the worker thread so
the loop keeps answering while they run.

Ordering: an asyncio.Lock (FIFO) serialises every call, inline or not, so model state is touched by one call at a time
in arrival order, exactly as the one-thread executor did before.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ModelWorker:
    def __init__(self, name: str, inline_steps: bool = True) -> None:
        """inline_steps=False sends every call to the worker thread (the old behaviour; tests compare both)."""
        self.inline_steps = inline_steps
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock: asyncio.Lock | None = None  # made on first use, inside the server's event loop
        self.num_inline = 0  # calls run on the loop thread (tests, benchmarks)
        self.num_threaded = 0

    async def run(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        """fn(*args) after every earlier call has finished; on the loop thread when `inline` (and inline steps are
        on), else on the worker thread. Exceptions propagate unchanged either way."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if inline and self.inline_steps:
                self.num_inline += 1
                return fn(*args)
            self.num_threaded += 1
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
