"""The server's ASGI middlewares, outermost last in ``install_middleware``: the API key
(and the web page's session cookie), the body's size and arrival time, each client's
bodies still arriving (clients.py), the open requests, a JSON 500 for the unforeseen,
and the client's X-Request-Id echoed (a valid one). Each is plain ASGI, not Starlette's
BaseHTTPMiddleware, so that a handler still sees its client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.server.guards.clients import ClientBodyLimitMiddleware
from tokenmill.server.observe.web import WebSessions, authorised, cross_site, cross_site_refusal, login_page
from tokenmill.server.protocol.error_responses import error_response
from tokenmill.server.protocol.openai import valid_request_id

logger = logging.getLogger(__name__)


def install_middleware(app: FastAPI, config: ServerConfig, keys: tuple[str, ...], sessions: WebSessions) -> None:
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys, sessions=sessions, login_page=config.web)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout=config.request_body_timeout)
    app.add_middleware(ClientBodyLimitMiddleware, limit=config.max_unfinished_bodies_per_client)  # clients.py
    app.add_middleware(OpenRequestLimitMiddleware, limit=config.max_open_requests)  # counts everything
    app.add_middleware(UnexpectedErrorMiddleware)  # anything unforeseen is a JSON 500
    app.add_middleware(RequestIdHeaderMiddleware)  # outermost: every answer, errors too, carries the client's id


# /health and /metrics stay open, as vLLM's; the API's description (FastAPI's /docs, /redoc
# and /openapi.json) does not: it lists every route and field, and with a key nothing of
# the API is public (a signed-in browser still opens /docs: the cookie is its key)
PROTECTED = (
    "/v1/",
    "/v2/",
    "/tokenize",
    "/detokenize",
    "/score",
    "/rerank",
    "/pooling",
    "/tokenmill/",
    "/web/",
    "/docs",
    "/redoc",
    "/openapi.json",
)


class APIKeyMiddleware:
    """401 for the API routes, the web page and the live view without
    ``Authorization: Bearer KEY`` (the scheme is case-insensitive, RFC 7235) or the
    page's sign-in cookie (web.py: a browser cannot send the header when it opens the
    page or an event stream); a request that shows the cookie goes on as if it had sent
    its key's header, so that it is the same tenant (but a request other than GET or
    HEAD that another site's page sent with the cookie is a 403: ``web.cross_site``).
    ``GET /`` without a key is the page's login form (``login_page``). A plain ASGI
    middleware, not Starlette's BaseHTTPMiddleware, which wraps ``receive`` so that a
    handler never sees its client disconnect, and a non-streamed request would run on
    unwatched."""

    def __init__(self, app: Any, keys: tuple[str, ...], sessions: WebSessions, login_page: bool = True) -> None:
        self.app, self.keys, self.sessions, self.login_page = (
            app,
            frozenset(k.encode() for k in keys),
            sessions,
            login_page,
        )

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path == "/" or path.startswith(PROTECTED):
            auth, by_cookie = authorised(scope["headers"], self.keys, self.sessions)
            if auth is None:
                if path == "/" and self.login_page:
                    await login_page(401)(scope, receive, send)
                    return
                response = error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)")
                await response(scope, receive, send)
                return
            if by_cookie and scope["method"] not in ("GET", "HEAD") and cross_site(scope["headers"]):
                await cross_site_refusal()(scope, receive, send)  # 403: another site's page, riding the cookie
                return
            scope = {**scope, "headers": auth}
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """A request's ``X-Request-Id`` header is echoed on its response (as vLLM's
    ``--enable-request-id-headers``): the client's id also names the request inside
    (chat and completions ids, the engine's request ids, logs, the live view). An id that
    could not name a request (``protocol.valid_request_id``: too long, spaces, control
    characters) is not echoed: the routes that read it answer a 400 naming the header,
    and a 100 KB header would otherwise come back on every answer, errors included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if scope["type"] != "http" or given is None or not valid_request_id(given.decode("latin-1")):
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, tagged)


class UnexpectedErrorMiddleware:
    """An exception no handler foresaw is logged and answered with a JSON 500 in
    OpenAI's shape, and not raised on: Starlette's own last resort answers plain text
    and re-raises, and uvicorn then drops the keep-alive connection, so the client's
    next request on it fails too. If the response had already started (a stream), the
    exception goes on up (the connection cannot be kept: its response is cut), unless
    the response was already whole."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def watched(message: dict) -> None:
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if finished:
                return  # the client has its whole answer: the connection stays
            if started:
                raise
            await error_response(500, "internal error: the server failed on this request (see its log)")(
                scope, receive, send
            )


UNCAPPED = ("/health", "/ping", "/metrics")  # a saturated server still answers its probes


class OpenRequestLimitMiddleware:
    """503 (OpenAI's shape, with Retry-After) for a request that arrives while ``limit``
    are open: whether their bodies are still arriving, they wait for the engine, or they
    stream. Thousands of slow or idle clients cannot take every socket and task the
    server has; they are answered at once, and the connection closes."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit, self.open = app, limit, 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in UNCAPPED:
            await self.app(scope, receive, send)
            return
        if self.open >= self.limit:
            message = f"server busy: {self.open} requests are open (--max-open-requests {self.limit}); retry later"
            await error_response(503, message, retry_after=True)(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes`` (declared or streamed), before any of it
    is parsed, and 408 for one not received whole within ``timeout`` seconds (a client
    trickling a body would otherwise hold its connection open for ever). The body is
    read here and handed on whole; later ``receive`` calls go to the client, so a
    disconnect is still seen."""

    def __init__(self, app: Any, max_bytes: int, timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                message = f"request body not received within {self.timeout:g} s (--request-body-timeout)"
                await error_response(408, message)(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        handed = False

        async def replay() -> dict:
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body over {self.max_bytes} bytes (--max-request-bytes)"
        await error_response(413, message)(scope, receive, send)
