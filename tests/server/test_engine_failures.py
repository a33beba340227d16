"""The server when its engine fails, and when a client leaves a non-streamed request.

The dead-engine test runs the app in process on a scripted engine (no model): a bug
in the engine loop itself must turn into 503s, on requests and on /health, never a
hang. The disconnect test uses the real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer, wait_until
from tests.server.conftest import API_KEY, MODEL
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app


class LoopBug(BaseException):
    """Not an Exception: escapes the engine's per-request fault isolation, as a bug would."""


class DyingRunner(ScriptedRunner):
    def __init__(self) -> None:
        super().__init__(block_size=4)
        self.dead = False

    def execute(self, batch, grammar=None):
        if batch.scheduled and self.dead:
            raise LoopBug("the loop's own code failed")
        return super().execute(batch, grammar)


def dying_app():
    """An app over a threaded engine whose loop dies once ``runner.dead`` is set."""
    runner = DyingRunner()
    engine = AsyncEngine(
        Engine.create(runner, ToyTokenizer(), EngineConfig(num_blocks=32, block_size=4, max_model_len=64))
    )
    return runner, engine, build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name=MODEL))


def test_dead_engine_answers_503_and_health_fails():
    runner, engine, app = dying_app()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 3}
            assert (await c.post("/v1/completions", json=body)).status_code == 200  # alive
            assert (await c.get("/health")).status_code == 200
            runner.dead = True
            in_flight = await c.post("/v1/completions", json=body)  # the loop dies under this one
            after = await c.post("/v1/completions", json={**body, "stream": True})
            health = await c.get("/health")
            return in_flight, after, health

    try:
        in_flight, after, health = asyncio.run(main())
    finally:
        engine.shutdown()
    assert in_flight.status_code == 503 and in_flight.json()["error"]["type"] == "ServiceUnavailableError"
    assert after.status_code == 503 and "not running" in after.json()["error"]["message"]
    assert health.status_code == 503


def test_requests_racing_the_loops_death_all_get_503_at_once():
    """Issue 24 item 9: requests queued while the loop dies, or just after, are answered
    503 at once, not left waiting for a loop that will never read them."""
    runner, engine, app = dying_app()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 3}
            runner.dead = True
            return await asyncio.wait_for(
                asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(40))), 20
            )

    try:
        replies = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r.status_code for r in replies] == [503] * 40


def test_a_client_leaving_a_non_streamed_request_aborts_it(server):
    """The request would run for minutes; once its client hangs up it must be aborted
    (the API-key check must not hide the disconnect from the handler)."""
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=2.0)
    assert wait_until(lambda: server.metric("tokenmill:num_requests_running") == 0, timeout=15)
    assert server.metric("tokenmill:kv_cache_usage_perc") == 0
