"""What one client (a peer address) may hold of the server: connections, request bodies
still arriving, and a connection that has not sent a request head.

A server whose only cap is global (``--max-open-requests``) can be taken whole by one
address: 1,024 connections that each send half a body made every other client's
request a 503 until the body timeout (issue 40). So each client gets a share:

- ``--max-connections-per-client``: a connection past this many open from one address
  is answered 429 at its first request and closed (``guarded_protocol``).
- ``--max-unfinished-bodies-per-client``: a request past this many from one address
  whose bodies are still arriving is answered 429 at once (``ClientBodyLimitMiddleware``).
- ``--request-header-timeout``: a connection that has not sent a whole request head
  this long after it opened, or after its last response, is closed. uvicorn's
  ``timeout_keep_alive`` starts only when a response ends: a fresh connection that
  sends nothing, or half a head, stayed open for ever.

Both caps are below the global one by default, so a flood from one address leaves
room for the others. A client is its address (``client_key``), an IPv6 address by its
/64 (what one host is usually given). Behind a reverse proxy every client is the
proxy: raise the caps there, and let the proxy keep per-client limits of its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.server.protocol.openai import error_body

RETRY_AFTER_S = 1


def client_key(host: str | None) -> str | None:
    """The client a peer address belongs to: an IPv4 address (also when IPv4-mapped), an
    IPv6 address's /64, or the text itself when it is not an address; None when unknown
    (a Unix socket: not capped)."""
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class ClientCounts:
    """How many of one thing each client holds now, at most ``limit`` each; a client's
    entry goes when it holds none, so the table is as large as what is open."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def take(self, key: str | None) -> bool:
        """One more for ``key``, unless it holds ``limit`` already (an unknown client: always)."""
        if key is None:
            return True
        held = self._held.get(key, 0)
        if held >= self.limit:
            return False
        self._held[key] = held + 1
        return True

    def give(self, key: str | None) -> None:
        if key is None:
            return
        held = self._held[key] - 1
        if held:
            self._held[key] = held
        else:
            del self._held[key]

    def held(self, key: str | None) -> int:
        return self._held.get(key, 0) if key is not None else 0


def too_many(message: str) -> JSONResponse:
    """429 in OpenAI's shape, with Retry-After; the connection closes after it."""
    return JSONResponse(
        error_body(message, "RateLimitError", 429),
        status_code=429,
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )


def _peer(scope: dict) -> str | None:
    client = scope.get("client")
    return client_key(client[0]) if client else None


class ClientBodyLimitMiddleware:
    """429 for a request whose body would be its client's ``limit + 1``-th still
    arriving. A body counts from the request's start until its last part is received
    (or the request ends); a body sent whole with its head counts for no time at all.
    A plain ASGI middleware that only wraps ``receive``: disconnects still reach the app."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.bodies = app, ClientCounts(limit)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        key = _peer(scope)
        if not self.bodies.take(key):
            message = (
                f"too many request bodies from your address are still arriving ({self.bodies.limit}, "
                "--max-unfinished-bodies-per-client); finish them or retry later"
            )
            await too_many(message)(scope, receive, send)
            return
        arriving = True

        def arrived() -> None:
            nonlocal arriving
            if arriving:
                arriving = False
                self.bodies.give(key)

        async def counted() -> dict:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                arrived()
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            arrived()


def guarded_protocol(connections: ClientCounts, header_timeout: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``: its default, httptools' or h11's) with the two
    connection rules above: at most ``connections.limit`` open per client (the next is
    answered 429 at its first request, then closed), and ``header_timeout`` seconds to
    send a whole request head, from the connection's start and from each response's end.
    One class per server: ``connections`` is that server's table."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    refused_message = (
        f"too many connections from your address ({connections.limit} open, "
        "--max-connections-per-client); close some or retry later"
    )

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _client: str | None = None
        _counted = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._client = client_key(self.client[0]) if self.client else None
            self._counted = connections.take(self._client)
            if not self._counted:  # answered at its first request (a response is possible then), then closed
                self.app = too_many(refused_message)
            self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            if self._counted:
                self._counted = False
                connections.give(self._client)
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._idle():
                self._wait_for_head()

        def _idle(self) -> bool:
            """No request in progress or queued: the connection waits for a head."""
            return self.cycle is None or self.cycle.response_complete

        def _wait_for_head(self) -> None:
            self._stop_waiting()
            self._head_timer = self.loop.call_later(header_timeout, self._head_overdue)

        def _stop_waiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            self._head_timer = None
            if self._idle() and self.transport.get_protocol() is self:
                self.timeout_keep_alive_handler()  # uvicorn's own close of an idle connection

    return GuardedHTTPProtocol


def uvicorn_options(config: ServerConfig, base: type | None = None) -> dict[str, Any]:
    """The keywords of ``uvicorn.Config`` that enforce the per-client connection rules
    (no WebSocket upgrades: none is served, and an upgraded connection leaves the protocol
    that counts it). ``base``: uvicorn's protocol to build on (default: its own choice)."""
    connections = ClientCounts(config.max_connections_per_client)
    return {"http": guarded_protocol(connections, config.request_header_timeout, base), "ws": "none"}
