"""The engine core's loop in its own process: commands in, one message per step out.

The process owns the ``EngineCore`` (scheduler, KV blocks, runner) and nothing else:
no HTTP, no JSON, no text. Each turn it applies every command waiting on the pipe,
starts what finished compiling, runs one step if anything is unfinished, and sends
that step's deltas with a snapshot of the engine's gauges. Idle, it blocks on the
pipe (no polling). Grammars are compiled on the engine's compile thread and LoRA
adapters read on a worker thread, so a big schema or a slow disk never stalls the
steps of other requests; a grammar not compiled within its timeout is refused.

The pipe carries typed messages (engine/pipe/messages.py) as msgpack through a ``Channel`` (engine/pipe/channel.py): a
reader thread drains the commands into a queue as they arrive and a writer thread
sends, so this loop never waits on the API process reading, nor the API process on
this loop (the deadlock of issue 40). The pipe closing means the API process is gone:
the loop ends, and so does the process.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.core.load_price import measure_load_price
from tokenmill.engine.pipe import messages as m
from tokenmill.engine.pipe.channel import Channel
from tokenmill.engine.pipe.wire import delta_to_wire, error_to_wire
from tokenmill.errors import InvalidRequestError

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.01  # how often an idle loop looks at work prepared by its thread
SNAPSHOT_EVERY_S = 0.5  # steps that yield no token (prompt chunks) send the gauges at most this often
MAX_QUEUED_BYTES = 64 << 20  # a core this far ahead of the API process's reading waits for it


@dataclass
class _Pending:
    """Work prepared off the loop (a grammar compiled, an adapter read), applied on it."""

    future: Future
    apply: Callable[[Any], None]  # with the prepared value, on the loop
    fail: Callable[[BaseException], None]
    request_id: str | None = None  # an add: an abort meanwhile drops it
    deadline: float | None = None  # time.monotonic() past which it fails (a grammar's compile timeout)
    expired: Callable[[], BaseException] | None = None  # what it fails with then


class CoreLoop:
    def __init__(self, core: EngineCore, channel: Channel) -> None:
        self.core = core
        self.channel = channel
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands, drained from the pipe as they arrive
        channel.start_reader(self.inbox)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-prepare")
        self.pending: list[_Pending] = []
        self.running = True
        self.last_snapshot = 0.0  # time.monotonic() of the last gauges sent
        self._handlers: dict[type, Callable[[Any], None]] = {
            m.Add: self._add,
            m.Abort: self._abort,
            m.Stop: self._stop,
            m.AddLora: self._add_lora,  # its read runs on the worker thread
            m.Shutdown: self._shutdown,
        }
        # The calls answered between steps: call -> its result (of the call's RESULT type).
        answers: dict[type, Callable[[Any], Any]] = {
            m.RemoveLora: lambda c: core.remove_lora(c.name),
            m.StartKvEvents: lambda c: core.kv_transfer.start_events(),
            m.StepTrace: lambda c: core.tracer.start() if c.on else core.tracer.stop(),
            m.MeasureLoadPrice: lambda c: asdict(measure_load_price(core)),  # a replica starting: its parts
            m.BlockStates: lambda c: core.block_states(),
            m.LoraHashRoots: lambda c: {name: core.lora_hash_root(name) for name in core.loras},
            m.ExportKv: lambda c: _exported(*core.kv_transfer.export(c.hashes)),
            m.ImportKv: lambda c: core.kv_transfer.load(c.hashes, c.data),
        }
        for call, answer in answers.items():
            self._handlers[call] = functools.partial(self._answer, answer)

    def send(self, msg: Any) -> None:
        self.channel.send(m.encode(msg))

    def report(self) -> m.Report:
        """The gauges, and when they are recorded, the prefix cache's events since the last
        message (``start_kv_events``: a replica's router follows them) and the steps
        traced (``start_step_trace``: the server's live view draws them)."""
        return m.Report(self.core.snapshot(), self.core.kv_transfer.take_events(), self.core.tracer.take())

    def run(self) -> None:
        try:
            while self.running:
                busy = self.core.has_unfinished()
                changed = self._apply_commands(block=not busy)
                changed |= self._apply_prepared()
                if self.core.has_unfinished():
                    deltas = self.core.run_step()
                    if deltas:
                        self.send(m.Out([delta_to_wire(d) for d in deltas], self.report()))
                        self.last_snapshot = time.monotonic()
                        continue
                    changed |= time.monotonic() - self.last_snapshot > SNAPSHOT_EVERY_S  # a long prefill: gauges move
                if changed:
                    self.send(m.Stats(self.report()))
                    self.last_snapshot = time.monotonic()
        except (EOFError, OSError):  # the API process is gone: nobody to serve
            logger.info("engine core: the API process closed the pipe; stopping")
        except BaseException as e:
            logger.exception("engine core loop died")
            try:
                self.send(m.Dead(f"{type(e).__name__}: {e}"))
            except OSError:
                pass
            raise
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ commands

    def _apply_commands(self, block: bool) -> bool:
        """Apply every command waiting; idle (``block``), wait for the first one, or for
        IDLE_POLL_S while work is being prepared on the thread."""
        timeout = (IDLE_POLL_S if self.pending else None) if block else 0.0
        changed = False
        while self.running:
            try:
                msg = self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg is None:
                raise EOFError("the API process closed the pipe")
            self._command(msg)
            changed = True
            timeout = 0.0
        return changed

    def _command(self, wire: list) -> None:
        try:
            msg = m.decode(wire)
        except InvalidRequestError as e:  # a request whose parameters fail their checks here: refused
            if wire[0] != m.Add.TAG or not isinstance(wire[1], str):
                raise
            self.send(m.Rejected(wire[1], error_to_wire(e), self.report()))
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ValueError(f"the engine core takes no {type(msg).__name__} message")
        handler(msg)

    def _abort(self, msg: m.Abort) -> None:
        self.pending = [p for p in self.pending if p.request_id != msg.request_id]
        self.core.abort(msg.request_id)

    def _stop(self, msg: m.Stop) -> None:
        self.core.finish_stopped(msg.seq_id, msg.stop_string)

    def _shutdown(self, _: m.Shutdown) -> None:
        self.running = False

    def _add(self, msg: m.Add) -> None:
        rid, prompt_ids, lora = msg.request_id, msg.prompt_ids, msg.lora

        def fail(e: BaseException) -> None:
            self.send(m.Rejected(rid, error_to_wire(e), self.report()))

        def add(grammar: Any) -> None:
            try:
                self.core.add_request(rid, prompt_ids, params, grammar=grammar, lora=lora)
            except Exception as e:
                fail(e)
                return
            self.send(m.Accepted(rid, self.report()))

        if (msg.params is None) == (msg.pooling is None):
            fail(InvalidRequestError("a request takes sampling or pooling parameters, one of the two"))
            return
        params = msg.params or msg.pooling
        if msg.params is None or msg.params.structured is None:  # an embedding has no grammar
            add(None)
            return
        structured, spec = self.core.structured, msg.params.structured
        try:  # on the engine's compile thread: it stalls no step, and LoRA reads do not wait behind it
            future = structured.submit(spec)
        except InvalidRequestError as e:
            fail(e)
            return
        deadline = time.monotonic() + structured.compile_timeout
        self.pending.append(_Pending(future, add, fail, rid, deadline, lambda: structured.timeout_error(spec)))

    def _reply(self, call_id: int, error: BaseException | None = None, result: Any = None) -> None:
        self.send(m.Reply(call_id, None if error is None else error_to_wire(error), result, self.report()))

    def _answer(self, answer: Callable[[Any], Any], call: Any) -> None:
        """A call answered now: its result, or the error it raised, in its Reply."""
        try:
            result = answer(call)
        except Exception as e:
            self._reply(call.call_id, e)
            return
        self._reply(call.call_id, None, None if type(call).RESULT is None else result)

    def _add_lora(self, call: m.AddLora) -> None:
        """A new name only (the server's loads): of concurrent loads of one name, one wins; the
        adapter is read on the worker thread and served between steps once read."""
        held = self.core.new_lora_name(call.name)
        try:
            held.__enter__()  # refuses a name served or being read; released when the read ends, either way
        except Exception as e:
            self._reply(call.call_id, e)
            return

        def served(loaded: Any) -> None:
            held.__exit__(None, None, None)
            try:
                self.core.add_lora(call.name, call.path, loaded)
            except Exception as e:
                self._reply(call.call_id, e)
                return
            self._reply(call.call_id)

        def failed(e: BaseException) -> None:
            held.__exit__(None, None, None)
            self._reply(call.call_id, e)

        self.pending.append(_Pending(self.pool.submit(self.core.load_lora, call.name, call.path), served, failed))

    def _apply_prepared(self) -> bool:
        now = time.monotonic()
        done, expired, waiting = [], [], []
        for p in self.pending:
            if p.future.done():
                done.append(p)
            elif p.deadline is not None and now > p.deadline:
                expired.append(p)
            else:
                waiting.append(p)
        if not done and not expired:
            return False
        self.pending = waiting
        for p in expired:  # a compile still queued is dropped; one running goes on, and is cached
            p.future.cancel()
            p.fail(p.expired())
        for p in done:
            error = p.future.exception()
            if error is not None:
                p.fail(error)
                continue
            try:
                p.apply(p.future.result())
            except Exception as e:
                p.fail(e)
        return True


def serve_core(build: Callable[[], tuple[EngineCore, m.CoreInfo, Callable[[], None]]], conn: Connection) -> int:
    """The body of the engine-core process: build the core (``build`` returns it, what
    the API process should know of it, and how to release it), say ready, loop."""
    try:
        core, info, close = build()
    except BaseException as e:
        channel = Channel(conn, "tokenmill-core")
        try:
            channel.send(m.encode(m.Failed(str(e) or type(e).__name__, error_to_wire(e))))
        finally:
            channel.close()
        return 1
    channel = Channel(conn, "tokenmill-core", max_queued_bytes=MAX_QUEUED_BYTES)
    try:
        loop = CoreLoop(core, channel)
        channel.send(m.encode(m.Ready(m.WIRE_VERSION, info, loop.report())))
        loop.run()
        return 0
    except BaseException:
        return 1
    finally:
        close()
        channel.close()


def _exported(n: int, data: Any) -> tuple[int, bytes | None]:
    """``KVTransfer.export``'s result as ``ExportKv`` answers it: (blocks, their raw bytes or None)."""
    return n, None if data is None else data.numpy().tobytes()
