"""AsyncCoreClient: the API process's side of an engine core in its own process.

The core process (core_loop.py) schedules and computes; this side does what is about
text and users: it registers each request's sequences with its own output processor
(detokenising, stop strings, logprobs, timings), sends the request as token ids, and
a reader thread turns each step's deltas into ``RequestOutput``s for the asyncio
streams. A stop string found here ends the sequence in the core with a "stop"
message. The core's gauges arrive with every message (``snapshot()``), so /metrics
never waits on the core.

    client = AsyncCoreClient(functools.partial(run_engine_core, args), tokenizer)
    async for out in client.generate("id-1", ids, SamplingParams(max_tokens=8)): ...

If the core process dies (or fails at start), every stream ends with EngineDeadError
and ``death`` says why; ``shutdown()`` stops it cleanly.

The pipe is a ``Channel`` (engine/pipe/channel.py): ``_send`` only queues a message for its
writer thread, so neither the event loop nor the reader thread ever waits on the core
reading, and the reader always drains what the core writes (issue 40: both sides in
``sendmsg`` at once locked the server for good). The core sends a heartbeat when it
has nothing else to say; a core silent for ``heartbeat_timeout`` seconds (stopped,
frozen) is killed and counted dead, so its requests get 503 and the server exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from tokenmill.engine.api.detokenizer import Decoder
from tokenmill.engine.api.output_processor import OutputProcessor
from tokenmill.engine.api.streams import Stream, Streams, resolve
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.pipe import messages as m
from tokenmill.engine.pipe.channel import Channel, ChannelClosed, ChannelTimeout
from tokenmill.engine.pipe.wire import WireDelta, delta_from_wire, error_from_wire
from tokenmill.engine.sequences import sequence_ids, step_params
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STEPS_KEPT = 2048  # traced steps nobody has taken: the oldest go first
HEARTBEAT_TIMEOUT_S = 30.0  # a core that sends nothing, not even its heartbeat, for this long is dead


class Tokenizer(Decoder, Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class AsyncCoreClient:
    def __init__(
        self,
        target: Callable[[Any], None],
        tokenizer: Tokenizer,
        start_timeout: float | None = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """Start the core process: ``target(conn)`` runs in it (spawned: a fresh
        interpreter, so no thread or lock of this process is inherited), and this waits
        until it says ready; a core that fails to start raises its error here."""
        self.streams = Streams()
        self.heartbeat_timeout = heartbeat_timeout
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self._lock = threading.Lock()  # outputs, streams and the pipe's sending end: asyncio and reader threads
        self._seq_ids: dict[str, list[str]] = {}  # request id -> its sequences, while it streams
        self._accepting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_types: dict[int, type] = {}  # what each pending call was: its result's type
        self._call_ids = itertools.count()
        self._snapshot = EngineSnapshot()
        self._kv_events: list[tuple[str, bytes]] = []  # the core's prefix-cache events, not taken yet
        self._steps: deque[dict] = deque(maxlen=STEPS_KEPT)  # steps the core traced, not taken yet
        self._stopping = False
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child,), name="tokenmill-engine-core")
        self.process.start()
        child.close()
        self._channel = Channel(self._conn, "tokenmill-api")
        try:
            self.info = self._wait_ready(start_timeout)
        except BaseException:  # a failed start, or Ctrl-C meanwhile: leave no process behind
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
            self._channel.close(0)
            raise
        self._reader = threading.Thread(target=self._read, name="tokenmill-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float | None) -> m.CoreInfo:
        if not self._conn.poll(timeout):  # the core's channel (and its heartbeat) starts once it is built
            raise TokenmillError(f"the engine core did not start within {timeout} s")
        try:
            msg = self._channel.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise TokenmillError(
                f"the engine core process exited at start (exit code {self.process.exitcode})"
            ) from None
        try:
            msg = m.check_ready(msg)
        except ValueError as e:
            self.process.kill()
            self.process.join(5)
            raise TokenmillError(str(e)) from None
        if isinstance(msg, m.Failed):
            self.process.join(10)
            raise (
                error_from_wire(msg.error)
                if msg.error.user
                else TokenmillError(f"the engine core failed: {msg.message}")
            )
        self._absorb(msg.report)
        return msg.info

    # ------------------------------------------------------------- asyncio side

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
        if isinstance(prompt, str):
            text, ids = prompt, await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            text, ids = None, list(prompt)
        seq_ids = sequence_ids(request_id, params.n)
        with self._lock:  # the reader's _fail_all holds it too: a request is failed by it or refused here
            if self.is_dead:
                raise EngineDeadError("the engine core is not running")
            if request_id in self._seq_ids:
                raise InvalidRequestError(f"duplicate request id {request_id!r}")
            for i, sid in enumerate(seq_ids):  # before the core can answer: no delta finds nobody
                self.outputs.add(sid, request_id, i, text, ids, step_params(params))
            self._seq_ids[request_id] = seq_ids
            self.streams.add(request_id, stream)
            self._accepting[request_id] = (stream.loop, accepted)
            try:
                sampling, pooling = (None, params) if isinstance(params, PoolingParams) else (params, None)
                self._send(m.Add(request_id, ids, sampling, pooling, lora))
            except EngineDeadError:
                self._forget(request_id)
                raise

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._forget(request_id)
            if not self.is_dead:
                try:
                    self._send(m.Abort(request_id))
                except EngineDeadError:  # nothing left to abort
                    pass

    def _forget(self, request_id: str) -> None:
        """Stop following a request (the caller holds the lock)."""
        self.streams.drop(request_id)
        self._accepting.pop(request_id, None)
        for sid in self._seq_ids.pop(request_id, ()):
            self.outputs.abort(sid)

    async def add_lora(self, name: str, path: str) -> None:
        """Serve an adapter: read and checked by the core off its step loop."""
        await self._call(lambda call_id: m.AddLora(call_id, name, path))

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda call_id: m.RemoveLora(call_id, name))

    # What an engine replica asks of its core (replicas/ray_serve.py):

    async def start_kv_events(self) -> None:
        """The prefix cache's changes recorded from now on (``take_kv_events``)."""
        await self._call(m.StartKvEvents)

    async def lora_hash_roots(self) -> dict[str, bytes | None]:
        return await self._call(m.LoraHashRoots)

    async def measure_load_price(self) -> dict[str, float]:
        """An idle core's price of load (``LoadPrice``'s fields)."""
        return await self._call(m.MeasureLoadPrice)

    async def export_kv(self, hashes: list[bytes]) -> tuple[int, bytes | None]:
        """The cached blocks of the leading ``hashes``: how many, and their raw bytes."""
        return await self._call(lambda call_id: m.ExportKv(call_id, hashes))

    async def import_kv(self, hashes: list[bytes], data: bytes) -> int:
        """Another engine's exported blocks cached here: how many were taken."""
        return await self._call(lambda call_id: m.ImportKv(call_id, hashes, data))

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        """The core's prefix-cache events received since the last call (after
        ``start_kv_events``), in order."""
        with self._lock:
            events, self._kv_events = self._kv_events, []
        return events

    async def start_step_trace(self) -> bool:
        await self._call(lambda call_id: m.StepTrace(call_id, True))
        return True

    async def stop_step_trace(self) -> None:
        await self._call(lambda call_id: m.StepTrace(call_id, False))
        self._steps.clear()

    def take_step_trace(self) -> list[dict]:
        steps = self._steps
        return [steps.popleft() for _ in range(len(steps))]

    async def block_states(self) -> bytes | None:
        return bytes(await self._call(m.BlockStates))

    async def _call(self, make: Callable[[int], Any]) -> Any:
        """Send the call ``make(call_id)`` builds; its reply's result, read by the call's type."""
        if self.is_dead:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        with self._lock:
            call_id = next(self._call_ids)
            msg = make(call_id)
            self._calls[call_id] = (loop, done)
            self._call_types[call_id] = type(msg)
            try:
                self._send(msg)
            except EngineDeadError:
                del self._calls[call_id], self._call_types[call_id]
                raise
        return await done

    def snapshot(self) -> EngineSnapshot:
        """The core's gauges as of its latest message."""
        return self._snapshot

    @property
    def death(self) -> BaseException | None:
        """What killed the engine core (None while it runs, and after a clean shutdown)."""
        return self.streams.death

    @property
    def is_dead(self) -> bool:
        return self.streams.death is not None or self._stopping

    @property
    def num_waiting(self) -> int:
        """Sequences queued and not yet running, counting those still on their way."""
        with self._lock:
            on_the_way = len(self._accepting)
        return self._snapshot.num_waiting + on_the_way

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the core process (it finishes its step, frees everything, exits)."""
        with self._lock:
            self._stopping = True
            if self.process.is_alive():
                try:
                    self._send(m.Shutdown())
                except EngineDeadError:
                    pass
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %s s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self._reader.join(timeout)
        self._channel.close(0)

    def _send(self, msg: Any) -> None:
        """Queue a message for the core (never waits for it to read); a core gone
        meanwhile is EngineDeadError."""
        try:
            self._channel.send(m.encode(msg))
        except ChannelClosed as e:
            raise EngineDeadError(f"the engine core process is gone ({e})") from None

    # ------------------------------------------------------------- reader thread

    def _read(self) -> None:
        def dead(msg: m.Dead) -> None:
            raise EngineDeadError(msg.message)

        def rejected(msg: m.Rejected) -> None:
            self._settle(self._accepting, msg.request_id, error_from_wire(msg.error))
            with self._lock:
                self._forget(msg.request_id)

        handlers: dict[type, Callable[[Any], None]] = {
            m.Out: lambda msg: self._on_outputs(msg.deltas),
            m.Accepted: lambda msg: self._settle(self._accepting, msg.request_id, None),
            m.Rejected: rejected,
            m.Reply: self._replied,
            m.Stats: lambda msg: None,  # the snapshot alone
            m.Dead: dead,
        }
        try:
            while True:
                msg = m.decode(self._channel.recv(self.heartbeat_timeout))
                handler = handlers.get(type(msg))
                if handler is None:
                    raise EngineDeadError(f"the engine core sent {type(msg).__name__} out of turn")
                if not isinstance(msg, m.Dead):
                    self._absorb(msg.report)
                handler(msg)
        except ChannelTimeout:
            silent = f"the engine core has not answered for {self.heartbeat_timeout:g} s (not even its heartbeat)"
            logger.error("%s; killing it", silent)
            self.process.kill()
            self.process.join(5)
            self._fail_all(EngineDeadError(silent))
        except (EOFError, OSError):
            if self._stopping:  # a clean stop: what still streams ends, nobody died
                self._fail_all(EngineDeadError("the engine was shut down"), dead=False)
                return
            self.process.join(2)
            self._fail_all(EngineDeadError(f"the engine core process died (exit code {self.process.exitcode})"))
        except BaseException as e:
            logger.error("engine core: %s", e)
            self._fail_all(e if isinstance(e, EngineDeadError) else EngineDeadError(f"{type(e).__name__}: {e}"))

    def _replied(self, msg: m.Reply) -> None:
        with self._lock:
            call = self._call_types.pop(msg.call_id, None)
        if msg.error is not None or call is None:
            self._settle(self._calls, msg.call_id, None if msg.error is None else error_from_wire(msg.error))
            return
        self._settle(self._calls, msg.call_id, None, m.result_of(call, msg.result))

    def _absorb(self, report: m.Report) -> None:
        """A message's gauges, and the prefix-cache events and traced steps riding with them."""
        if report.kv_events:
            with self._lock:
                self._kv_events.extend(report.kv_events)
        if report.steps:
            self._steps.extend(report.steps)
        self._snapshot = report.snapshot

    def _on_outputs(self, wire_deltas: list[WireDelta]) -> None:
        with self._lock:
            outputs, stopped = self.outputs.process([delta_from_wire(w) for w in wire_deltas])
            for seq_id, stop_string in stopped:
                self._send(m.Stop(seq_id, stop_string))
            for out in outputs:
                if not self.streams.deliver(out):  # its event loop has closed: nobody reads it
                    self._forget(out.request_id)
                    self._send(m.Abort(out.request_id))
                elif out.finished and out.request_id not in self.streams:  # its last sequence ended
                    self._seq_ids.pop(out.request_id, None)

    def _settle(self, waiting: dict, key: Any, error: BaseException | None, result: Any = None) -> None:
        with self._lock:
            entry = waiting.pop(key, None)
        if entry is not None:
            loop, fut = entry
            try:
                loop.call_soon_threadsafe(resolve, fut, error, result)
            except RuntimeError:  # its event loop has closed
                pass

    def _fail_all(self, error: BaseException, dead: bool = True) -> None:
        with self._lock:
            pending = list(self._accepting.items()) + list(self._calls.items())
            self._accepting.clear()
            self._calls.clear()
            self._call_types.clear()
            self._seq_ids.clear()
            self.streams.fail_all(error, dead)
        for _, (loop, fut) in pending:
            try:
                loop.call_soon_threadsafe(resolve, fut, error)
            except RuntimeError:
                pass
