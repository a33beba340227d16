"""Issue 40 item 6: the web page's sign-in is a session that ends (sign-out, expiry,
newer sessions of the key), so a copied cookie stops working; and the cookie never
authenticates a state-changing request from another site's page. In process, on a
scripted engine (no weights)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app
from tokenmill.server.observe.web import COOKIE, WebSessions

KEY = "key-a"
LORA = {"lora_name": "evil"}  # no lora_path: a 400 when the request is let through


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_end_at_sign_out_expiry_and_past_a_keys_cap():
    clock = Clock()
    sessions = WebSessions(("a", "b"), ttl=100, per_key=3, clock=clock)
    first, second = sessions.open("a"), sessions.open("a")
    assert first != second and len(first) >= 40 and "a" not in (first, second)  # random ids, not the key
    assert sessions.key_of(first) == b"a" and sessions.key_of("0" * 64) is None
    sessions.close(first)
    assert sessions.key_of(first) is None and sessions.key_of(second) == b"a"
    clock.now = 99
    assert sessions.key_of(second) == b"a"
    clock.now = 100
    assert sessions.key_of(second) is None and len(sessions) == 0
    b = sessions.open("b")
    a = [sessions.open("a") for _ in range(5)]  # at most three of a's: its oldest end first
    assert [sessions.key_of(s) for s in a] == [None, None, b"a", b"a", b"a"]
    assert sessions.key_of(b) == b"b" and len(sessions) == 4  # another key's session is not pushed out


@pytest.fixture
def app():
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    config = ServerConfig(
        served_model_name="toy", api_key=(KEY,), allow_runtime_lora_updating=True, web_session_ttl=0.5
    )
    yield build_app(engine, ToyTokenizer(), 64, config)
    engine.shutdown()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30)


async def _sign_in(c: httpx.AsyncClient) -> str:
    r = await c.post("/login", data={"key": KEY}, headers={"origin": "http://t", "sec-fetch-site": "same-origin"})
    assert r.status_code == 303
    return c.cookies[COOKIE]


def test_a_copied_cookie_is_refused_after_sign_out_and_after_the_ttl(app):
    async def main():
        async with _client(app) as browser, _client(app) as thief:
            cookie = await _sign_in(browser)
            copied = {"cookie": f"{COOKIE}={cookie}"}
            assert (await thief.get("/tokenmill/live", headers=copied)).status_code == 200
            assert (await browser.post("/logout", headers={"origin": "http://t"})).status_code == 303
            r = await thief.get("/tokenmill/live", headers=copied)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            cookie = await _sign_in(browser)  # signed in again: a new id, which expires on its own
            assert (await thief.get("/tokenmill/live", headers={"cookie": f"{COOKIE}={cookie}"})).status_code == 200
            await asyncio.sleep(0.6)
            assert (await thief.get("/tokenmill/live", headers={"cookie": f"{COOKIE}={cookie}"})).status_code == 401

    asyncio.run(main())


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://evil.com", "sec-fetch-site": "cross-site"},
        {"origin": "http://evil.com"},
        {"origin": "null"},
        {"sec-fetch-site": "same-site"},  # a sibling subdomain: SameSite=Strict still sends the cookie
    ],
)
def test_the_cookie_does_not_authenticate_a_cross_site_request_that_changes_state(app, headers):
    async def main():
        async with _client(app) as c:
            await _sign_in(c)
            refused = await c.post("/v1/load_lora_adapter", json=LORA, headers=headers)
            read = await c.get("/tokenmill/live", headers=headers)  # reading is not changing (and no CORS lets it out)
            same = await c.post(
                "/v1/load_lora_adapter", json=LORA, headers={"origin": "http://t", "sec-fetch-site": "same-origin"}
            )
            bearer = await c.post(
                "/v1/load_lora_adapter", json=LORA, headers={**headers, "authorization": f"Bearer {KEY}"}
            )
            return refused, read, same, bearer

    refused, read, same, bearer = asyncio.run(main())
    assert refused.status_code == 403, refused.text
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 403
    assert err["type"] == "PermissionDeniedError" and "Bearer" in err["message"]
    assert read.status_code == 200
    assert same.status_code == 400 and "lora_path" in same.json()["error"]["message"]  # the page's own: let through
    assert bearer.status_code == 400  # an API client with its key: unaffected by Origin
