"""Request streams, what every engine front shares: one asyncio queue per request, filled
from another thread (the engine loop's, or the reader of the engine-core process's pipe),
and the rules of a stream: ``generate`` raises the engine's InvalidRequestError before any
output, leaving the loop early aborts the request, and a dead engine fails every stream
with EngineDeadError.

``StreamingFront`` is what the HTTP app streams from (a Protocol: the threaded
``AsyncEngine``, the process client ``AsyncCoreClient``, Ray Serve's ``RayReplicaFront``);
each front holds a ``Streams`` for its requests rather than inheriting one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class Stream:
    """One request's queue of outputs and the event loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # sequences (n) not finished yet, counted by the consumer
    undelivered: int = 0  # sequences whose last output the engine's thread has not handed over yet

    def __post_init__(self) -> None:
        self.undelivered = self.remaining


class RequestFailedError(RuntimeError):
    """The model step failed for this request (the engine and other requests go on)."""


def resolve(fut: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    """Settle ``fut`` (on its own loop) unless its caller went away meanwhile."""
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


# Hand a request to the engine; resolve the future once it is queued (or refused).
Submit = Callable[[Stream, asyncio.Future], Awaitable[None]]


class Streams:
    """The open streams of one front's requests, by request id, and what killed the engine."""

    def __init__(self) -> None:
        self._open: dict[str, Stream] = {}
        self.death: BaseException | None = None  # None while the engine runs, and after a clean stop

    def add(self, request_id: str, stream: Stream) -> None:
        self._open[request_id] = stream

    def drop(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    async def follow(
        self, request_id: str, n: int, submit: Submit, abort: Callable[[str], None], is_dead: Callable[[], bool]
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request of ``n`` sequences, submitted by ``submit``; leaving
        the loop early calls ``abort``."""
        if is_dead():
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream = Stream(loop, asyncio.Queue(), n)
        accepted: asyncio.Future = loop.create_future()
        await submit(stream, accepted)
        try:
            await accepted  # raises the engine's InvalidRequestError for a bad request
        except asyncio.CancelledError:
            abort(request_id)  # it may have been added meanwhile
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise RequestFailedError(f"request {request_id} failed: {item.error}")
                yield item
                if item.finished:
                    stream.remaining -= 1
                    if stream.remaining == 0:
                        finished = True
                        return
        finally:
            if not finished:
                abort(request_id)

    def deliver(self, out: RequestOutput) -> bool:
        """Hand one output to its stream (from the engine's thread); False when its event
        loop has closed (the server is stopping: nobody reads it)."""
        stream = self._open.get(out.request_id)
        if stream is None:
            return True
        if out.finished:  # n > 1: the stream ends with the last of its sequences, whatever the step
            stream.undelivered -= 1
            if stream.undelivered == 0:
                self._open.pop(out.request_id, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:
            self._open.pop(out.request_id, None)
            return False
        return True

    def fail_all(self, error: BaseException, dead: bool = True) -> None:
        """End every stream with EngineDeadError; ``dead``: the engine died of ``error``
        (not a clean stop)."""
        if dead:
            self.death = error
        for rid, s in list(self._open.items()):
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineDeadError(f"engine loop died: {error}"))
            except RuntimeError:
                pass
            self._open.pop(rid, None)


class StreamingFront(Protocol):
    """What the HTTP app streams from and manages an engine by."""

    def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; leaving the loop early aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def add_lora(self, name: str, path: str) -> None: ...

    async def remove_lora(self, name: str) -> None: ...

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters (metrics, served adapters)."""
        ...

    async def start_step_trace(self) -> bool:
        """Have the engine record each step's batch (engine/core/step_trace.py) for a
        live view; False where this front cannot (engine replicas)."""
        ...

    async def stop_step_trace(self) -> None:
        """Stop recording steps (nobody watches)."""
        ...

    def take_step_trace(self) -> list[dict]:
        """The steps recorded since the last call, oldest first."""
        ...

    async def block_states(self) -> bytes | None:
        """One byte per KV block (block_pool.block_states); None where this front cannot."""
        ...

    @property
    def num_waiting(self) -> int: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...

    @property
    def death(self) -> BaseException | None:
        """What killed the engine (None while it runs, and after a clean shutdown)."""
        ...

    @property
    def is_dead(self) -> bool: ...
