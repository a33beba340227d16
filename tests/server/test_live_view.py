"""The web page's routes and the live view's JSON, in process on scripted engines (no
weights): served behind the API key, off with --no-web, and a live state that says what
the engine did without a word of anyone's request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_models_app
from tokenmill.server.gateway.models import ServedModel
from tokenmill.server.observe import live

KEY = "key-a"


def scripted(name: str) -> ServedModel:
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=128, block_size=4, max_model_len=512))
    )
    return ServedModel(name, engine, ToyTokenizer(), 512)


@pytest.fixture
def make_app():
    started: list[ServedModel] = []

    def make(names=("toy",), **config):
        models = [scripted(n) for n in names]
        started.extend(models)
        return build_models_app(models, ServerConfig(**config))

    yield make
    for m in started:
        m.engine.shutdown()


async def request(app, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
        return await c.request(method, path, headers=headers, **kw)


def call(app, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    return asyncio.run(request(app, method, path, key, **kw))


def chat(app, content: str = "hello there", key: str | None = None, model: str | None = None, **kw) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        "temperature": 0,
        **({"model": model} if model else {}),
    }
    r = call(app, "POST", "/v1/chat/completions", key, json=body, **kw)
    assert r.status_code == 200, r.text
    return r


def test_the_page_and_its_files_are_served(make_app):
    app = make_app()
    page = call(app, "GET", "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/web/app.js"' in page.text and "https://" not in page.text  # nothing from a CDN
    for name, kind in [("app.js", "text/javascript"), ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")]:
        r = call(app, "GET", f"/web/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
        assert b"https://" not in r.content
    missing = call(app, "GET", "/web/secrets.py")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_no_web_turns_the_page_off_but_not_the_live_json(make_app):
    app = make_app(web=False)
    assert call(app, "GET", "/").status_code == 404
    assert call(app, "GET", "/web/app.js").status_code == 404
    assert call(app, "GET", "/tokenmill/live").status_code == 200


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_in_a_cookie(make_app):
    app = make_app(api_key=(KEY, "key-b"), response_cache="exact")
    login = call(app, "GET", "/")
    assert login.status_code == 401 and 'action="/login"' in login.text and "app.js" not in login.text
    for path in ("/web/app.js", "/tokenmill/live", "/tokenmill/live/events"):
        r = call(app, "GET", path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    wrong = call(app, "POST", "/login", data={"key": "nope"})
    assert wrong.status_code == 401 and "not one of this server" in wrong.text and "set-cookie" not in wrong.headers

    async def session() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            r = await c.post("/login", data={"key": KEY})
            assert r.status_code == 303 and r.headers["location"] == "/"
            session = next(c for c in r.headers.get_list("set-cookie") if c.startswith("tokenmill_session="))
            assert KEY not in session  # a random session id, never the key itself
            cookie = session.lower()
            assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
            # another service's malformed cookie before ours does not sign us out
            token = c.cookies["tokenmill_session"]
            odd = {"cookie": f'foo={{"a":1}}; sess=a"b; tokenmill_session={token}'}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as bare:
                assert (await bare.get("/tokenmill/live", headers=odd)).status_code == 200
                forged = {"cookie": "tokenmill_session=" + "0" * 64}
                assert (await bare.get("/tokenmill/live", headers=forged)).status_code == 401
                cross = await bare.post("/login", data={"key": KEY}, headers={"origin": "http://evil.example"})
                assert cross.status_code == 403 and "set-cookie" not in cross.headers  # no login from another site
            assert (await c.get("/")).status_code == 200 and (await c.get("/tokenmill/live")).status_code == 200
            # The cookie's requests are the key's tenant: an answer cached for the bearer key is a hit.
            body = {"messages": [{"role": "user", "content": "same"}], "max_tokens": 4, "temperature": 0}
            first = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
            by_cookie = await c.post("/v1/chat/completions", json=body)
            assert first.headers["x-tokenmill-cache"] == "miss" and by_cookie.headers["x-tokenmill-cache"] == "hit"
            other = await c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-b"})
            assert other.headers["x-tokenmill-cache"] == "miss"  # a bearer header wins over the cookie
            r = await c.post("/logout")
            assert r.status_code == 303
            c.cookies.clear()
            assert (await c.get("/")).status_code == 401

    asyncio.run(session())


def test_the_live_state_says_what_ran_and_nothing_private(make_app):
    app = make_app()
    r = chat(app, "a secret prompt")
    state = call(app, "GET", "/tokenmill/live").json()
    (m,) = state["models"]
    assert m["name"] == "toy" and m["alive"] and m["traced"]
    # Tracing starts with the first look: this request ran before anyone looked.
    assert m["steps"] == [] and m["last_step"] == 0
    chat(app, "another secret prompt")
    m = call(app, "GET", "/tokenmill/live").json()["models"][0]
    steps = m["steps"]
    kinds = [q[1] for s in steps for q in s["seqs"]]
    assert kinds == ["prefill"] + ["decode"] * 4 and steps[-1]["seqs"][0][7] == "length"
    assert {q[0] for s in steps for q in s["seqs"]} == {"r1"}
    text = json.dumps(m)
    assert "secret" not in text and r.json()["id"] not in text and "chatcmpl" not in text
    assert m["finished"] == {"length": 1}  # of the steps traced
    assert m["latency_ms"]["ttft"]["count"] == 2 and m["latency_ms"]["itl"]["count"] == 8  # every answer's
    assert len(m["blocks"]) == 128 and set(m["blocks"]) <= set("01234567") and "1" in m["blocks"]  # prompt cached
    assert m["series"] and sum(b[5] for b in m["series"]) == 4  # four decode tokens
    assert m["gauges"]["running"] == 0 and m["gauges"]["prefix_cache_hit_rate"] is not None
    again = call(app, "GET", f"/tokenmill/live?since={m['last_step']}").json()["models"][0]
    assert again["steps"] == [] and again["last_step"] == m["last_step"]


def test_several_models_each_have_their_state(make_app):
    app = make_app(names=("small", "large"))
    call(app, "GET", "/tokenmill/live")
    chat(app, model="large")
    state = call(app, "GET", "/tokenmill/live").json()
    by_name = {m["name"]: m for m in state["models"]}
    assert by_name["small"]["steps"] == [] and len(by_name["large"]["steps"]) == 5
    later = call(app, "GET", f"/tokenmill/live?since=large:{by_name['large']['last_step']},small:0").json()
    assert all(m["steps"] == [] for m in later["models"])
    for bad in ("x", "medium:3", "large:x"):
        r = call(app, "GET", f"/tokenmill/live?since={bad}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "since"


def test_the_event_stream_sends_states_until_the_server_stops(make_app):
    app = make_app()

    async def go() -> str:
        async def stop_soon() -> None:
            await asyncio.sleep(1.2)
            app.state.served.stopping.set()

        stopper = asyncio.create_task(stop_soon())
        r = await request(app, "GET", "/tokenmill/live/events")
        await stopper
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.text

    text = asyncio.run(go())
    assert text.startswith("retry: ")
    states = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert len(states) >= 2 and all(s["models"][0]["name"] == "toy" for s in states)
    assert len({s["epoch"] for s in states}) == 1


def test_what_the_view_keeps_is_bounded(make_app, monkeypatch):
    monkeypatch.setattr(live, "STEPS_KEPT", 8)
    monkeypatch.setattr(live, "LABELS_KEPT", 5)
    monkeypatch.setattr(live, "LATENCIES_KEPT", 6)
    app = make_app()
    call(app, "GET", "/tokenmill/live")
    for i in range(12):
        chat(app, f"request {i}")
    m = call(app, "GET", "/tokenmill/live").json()["models"][0]
    view = app.state.served.live.models["toy"]
    assert len(m["steps"]) == 8 and m["last_step"] == 60 and len(view._labels) == 5
    assert m["latency_ms"]["ttft"]["count"] == 6 and m["latency_ms"]["itl"]["count"] == 6
    assert m["finished"] == {"length": 12}


def test_the_engines_stop_tracing_when_nobody_looks(make_app, monkeypatch):
    monkeypatch.setattr(live, "UNWATCHED_S", 0.3)
    app = make_app()
    engine = app.state.served.models["toy"].engine.engine

    async def go() -> None:
        await request(app, "GET", "/tokenmill/live")
        assert engine.core.tracer.on
        await asyncio.sleep(0.8)
        assert not engine.core.tracer.on and app.state.served.live.models["toy"].started is None
        await request(app, "GET", "/tokenmill/live")  # a new look starts it again
        assert engine.core.tracer.on

    asyncio.run(go())


def test_energy_and_price_in_metrics_and_the_live_state(make_app):
    """/metrics counts the server's joules labelled by source (this machine's VM has no
    readable RAPL, so: estimated, at the given watts per CPU) and exports the price; the live
    state carries the power over the window and the price for the page's tiles."""
    import re

    app = make_app(watts_per_cpu=10.0, price_per_hour=2.5)
    for _ in range(3):
        chat(app, "a prompt that costs a little energy")
    text = call(app, "GET", "/metrics").text
    (joules,) = re.findall(r'^tokenmill:energy_joules_total\{source="estimated"\} (\S+)$', text, re.M)
    assert float(joules) > 0
    assert re.search(r"^tokenmill:price_per_hour_dollars 2\.5$", text, re.M)
    first = call(app, "GET", "/tokenmill/live").json()["energy"]
    chat(app, "another")
    energy = call(app, "GET", "/tokenmill/live").json()["energy"]
    assert first["source"] == energy["source"] == "estimated" and energy["how"].startswith("10 W per busy CPU")
    assert energy["price_per_hour"] == 2.5 and energy["joules"] >= first["joules"] > 0
    assert energy["watts"] is not None and energy["watts"] >= 0
    plain = make_app()
    assert "tokenmill:price_per_hour_dollars" not in call(app := plain, "GET", "/metrics").text
    assert call(app, "GET", "/tokenmill/live").json()["energy"]["price_per_hour"] is None
