"""A message channel over a pipe that cannot deadlock, for the API process and the core.

Two processes that each write to a pipe before reading from it lock up for good once
both pipes are full: the API process's event loop sat in ``sendmsg`` with 10,000
embedding requests to hand over while the core sat in ``sendmsg`` with their results,
each waiting for the other to read (issue 40). Here nobody who reads ever waits on a
write:

- ``send`` only queues the message; a writer thread of its own does the blocking
  writes. On the API side the queue is unbounded (what it holds is bounded by the
  server's admission limits) so the event loop never waits; the core side passes
  ``max_queued_bytes`` so that a core far ahead of a slow reader waits in ``send``
  (its reader thread goes on draining the commands meanwhile).
- ``recv`` is called by a thread that does nothing else that can block on the other
  side (core_client.py's reader, or ``start_reader``'s thread here, which drains into
  a queue): so the other side's writes always complete.
- A message crosses in frames of at most ``FRAME_BYTES`` (the first byte says whether
  more follow), so no single write is unbounded, however big a request or a step's
  output.
- The writer sends a heartbeat frame when it has sent nothing for ``heartbeat_s``;
  ``recv(timeout)`` raises ``ChannelTimeout`` when nothing at all came for that long,
  which is how the API process notices a core that stopped answering (stopped, frozen,
  swapped out) rather than waiting forever.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.engine.pipe.wire import pack, unpack

FRAME_BYTES = 1 << 20
HEARTBEAT_S = 1.0
_MORE, _LAST, _BEAT = b"M", b"L", b"H"


class ChannelClosed(OSError):
    """The pipe is closed or broken: the other process is gone (or this side closed it)."""


class ChannelTimeout(TimeoutError):
    """Nothing, not even a heartbeat, came from the other side within the timeout."""


class Channel:
    def __init__(
        self, conn: Connection, name: str, heartbeat_s: float = HEARTBEAT_S, max_queued_bytes: int | None = None
    ) -> None:
        self.conn = conn
        self.heartbeat_s = heartbeat_s
        self.max_queued_bytes = max_queued_bytes
        self.last_heard = time.monotonic()  # when a frame last arrived
        self._out: deque[bytes] = deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._closing = False
        self._broken: BaseException | None = None  # why writing failed
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ sending

    def send(self, msg: list[Any]) -> None:
        """Queue ``msg`` for the writer thread. Never waits for the other side to read,
        except with ``max_queued_bytes`` while that much is already queued."""
        data = pack(msg)
        with self._cv:
            while (
                self.max_queued_bytes is not None
                and self._queued_bytes > self.max_queued_bytes
                and self._broken is None
                and not self._closing
            ):
                self._cv.wait()
            if self._broken is not None:
                raise ChannelClosed(f"the pipe is broken ({type(self._broken).__name__})")
            if self._closing:
                raise ChannelClosed("the channel is closed")
            self._out.append(data)
            self._queued_bytes += len(data)
            self._cv.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                if not self._out and not self._closing:
                    self._cv.wait(self.heartbeat_s)
                if not self._out:
                    if self._closing:
                        return
                    data = None  # a heartbeat: nothing was sent for heartbeat_s
                else:
                    data = self._out[0]
            try:
                if data is None:
                    self.conn.send_bytes(_BEAT)
                    continue
                for start in range(0, len(data), FRAME_BYTES):
                    end = start + FRAME_BYTES
                    self.conn.send_bytes((_LAST if end >= len(data) else _MORE) + data[start:end])
            except (OSError, ValueError) as e:  # the other side is gone, or the pipe closed here
                with self._cv:
                    self._broken = e
                    self._out.clear()
                    self._queued_bytes = 0
                    self._cv.notify_all()
                return
            with self._cv:
                self._out.popleft()
                self._queued_bytes -= len(data)
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close the pipe."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout)
        self.conn.close()

    # ------------------------------------------------------------------ receiving

    def recv(self, timeout: float | None = None) -> list[Any]:
        """The next message, put together from its frames. ``ChannelTimeout`` when no
        frame at all arrived for ``timeout`` seconds; ``EOFError``/``OSError`` when the
        other side has closed. One thread only may call it."""
        parts: list[bytes] = []
        while True:
            if timeout is not None and not self.conn.poll(timeout):
                raise ChannelTimeout(f"nothing received for {timeout:g} s")
            frame = self.conn.recv_bytes()
            self.last_heard = time.monotonic()
            kind = frame[:1]
            if kind == _BEAT:
                continue
            parts.append(frame[1:])
            if kind == _LAST:
                return unpack(parts[0] if len(parts) == 1 else b"".join(parts))

    def start_reader(self, inbox: queue.SimpleQueue) -> threading.Thread:
        """A thread that drains every message into ``inbox`` as it arrives, then puts
        ``None`` once the other side has closed (the core side's reader)."""

        def drain() -> None:
            try:
                while True:
                    inbox.put(self.recv())
            except (EOFError, OSError):
                inbox.put(None)

        thread = threading.Thread(target=drain, name="tokenmill-channel-reader", daemon=True)
        thread.start()
        return thread
