"""The web page and what it reads: a chat playground and a live view of the engines.

    GET  /                         the page (static/index.html; off with --no-web)
    GET  /web/{file}               its script and style (static/, no build step, no CDN)
    POST /login, /logout           with --api-key: the key into (or out of) a cookie
    GET  /tokenmill/live           the live view's state as JSON (live.py)
    GET  /tokenmill/live/events    the same, as server-sent events every LIVE_EVERY_S

The page is behind ``--api-key`` like the API. A browser cannot send an
``Authorization`` header when it opens a page or an ``EventSource``, so signing in
with a key sets an HttpOnly, SameSite=Strict cookie, and a request that shows it is
treated as one that sent that key's header (APIKeyMiddleware in middleware.py): the same
tenant, the same checks. The cookie holds no key: a random session id that this
process maps to the key (``WebSessions``), so other services on the host never see
the key, and a copied cookie is worth nothing once its session ends: at sign-out,
after ``--web-session-ttl``, when the key's newer sessions push it out, or at a
restart. Sign-in is refused from another site's page, and so is any request other
than GET or HEAD that only the cookie authenticates (``cross_site``): SameSite=Strict
still sends the cookie from a sibling subdomain, which is the same site.
"""

from __future__ import annotations

import asyncio
import html
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.requests import cookie_parser

from tokenmill.errors import InvalidRequestError
from tokenmill.server.observe.live import LIVE_EVERY_S
from tokenmill.server.protocol.openai import error_body

