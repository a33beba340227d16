"""The chat templates requests bring (``--trust-request-chat-template``), rendered in a
few worker processes with limits, so that a hostile one costs its client a 400 and the
server nothing (issue 57: one ``{{ 'a' * 10**9 }}`` ended a server, seven endless loops
held every tokenising thread for good, SIGTERM included).

``RequestTemplates`` owns ``--request-template-workers`` workers (model/chat_template.py's
``serve_renders``, each a spawned process: a fresh interpreter that imports jinja2, not
the server). A request takes a free worker (waiting up to the timeout, then 429), and
its prompt is built on a thread of the pool's own, never the threads that tokenise
other requests: the messages marked (chat_guard.py), the template rendered by the
worker, the text tokenised. A render that passes ``--request-template-timeout`` has
its worker killed (a thread cannot be stopped; a process can) and is a 400; a worker is
started on first use and again after it is stopped, so that a server with the flag and
no such requests runs no extra process. The tokenizer's own template never comes here:
it renders in process, as before.

Each worker dies with the server however it ends (host/lifetime.py), and ``close`` (the
server's shutdown) or the pool's garbage collection kills them at once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.configuration.memory import parse_memory
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.model.chat_template import Rendered, RenderJob, TemplateLimits, serve_renders
from tokenmill.model.tokenizer import Render
from tokenmill.server.protocol.error_responses import APIError

START_TIMEOUT_S = 60.0  # a worker's start: a fresh interpreter importing jinja2 (well under a second)
T = TypeVar("T")


class _Worker:
    """One render process, used by one thread at a time."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.process: Any = None  # multiprocessing's spawned Process, while it runs
        self.conn: Any = None

    def render(self, template: str, context: dict[str, Any]) -> str:
        """``template`` rendered with ``context`` in this worker, within its limits; a breach
        is an ``InvalidRequestError`` naming it (the worker stopped where it must be)."""
        conn = self._started()
        timeout = self.limits.timeout
        try:
            conn.send(RenderJob(template, context))
            answered = conn.poll(timeout)
        except OSError:  # the worker went between two renders
            answered = True  # (recv says how)
        if not answered:
            self.stop()
            raise InvalidRequestError(
                f"chat_template did not render within {timeout:g} s (--request-template-timeout); its render was stopped",
                param="chat_template",
            )
        try:
            answer: Rendered = conn.recv()
        except (EOFError, OSError):
            code = self.stop()
            raise InvalidRequestError(
                f"chat_template's render ended its worker process (exit code {code}: out of memory?)",
                param="chat_template",
            ) from None
        if answer.exiting:
            self.stop()
        if answer.error is not None:
            raise InvalidRequestError(answer.error, param="chat_template")
        return answer.text

    def _started(self) -> Any:
        if self.process is not None and self.process.is_alive():
            return self.conn
        self.stop()
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(
            target=serve_renders, args=(child, self.limits, os.getpid()), name="tokenmill-template", daemon=True
        )
        try:
            process.start()
        finally:
            child.close()
        self.process, self.conn = process, conn
        try:
            ready = self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == Rendered()
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = self.stop()
            raise APIError(503, f"the chat template worker did not start (exit code {code})")
        return self.conn

    def stop(self) -> int | None:
        """Kill the process (if any) and forget it; its exit code."""
        process, conn, self.process, self.conn = self.process, self.conn, None, None
        code = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(5)
            code = process.exitcode
        if conn is not None:
            conn.close()
        return code


class RequestTemplates:
    """Renders request chat templates, ``workers`` at a time, each in a worker process
    with ``limits`` (the module's docstring). One event loop's."""

    def __init__(self, limits: TemplateLimits, workers: int) -> None:
        self.limits = limits
        self._workers = [_Worker(limits) for _ in range(workers)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._idle.put_nowait(worker)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="tokenmill-template")
        self._close = weakref.finalize(self, _stop_all, self._workers, self._threads)

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestTemplates | None:
        """The pool ``config`` asks for; None when the server takes no request templates."""
        if not config.trust_request_chat_template:
            return None
        limits = TemplateLimits(
            config.request_template_timeout,
            parse_memory(config.request_template_memory),
            config.request_template_max_chars,
        )
        return cls(limits, config.request_template_workers)

    async def run(self, build: Callable[[Render], T]) -> T:
        """``build(render)`` on a thread of the pool's, ``render`` rendering in a worker held
        for this call alone: a prompt built around one render (marked, rendered, tokenised).
        429 when no worker is free within the timeout."""
        try:
            async with asyncio.timeout(self.limits.timeout):
                worker = await self._idle.get()
        except TimeoutError:
            raise APIError(
                429,
                f"all {len(self._workers)} chat template workers are busy (--request-template-workers); retry later",
                "chat_template",
            ) from None
        loop = asyncio.get_running_loop()

        def work() -> T:
            try:
                return build(worker.render)
            finally:  # back to the pool even when the request has gone meanwhile
                try:
                    loop.call_soon_threadsafe(self._idle.put_nowait, worker)
                except RuntimeError:  # the loop is closed: the server is stopping
                    pass

        return await loop.run_in_executor(self._threads, work)

    def close(self) -> None:
        """Kill the workers (a render in flight ends with a 400); the pool takes no more."""
        self._close()


def _stop_all(workers: list[_Worker], threads: ThreadPoolExecutor) -> None:
    for worker in workers:
        worker.stop()
    threads.shutdown(wait=False, cancel_futures=True)
