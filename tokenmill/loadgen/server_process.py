"""A `tokenmill serve` started as a child process: on a free port, waited for until it answers
``/health``, stopped with SIGTERM (its graceful drain) and, whatever happens to the parent, ended
with it (``lifetime.EXIT_WITH_PARENT_ENV``). The one way `tokenmill tune`, the tests and the
benchmarks start a server and wait for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from tokenmill.host.lifetime import EXIT_WITH_PARENT_ENV


def free_port() -> int:
    """A TCP port nobody listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Until the server at ``url`` (just started: it loads its model first) answers ``/health``
    with 200; a RuntimeError if ``proc`` exits first (with its stderr's tail, where piped) or
    ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read()[-2000:] if proc.stderr is not None else ""
            raise RuntimeError(f"the server exited ({proc.returncode}): {err}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError(f"the server did not answer /health in {timeout:.0f} s")


class ServerProcess:
    """``tokenmill serve FLAGS --port <free>``; ``url`` once it answers. stderr is piped (read it
    after ``stop``: ``proc.stderr.read()``), stdout goes where ``stdout`` says (default: nowhere)."""

    def __init__(
        self,
        flags: Sequence[str],
        timeout: float = 300,
        env: dict[str, str] | None = None,
        stdout: int | IO[Any] | None = subprocess.DEVNULL,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", EXIT_WITH_PARENT_ENV: str(os.getpid()), **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
        try:
            wait_healthy(self.url, self.proc, timeout)
        except RuntimeError:
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the server drains), SIGKILL after ``timeout`` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
