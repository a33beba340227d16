"""Who a client is, and what one request or one client may put into the engine at once.

``Clients`` says who is asking (``client_of``): a configured API key (``--api-key``,
``--priority-api-key``) when the request presents one, else its address (an IPv6
address by its /64, as clients.py counts connections). A bearer token nobody
configured is no identity: on a server without keys, a fresh random token per request
made each request a client of its own, with a window of its own (8 sequences in the
engine became 39, issue 57). The identity is also the engine request's ``client``,
between which the scheduler shares each step's prompt tokens (engine/core/fairness.py).
``Clients`` also says who may raise its priority: a priority below ``--min-priority``
(0: ahead of the default) only with a ``--priority-api-key``; from anyone else it is a
400 naming those flags, rather than clamped, so that a client is never silently served
otherwise than it asked.

The per-request limits (prompts, embedding inputs, prompt tokens) are checked by the
routes with ``check_count`` and ``check_tokens``; a request over one is a 400 that names the limit
and its flag. The queue limit (``max_queue``: 429 with Retry-After) is served.py's
``check_queue``.

``ClientWindows`` is the fairness rule (issue 40): the engine serves its waiting queue
first come, first served, so a completions request with 2,000 prompts, put in whole,
would run ahead of every request that comes after it (other clients' time to first
token went from 0.9 s to over 60 s). Instead, the prompts of a request that has
several enter the engine through a window per client (``client_of``):
at most ``size`` of them are in the engine at once, the next one entering as one
ends. And while other requests wait for the engine (``busy``), a client's window shrinks
to ``BUSY_PLACES``: its prompts past those wait until the engine's queue is empty, so that
other clients' requests queue behind a handful of them, not a window's worth (with a
window of 32 against 16 single-prompt clients, their TTFT p99 went from 1.5 s to 3.6 s
in bench/soak.py --mix abuse). A request with one prompt does not wait for a window: what
it can hold is bounded by the queue limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

from fastapi import Request

from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.server.guards.clients import client_key


class Clients:
    """Who is asking, and whether it may raise its priority (see the module's docstring)."""

    def __init__(self, keys: Iterable[str], priority_keys: Iterable[str], min_priority: int) -> None:
        self.priority_keys = frozenset(priority_keys)
        self.keys = frozenset(keys) | self.priority_keys
        self.min_priority = min_priority

    def key_of(self, request: Request) -> str | None:
        """The configured key the request presents (``Authorization: Bearer KEY``, the
        scheme in any case, as the key check reads it), else None."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token in self.keys else None

    def client_of(self, request: Request) -> str:
        """Who is asking, for fairness: its configured key (a digest of it: never the key
        itself), else its address."""
        key = self.key_of(request)
        if key is not None:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return "addr:" + (client_key(request.client.host if request.client is not None else None) or "?")

    def check_priority(self, request: Request, priority: int) -> None:
        """400 for a priority below ``--min-priority`` from a request without a priority key."""
        if priority >= self.min_priority or (self.priority_keys and self.key_of(request) in self.priority_keys):
            return
        raise InvalidRequestError(
            f"priority {priority} would put this request ahead of others: below {self.min_priority} "
            "(--min-priority), only a request with a --priority-api-key may set one",
            param="priority",
        )


def _limit(config: ServerConfig, what: str) -> tuple[int, str]:
    if what == "inputs":
        return config.max_embedding_inputs, "--max-embedding-inputs"
    return config.max_prompts_per_request, "--max-prompts-per-request"


def check_count(config: ServerConfig, count: int, what: str, param: str) -> None:
    """400 when a request carries more prompts (``what``: "prompts", or the "inputs" of a
    request that embeds: pooled.py) than the server takes in one request."""
    limit, flag = _limit(config, what)
    if count > limit:
        raise InvalidRequestError(
            f"this request has {count} {what}; the server takes at most {limit} in one request ({flag}): split it",
            param=param,
        )


def check_tokens(config: ServerConfig, prompts: Sequence[Sequence[int]], what: str, param: str) -> None:
    """400 when a request's prompts hold more tokens in all than the server takes in one."""
    tokens = sum(len(p) for p in prompts)
    if tokens > config.max_request_tokens:
        raise InvalidRequestError(
            f"this request's {what} have {tokens} tokens in all; the server takes at most "
            f"{config.max_request_tokens} in one request (--max-request-tokens): split it",
            param=param,
        )


BUSY_PLACES = 4  # a client's places while other requests wait for the engine
BUSY_POLL_S = 0.01  # how often a prompt past them looks at the engine's queue again


class ClientWindows:
    """A window of ``size`` engine requests per client, for the prompts of requests that
    carry several (see the module's docstring). One event loop's; entries live while a
    request of that client holds or waits for a place."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._open: dict[str, _Window] = {}

    @contextlib.asynccontextmanager
    async def place(self, client: str, busy: Callable[[], bool] | None = None) -> AsyncIterator[None]:
        """Hold one of the client's places while the block runs (waiting for one first;
        past BUSY_PLACES, also for ``busy()`` to be False: nobody else waiting)."""
        window = self._open.get(client)
        if window is None:
            window = self._open[client] = _Window(asyncio.Semaphore(self.size))
        window.users += 1
        try:
            async with window.places:
                while busy is not None and window.held >= BUSY_PLACES and busy():
                    await asyncio.sleep(BUSY_POLL_S)
                window.held += 1
                try:
                    yield
                finally:
                    window.held -= 1
        finally:
            window.users -= 1
            if window.users == 0:
                del self._open[client]

    def in_use(self, client: str) -> int:
        """The client's places held now (0 for a client with no request here)."""
        window = self._open.get(client)
        return 0 if window is None else window.held


@dataclass
class _Window:
    places: asyncio.Semaphore
    users: int = 0  # holding a place or waiting for one
    held: int = 0
