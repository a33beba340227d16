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
from typing import TypeVar

from tokenmill.engine.api.streams import Stream, Streams, resolve
from tokenmill.engine.engine import Engine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """The engine loop on a thread of this process (the offline engine, driven for asyncio);
    a ``StreamingFront`` (engine/api/streams.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.streams = Streams()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; leaving the loop early aborts it."""

        async def submit(stream: Stream, accepted: asyncio.Future) -> None:
            await self._submit(request_id, prompt, params, lora, stream, accepted)

        return self.streams.follow(request_id, params.n, submit, self.abort, lambda: self.is_dead)

    async def _submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None,
        stream: Stream,
        accepted: asyncio.Future,
    ) -> None:
        grammar = None
        if (
            isinstance(params, SamplingParams) and params.structured is not None
        ):  # compiled on the engine's compile thread: it stalls no step
            structured = self.engine.core.structured
            try:  # a timeout cancels a compile still queued; one running goes on, and is cached
                grammar = await asyncio.wait_for(
                    asyncio.wrap_future(structured.submit(params.structured)), structured.compile_timeout
                )
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
        with self.engine.core.new_lora_name(name):  # a new name only: of concurrent loads, one goes on
            loaded = await asyncio.to_thread(self.engine.core.load_lora, name, path)
            await self.run_on_loop(lambda: self.engine.core.add_lora(name, path, loaded))

    async def remove_lora(self, name: str) -> None:
        await self.run_on_loop(lambda: self.engine.core.remove_lora(name))

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
        if self.streams.death is not None:
            resolve(fut, EngineDeadError(f"the engine loop died: {self.streams.death}"))

    @property
    def death(self) -> BaseException | None:
        return self.streams.death

    @property
    def is_dead(self) -> bool:
        return self.streams.death is not None or self._stopped.is_set()

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges now (read from another thread: each value is current, the
        set is not one instant's)."""
        return self.engine.core.snapshot()

    async def start_step_trace(self) -> bool:
        await self.run_on_loop(self.engine.core.tracer.start)
        return True

    async def stop_step_trace(self) -> None:
        await self.run_on_loop(self.engine.core.tracer.stop)

    def take_step_trace(self) -> list[dict]:
        return self.engine.core.tracer.take()  # pops whole steps: safe beside the loop thread

    async def block_states(self) -> bytes | None:
        return await self.run_on_loop(self.engine.core.block_states)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (an estimate read from another thread)."""
        return self.engine.core.num_waiting + self._commands.qsize()

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
            self.streams.fail_all(e)
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
                    loop.call_soon_threadsafe(resolve, fut, EngineDeadError(f"the engine loop died: {error}"))
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
                    self.streams.add(rid, stream)
                    stream.loop.call_soon_threadsafe(resolve, accepted, None)
                except Exception as e:  # invalid request: its caller gets the error
                    stream.loop.call_soon_threadsafe(resolve, accepted, e)
            elif cmd[0] == "call":  # a change to the engine, made between steps
                _, fn, loop, done = cmd
                try:
                    result = fn()
                    loop.call_soon_threadsafe(resolve, done, None, result)
                except Exception as e:
                    loop.call_soon_threadsafe(resolve, done, e)
            else:
                self.engine.abort(cmd[1])
                self.streams.drop(cmd[1])

    def _deliver(self, out: RequestOutput) -> bool:
        if not self.streams.deliver(out):  # its event loop has closed: nobody reads it
            self.engine.abort(out.request_id)
            return False
        return True
