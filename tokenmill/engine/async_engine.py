"""AsyncEngine: the engine loop on a background thread, outputs streamed to asyncio.

The loop thread owns the Engine: requests and aborts reach it through a command
queue, and each output is handed to the asyncio loop of the caller with
``call_soon_threadsafe``, so the event loop never blocks on a model step.

    engine = AsyncEngine(llm.engine)
    async for out in engine.generate("id-1", "Hello", SamplingParams(max_tokens=8)):
        print(out.delta_text, end="")

Once started, the loop thread is the engine's only driver: do not call
``llm.generate`` on the same engine until ``shutdown()``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tokenmill.engine.engine import Engine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # sequences (n) not finished yet, counted by the consumer
    undelivered: int = 0  # sequences whose last output the loop thread has not handed over yet

    def __post_init__(self) -> None:
        self.undelivered = self.remaining


class RequestFailedError(RuntimeError):
    """The model step failed for this request (the engine and other requests go on)."""


class StreamingFront:
    """What both engine fronts share (the threaded ``AsyncEngine`` here, the process
    client in core_client.py): one asyncio queue per request, filled from another
    thread, and the rules of a stream: the caller's ``generate`` raises the engine's
    InvalidRequestError before any output, leaving the loop early aborts the request,
    and a dead engine fails every stream with EngineDeadError."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, lora: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; leaving the loop early aborts it."""
        if self.is_dead:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.n)
        accepted: asyncio.Future = loop.create_future()
        await self._submit(request_id, prompt, params, lora, stream, accepted)
        try:
            await accepted  # raises the engine's InvalidRequestError for a bad request
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
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
                self.abort(request_id)

    async def _submit(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, lora: str | None,
                      stream: _Stream, accepted: asyncio.Future) -> None:  # fmt: skip
        """Hand the request to the engine; resolve ``accepted`` once it is queued (or refused)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def add_lora(self, name: str, path: str) -> None:
        raise NotImplementedError

    async def remove_lora(self, name: str) -> None:
        raise NotImplementedError

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters (metrics, served adapters)."""
        raise NotImplementedError

    async def start_step_trace(self) -> bool:
        """Have the engine record each step's batch (EngineCore.start_step_trace) for a
        live view; False where this front cannot (engine replicas)."""
        return False

    async def stop_step_trace(self) -> None:
        """Stop recording steps (nobody watches)."""

    def take_step_trace(self) -> list[dict]:
        """The steps recorded since the last call, oldest first."""
        return []

    async def block_states(self) -> bytes | None:
        """One byte per KV block (block_pool.block_states); None where this front cannot."""
        return None

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    def shutdown(self, timeout: float | None = 10.0) -> None:
        raise NotImplementedError

    @property
    def death(self) -> BaseException | None:
        """What killed the engine (None while it runs, and after a clean shutdown)."""
        return self._dead

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def _deliver(self, out: RequestOutput) -> bool:
        """Hand one output to its stream (from the engine's thread); False when its
        event loop has closed (the server is stopping: nobody reads it)."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return True
        if out.finished:  # n > 1: the stream ends with the last of its sequences, whatever the step
            stream.undelivered -= 1
            if stream.undelivered == 0:
                self._streams.pop(out.request_id, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:
            self._streams.pop(out.request_id, None)
            return False
        return True

    def _fail_all(self, error: BaseException, dead: bool = True) -> None:
        """End every stream with EngineDeadError; ``dead``: the engine died of ``error``
        (not a clean stop)."""
        if dead:
            self._dead = error
        for rid, s in list(self._streams.items()):
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineDeadError(f"engine loop died: {error}"))
            except RuntimeError:
                pass
            self._streams.pop(rid, None)


class AsyncEngine(StreamingFront):
    """The engine loop on a thread of this process (the offline engine, driven for asyncio)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def _submit(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, lora: str | None,
                      stream: _Stream, accepted: asyncio.Future) -> None:  # fmt: skip
        grammar = None
        if params.structured is not None:  # compiled on the engine's compile thread: it stalls no step
            structured = self.engine.structured
            try:  # a timeout cancels a compile still queued; one running goes on, and is cached
                grammar = await asyncio.wait_for(asyncio.wrap_future(structured.submit(params.structured)),
                                                 structured.compile_timeout)  # fmt: skip
            except TimeoutError:
                raise structured.timeout_error(params.structured) from None
        self._commands.put(("add", request_id, prompt, params, grammar, lora, stream, accepted))
        self._wake.set()
        self._unless_dead(accepted)

    async def add_lora(self, name: str, path: str) -> None:
        """Serve an adapter: read and checked in a worker thread, then handed to the loop
        thread, which owns the engine (requests keep running meanwhile)."""
        if self.is_dead:
            raise EngineDeadError("the engine loop is not running")
        with self.engine.new_lora_name(name):  # a new name only: of concurrent loads, one goes on
            loaded = await asyncio.to_thread(self.engine.load_lora, name, path)
            await self.run_on_loop(lambda: self.engine.add_lora(name, path, loaded))

    async def remove_lora(self, name: str) -> None:
        await self.run_on_loop(lambda: self.engine.remove_lora(name))

    async def run_on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop thread, between steps (that thread owns the engine); its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("call", fn, loop, done))
        self._wake.set()
        self._unless_dead(done)
        return await done

    def _unless_dead(self, fut: asyncio.Future) -> None:
        """A command queued after the loop died is read by nobody: answer it here (one
        queued before is answered by the dying loop's drain)."""
        if self._dead is not None:
            _resolve(fut, EngineDeadError(f"the engine loop died: {self._dead}"))

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self._stopped.is_set()

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges now (read from another thread: each value is current, the
        set is not one instant's)."""
        return self.engine.snapshot()

    async def start_step_trace(self) -> bool:
        await self.run_on_loop(self.engine.start_step_trace)
        return True

    async def stop_step_trace(self) -> None:
        await self.run_on_loop(self.engine.stop_step_trace)

    def take_step_trace(self) -> list[dict]:
        return self.engine.take_step_trace()  # pops whole steps: safe beside the loop thread

    async def block_states(self) -> bytes | None:
        return await self.run_on_loop(self.engine.block_states)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (an estimate read from another thread)."""
        return self.engine.num_waiting + self._commands.qsize()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)

    # -------------------------------------------------------------- loop thread

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # a bug in the loop itself: fail every stream
            logger.exception("engine loop died")
            self._fail_all(e)
            self._refuse_queued(e)

    def _refuse_queued(self, error: BaseException) -> None:
        """The loop has died: every command still queued (a request, a LoRA call) gets
        EngineDeadError now instead of waiting for a loop that will never read it."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "call"):
                loop, fut = (cmd[6].loop, cmd[7]) if cmd[0] == "add" else (cmd[2], cmd[3])
                try:
                    loop.call_soon_threadsafe(_resolve, fut, EngineDeadError(f"the engine loop died: {error}"))
                except RuntimeError:  # its event loop has closed
                    pass

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, grammar, lora, stream, accepted = cmd
                try:
                    self.engine.add_request(rid, prompt, params, grammar=grammar, lora=lora)
                    self._streams[rid] = stream
                    stream.loop.call_soon_threadsafe(_resolve, accepted, None)
                except Exception as e:  # invalid request: its caller gets the error
                    stream.loop.call_soon_threadsafe(_resolve, accepted, e)
            elif cmd[0] == "call":  # a change to the engine, made between steps
                _, fn, loop, done = cmd
                try:
                    result = fn()
                    loop.call_soon_threadsafe(_resolve, done, None, result)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    loop.call_soon_threadsafe(_resolve, done, e)
            else:
                self.engine.abort(cmd[1])
                self._streams.pop(cmd[1], None)

    def _deliver(self, out: RequestOutput) -> bool:
        if not super()._deliver(out):
            self.engine.abort(out.request_id)
            return False
        return True


def _resolve(fut: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    if fut.done():  # the caller went away meanwhile
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
