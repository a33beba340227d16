"""How a request's engine streams reach its client: merged (several prompts, or a
round of beams), chained after an output already read, cut when the shutdown's drain
timeout passes (``DrainExpired``: the SSE writers then end with an error event), and,
for an answer that is not streamed, cancelled when the client goes away, which aborts
its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.outputs import RequestOutput


class DrainExpired(Exception):
    """The shutdown's drain timeout passed while this stream was open."""


async def until(items: AsyncIterator, stop: asyncio.Event) -> AsyncIterator:
    """items, until stop is set (then DrainExpired). Each next item is awaited in a
    task of its own; whatever ends this generator (the stop, a client that went away,
    an error) cancels and waits out that task first, so that the caller can then close
    ``items`` (it is no longer running)."""
    stopped = asyncio.ensure_future(stop.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                raise DrainExpired
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        stopped.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)


async def chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def merge(
    streams: list[AsyncIterator[RequestOutput]],
    place: Callable[[], AbstractAsyncContextManager] | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as (stream index, output). Closing the merged
    stream (or cancelling its reader) cancels every pump, which aborts its request.
    With ``place`` (the client's window: admission.py), each stream starts only once it
    holds a place, and keeps it until it ends."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async with place() if place is not None else contextlib.nullcontext():
                async for out in s:
                    await queue.put((i, out))
            await queue.put(done)
        except BaseException as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await a non-streamed response, cancelling it (and so aborting its requests) if
    the client disconnects first."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=0.25)
        except TimeoutError:
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
    return task.result()
