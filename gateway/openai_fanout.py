"""`n` > 1 on the OpenAI routes: n independent generations of one prompt (choice i is request `<id>-i`, seed + i
when a seed is given, so seeded requests stay reproducible and choices differ), merged into one response or one SSE
stream whose chunks carry the choice index. Usage counts the prompt once and sums the completions, as OpenAI does.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from gateway.types import GenerateChunk, GenerateParams, Usage


def fan_out(params: GenerateParams, n: int) -> list[GenerateParams]:
    if n == 1:
        return [params]
    out = []
    for i in range(n):
        seed = params.sampling.seed
        sampling = dataclasses.replace(params.sampling, seed=None if seed is None else (seed + i) % (1 << 64))
        out.append(dataclasses.replace(params, request_id=f"{params.request_id}-{i}", sampling=sampling))
    return out


def total_usage(usages: list[Usage]) -> Usage:
    """The prompt once (every choice shares it); completion and speculation counters summed."""
    if not usages:
        return Usage(0, 0)
    return Usage(prompt_tokens=usages[0].prompt_tokens,
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 verify_steps=sum(u.verify_steps for u in usages),
                 accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages),
                 proposed_draft_tokens=sum(u.proposed_draft_tokens for u in usages),
                 predraft_hits=sum(u.predraft_hits for u in usages),
                 predraft_misses=sum(u.predraft_misses for u in usages),
                 cached_prompt_tokens=max(u.cached_prompt_tokens for u in usages))


async def merge(streams: list[AsyncIterator[GenerateChunk]]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) from all streams as they arrive; each stream's chunks stay in order. An error in one
    stream ends the merge with that error; closing the merge closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
            await queue.put((index, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no stream is mid-iteration when it is closed
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - a stream that fails to close must not hide the others
                    pass