COOKIE = "tokenmill_session"
SIGNED_IN = "tokenmill_signed_in"  # readable by the page: it shows "Sign out"
STATIC = {"app.js": "text/javascript", "style.css": "text/css", "favicon.svg": "image/svg+xml"}
NO_STORE = {"Cache-Control": "no-store"}
SESSIONS_PER_KEY = 64  # live sign-ins per key; a new one ends the key's oldest
PAGE_HEADERS = {
    **NO_STORE,
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


class WebSessions:
    """Signed-in browsers: a random id per sign-in (the cookie's value), the key it stands
    for and when it ends. Sign-out ends it at once; it ends by itself ``ttl`` seconds
    after sign-in; a key has at most ``per_key`` (its oldest end first), so the table is
    bounded by the keys and one key's holder cannot sign out another's browsers."""

    def __init__(
        self,
        keys: tuple[str, ...],
        ttl: float,
        per_key: int = SESSIONS_PER_KEY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys, self.ttl, self.per_key, self._clock = frozenset(keys), ttl, per_key, clock
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (key, ends at), oldest first

    def open(self, key: str) -> str:
        """A new session for ``key`` (one of the server's): its id."""
        assert key in self._keys
        self._expire()
        mine = [sid for sid, (k, _) in self._live.items() if k == key]
        for sid in mine[: max(0, len(mine) + 1 - self.per_key)]:
            del self._live[sid]
        sid = secrets.token_urlsafe(32)
        self._live[sid] = (key, self._clock() + self.ttl)
        return sid

    def key_of(self, sid: str) -> bytes | None:
        """The key of a live session, else None."""
        found = self._live.get(sid)
        if found is None:
            return None
        if found[1] <= self._clock():
            del self._live[sid]
            return None
        return found[0].encode()

    def close(self, sid: str) -> None:
        self._live.pop(sid, None)

    def __len__(self) -> int:
        self._expire()
        return len(self._live)

    def _expire(self) -> None:
        now = self._clock()
        while self._live and next(iter(self._live.values()))[1] <= now:  # one ttl: oldest first is soonest first
            self._live.popitem(last=False)


def _static(name: str) -> bytes:
    return resources.files("tokenmill.server.observe").joinpath("static", name).read_bytes()


def authorised(
    headers: list[tuple[bytes, bytes]], keys: frozenset[bytes], sessions: WebSessions
) -> tuple[list[tuple[bytes, bytes]] | None, bool]:
    """The request's headers if it shows a key (``Authorization: Bearer KEY``, or a
    sign-in cookie, which becomes that key's header), else None; and whether the cookie
    was the credential."""
    auth = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = auth.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip() in keys:
        return headers, False
    key = sessions.key_of(_session_id(headers))
    if key is not None:
        return [(k, v) for k, v in headers if k != b"authorization"] + [(b"authorization", b"Bearer " + key)], True
    return None, False


def _session_id(headers: list[tuple[bytes, bytes]]) -> str:
    cookies = b"; ".join(v for k, v in headers if k == b"cookie").decode("latin-1")
    return cookie_parser(cookies).get(COOKIE, "") if cookies else ""  # parsed as browsers do


def cross_site(headers: list[tuple[bytes, bytes]]) -> bool:
    """Sent from another site's page (or another subdomain's): ``Sec-Fetch-Site`` says so,
    or ``Origin`` names another host than ``Host`` ("null" included). A request with
    neither (not from a browser, or an old one) is not."""
    found = {k: v.decode("latin-1") for k, v in headers if k in (b"sec-fetch-site", b"origin", b"host")}
    if found.get(b"sec-fetch-site") in ("cross-site", "same-site"):
        return True
    origin = found.get(b"origin")
    return origin is not None and urlsplit(origin).netloc.lower() != found.get(b"host", "").lower()


def cross_site_refusal() -> JSONResponse:
    """403 in OpenAI's shape for a request that only the cookie authenticates, sent from another site."""
    message = (
        "a request from another site's page cannot use this server's sign-in cookie; send Authorization: Bearer <key>"
    )
    return JSONResponse(error_body(message, "PermissionDeniedError", 403), status_code=403)


def login_page(status: int, error: str | None = None) -> HTMLResponse:
    """The form that asks for the API key (nothing of the server shows before it)."""
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>tokenmill: sign in</title><link rel="icon" href="data:,">
<style>body{{font:16px system-ui,sans-serif;max-width:24rem;margin:10vh auto;padding:0 1rem;color:#1d2430}}
input,button{{font:inherit;padding:.5rem;width:100%;box-sizing:border-box;margin:.25rem 0}}
button{{background:#1f5fbf;color:#fff;border:0;border-radius:4px}}.error{{color:#a4161a}}</style></head>
<body><main><h1>tokenmill</h1><p>This server needs an API key.</p>{message}
<form method="post" action="/login"><label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Open</button></form></main></body></html>"""
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


def add_web_routes(app: FastAPI, served: Any, keys: tuple[str, ...], sessions: WebSessions) -> None:
    """The page's routes and the live view's on ``app`` (``served``: app.Served)."""
    config, live = served.config, served.live

    if config.web:

        @app.get("/", include_in_schema=False)
        async def page() -> Response:
            return Response(_static("index.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

        @app.get("/web/{name}", include_in_schema=False)
        async def static(name: str) -> Response:
            if name not in STATIC:
                return JSONResponse(error_body(f"no such file: /web/{name}", "NotFoundError", 404), status_code=404)
            return Response(_static(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache"})

        if keys:

            @app.post("/login", include_in_schema=False)
            async def login(request: Request) -> Response:
                if cross_site(request.headers.raw):
                    return login_page(403, "Sign in from this server's own page.")
                form = parse_qs((await request.body()).decode("utf-8", "replace"))
                key = (form.get("key") or [""])[0].strip()
                if key not in keys:
                    return login_page(401, "That key is not one of this server's.")
                secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
                response = RedirectResponse("/", status_code=303)
                response.set_cookie(
                    COOKIE, sessions.open(key), httponly=True, samesite="strict", path="/", secure=secure
                )
                response.set_cookie(SIGNED_IN, "1", samesite="strict", path="/", secure=secure)
                return response

            @app.post("/logout", include_in_schema=False)
            async def logout(request: Request) -> Response:
                if cross_site(request.headers.raw):
                    return login_page(403, "Sign out from this server's own page.")
                sessions.close(_session_id(request.headers.raw))  # a copy of the cookie is worth nothing now
                response = RedirectResponse("/", status_code=303)
                response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
                response.delete_cookie(SIGNED_IN, path="/", samesite="strict")
                return response

    @app.get("/tokenmill/live")
    async def live_state(since: str | None = None) -> dict[str, Any]:
        """The live view's state; ``since`` (N, or NAME:N,NAME:N): only later steps."""
        return await live.state(_since(since, list(served.models)))

    @app.get("/tokenmill/live/events")
    async def live_events(request: Request, since: str | None = None) -> StreamingResponse:
        """The state every LIVE_EVERY_S, each event with the steps since the last one; it
        ends when the client leaves or the server stops (an EventSource reconnects)."""
        after = _since(since, list(served.models))

        async def events():
            yield f"retry: {int(LIVE_EVERY_S * 2000)}\n\n"
            while not served.stopping.is_set() and not await request.is_disconnected():
                state = await live.state(after)
                for m in state["models"]:
                    after[m["name"]] = max(after.get(m["name"], 0), m["last_step"])
                yield f"event: state\ndata: {json.dumps(state, separators=(',', ':'))}\n\n"
                try:
                    await asyncio.wait_for(served.stopping.wait(), LIVE_EVERY_S)
                except TimeoutError:
                    pass

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )


def _since(text: str | None, names: list[str]) -> dict[str, int]:
    """``N`` (every model) or ``NAME:N,NAME:N``; anything else is a 400 naming it."""
    if not text:
        return {}
    try:
        if ":" not in text:
            return dict.fromkeys(names, int(text))
        pairs = [part.rsplit(":", 1) for part in text.split(",")]
        since = {name: int(n) for name, n in pairs}
    except ValueError:
        raise InvalidRequestError(
            f"since must be a step number or NAME:N,NAME:N, got {text!r}", param="since"
        ) from None
    unknown = sorted(set(since) - set(names))
    if unknown:
        raise InvalidRequestError(
            f"since names a model this server does not serve: {', '.join(unknown)}", param="since"
        )
    return since
