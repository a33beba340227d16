"""Schema-driven fuzzing of every route in /openapi.json, in process on a scripted
engine (no model, so a few hundred requests take seconds): no 5xx, ever, and every
4xx in OpenAI's error shape. Bodies mix valid values of each field with hostile
ones (wrong types, huge and negative integers, lone surrogates, deep nesting);
generated max_tokens and n are capped so the valid ones finish quickly."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

HOSTILE = st.sampled_from([
    None, True, -1, 0, 2**31, 2**63, 10**30, -(10**30), 1e308, -0.5, "", "16", "\ud800", "x" * 3000,
    [], [1, 2], ["a"], [[1]], {}, {"a": 1}, [[[[[[[[[[1]]]]]]]]]],
])  # fmt: skip
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2}


@pytest.fixture(scope="module")
def fuzz_app():
    engine = AsyncEngine(Engine(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=256, block_size=4, max_model_len=64)))
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name="toy", max_queue=64, max_request_bytes=1 << 16))
    yield app, engine
    engine.shutdown()


def routes(app) -> list[tuple[str, str, dict | None]]:
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    out = []
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            out.append((method.upper(), path, schemas[ref.rsplit("/", 1)[1]] if ref else None))
    return out


def valid_value(name: str, prop: dict) -> st.SearchStrategy:
    if name in CAPS:
        return st.integers(1, CAPS[name])
    if name == "messages":
        return st.just([{"role": "user", "content": "hi"}])
    if name == "prompt":
        return st.sampled_from(["hello", [1, 2, 3], ["a", "b"]])
    if name == "tokens":
        return st.lists(st.integers(0, 49), max_size=5)
    kinds = {t.get("type") for t in prop.get("anyOf", [prop])}
    if "boolean" in kinds:
        return st.booleans()
    if "integer" in kinds:
        return st.integers(0, 5)
    if "number" in kinds:
        return st.floats(0, 1)
    return st.none()


@st.composite
def requests(draw, app):
    method, path, schema = draw(st.sampled_from(routes(app)))
    if schema is None:
        return method, path, None
    props = schema.get("properties", {})
    body = {}
    for name, prop in props.items():  # a valid body first ...
        if name in schema.get("required", []) or draw(st.integers(0, 3)) == 0:
            body[name] = draw(valid_value(name, prop))
    body = {k: v for k, v in body.items() if v is not None}
    for name in draw(st.lists(st.sampled_from(sorted(props)), max_size=2)):  # ... then up to two hostile fields
        body[name] = draw(HOSTILE)
    return method, path, body


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_route_answers_fuzzed_bodies_without_a_5xx(fuzz_app, data):
    app, engine = fuzz_app
    method, path, body = data.draw(requests(app))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            content = None if body is None else json.dumps(body).encode()
            return await c.request(method, path, content=content, headers={"content-type": "application/json"})

    r = asyncio.run(go())
    assert r.status_code < 500, (method, path, body, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert engine.engine.num_unfinished_requests == 0 or path not in ("/v1/completions", "/v1/chat/completions")
