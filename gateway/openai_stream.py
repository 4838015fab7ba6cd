"""Streaming and collection helpers of the OpenAI REST front (gateway/openai_api.py): the SSE response that watches
for client disconnects, SSE event streams for one choice and for n choices, collecting a whole response, and waiting
on work unless the client goes away. Closing what they consume always closes the backend's generation streams."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.errors import RequestAborted, error_body, http_error
from gateway.openai_fanout import total_usage
from gateway.openai_protocol import ResponseFormatter
from gateway.types import FinishReason, GatewayError, GenerateChunk, Usage

log = logging.getLogger("gateway.openai_api")

class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client going away (Starlette skips that for ASGI 2.4
    servers and only notices on the next write) and then closes the body iterator, which closes the backend's."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await close_stream(self.body_iterator)


async def sse_events(chunks: AsyncIterator[GenerateChunk], first: GenerateChunk, fmt: ResponseFormatter,
                      include_usage: bool) -> AsyncIterator[str]:
    try:
        role = fmt.role_chunk()
        if role is not None:
            yield _sse(role)
        chunk: GenerateChunk | None = first
        while chunk is not None:
            if chunk.finish_reason is None:
                if chunk.text or chunk.logprobs:
                    yield _sse(fmt.text_chunk(chunk.text, None, 0, chunk.token_ids, chunk.logprobs))
                chunk = await anext(chunks, None)
                continue
            finish = finish_reason_of(chunk)
            if chunk.text or chunk.logprobs:
                yield _sse(fmt.text_chunk(chunk.text, None, 0, chunk.token_ids, chunk.logprobs))
            yield _sse(fmt.text_chunk("", finish))
            if include_usage:
                yield _sse(fmt.usage_chunk(chunk.usage or Usage(0, 0)))
            break
        else:
            raise RuntimeError("the backend ended the stream without a finish reason")
    except GatewayError as exc:
        yield _sse(http_error(exc)[1])
    except Exception as exc:
        log.exception("error while streaming", exc_info=exc)
        yield _sse(error_body("internal server error", "internal_error"))
    finally:
        with anyio.CancelScope(shield=True):
            await close_stream(chunks)
    yield "data: [DONE]\n\n"


async def sse_events_n(merged: AsyncIterator[tuple[int, GenerateChunk]], first: tuple[int, GenerateChunk],
                        fmt: ResponseFormatter, include_usage: bool, n: int) -> AsyncIterator[str]:
    """The SSE stream of n choices: a role chunk per choice (chat), each choice's text and finish chunks with its
    index as they come, then the summed usage (include_usage) and [DONE]."""
    usages: dict[int, Usage] = {}
    try:
        for i in range(n):
            role = fmt.role_chunk(i)
            if role is not None:
                yield _sse(role)
        item: tuple[int, GenerateChunk] | None = first
        while item is not None:
            index, chunk = item
            if chunk.text or chunk.logprobs:
                yield _sse(fmt.text_chunk(chunk.text, None, index, chunk.token_ids, chunk.logprobs))
            if chunk.finish_reason is not None:
                yield _sse(fmt.text_chunk("", finish_reason_of(chunk), index))
                usages[index] = chunk.usage or Usage(0, 0)
            item = await anext(merged, None)
        if len(usages) != n:
            raise RuntimeError("the backend ended a stream without a finish reason")
        if include_usage:
            yield _sse(fmt.usage_chunk(total_usage([usages[i] for i in range(n)])))
    except GatewayError as exc:
        yield _sse(http_error(exc)[1])
    except Exception as exc:
        log.exception("error while streaming", exc_info=exc)
        yield _sse(error_body("internal server error", "internal_error"))
    finally:
        with anyio.CancelScope(shield=True):
            await close_stream(merged)
    yield "data: [DONE]\n\n"


async def collect_n(merged: AsyncIterator[tuple[int, GenerateChunk]], n: int) -> tuple[list[tuple], Usage]:
    """Per choice (text, finish reason, token ids, logprob entries or None), and the summed usage."""
    texts: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list | None] = [None] * n
    finishes: dict[int, tuple[str, Usage]] = {}
    try:
        async for index, chunk in merged:
            texts[index].append(chunk.text)
            token_ids[index] += chunk.token_ids
            if chunk.logprobs is not None:
                logprobs[index] = (logprobs[index] or []) + chunk.logprobs
            if chunk.finish_reason is not None:
                finishes[index] = (finish_reason_of(chunk), chunk.usage or Usage(0, 0))
        if len(finishes) != n:
            raise RuntimeError("the backend ended a stream without a finish reason")
        return ([("".join(texts[i]), finishes[i][0], token_ids[i], logprobs[i]) for i in range(n)],
                total_usage([finishes[i][1] for i in range(n)]))
    finally:
        with anyio.CancelScope(shield=True):
            await close_stream(merged)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


DISCONNECTED = object()


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client disconnects first (then `work` is cancelled and DISCONNECTED returned)."""
    outcome: list[Any] = [DISCONNECTED]
    failure: list[BaseException] = []

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            try:
                outcome[0] = await work
            except Exception as exc:
                failure.append(exc)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if failure:
        raise failure[0]
    return outcome[0]


async def first_chunk(chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        raise RuntimeError("the backend produced no output") from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close_stream(chunks)
        raise


async def collect(chunks: AsyncIterator[GenerateChunk]) -> tuple[str, str, Usage, list[int], list | None]:
    """(text, finish reason, usage, token ids, logprob entries or None) of a whole generation."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list | None = None
    try:
        async for chunk in chunks:
            texts.append(chunk.text)
            token_ids += chunk.token_ids
            if chunk.logprobs is not None:
                logprobs = (logprobs or []) + chunk.logprobs
            if chunk.finish_reason is not None:
                return "".join(texts), finish_reason_of(chunk), chunk.usage or Usage(0, 0), token_ids, logprobs
        raise RuntimeError("the backend ended the stream without a finish reason")
    finally:
        with anyio.CancelScope(shield=True):
            await close_stream(chunks)


def finish_reason_of(chunk: GenerateChunk) -> str:
    if chunk.finish_reason == FinishReason.ABORT:
        raise RequestAborted("the request was aborted by the server")
    return FinishReason(chunk.finish_reason).value


async def close_stream(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.exception("error while closing a generation stream")
