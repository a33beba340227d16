"""Issue 40 item 2: what one request or client may put into the engine, limited by
default. In process, on a scripted engine (no model): each limit is a 4xx naming its
flag, and the prompts of a many-prompt request share the engine with other clients'
requests instead of going first in full."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core.scheduler import SchedulerConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

MODEL = "toy"


class SlowRunner(ScriptedRunner):
    """A scripted runner whose steps take 2 ms, as a model's would take some time."""

    def execute(self, batch, grammar=None):
        time.sleep(0.002)
        return super().execute(batch, grammar)


def _scope(client: str, path: str, headers: dict[str, str] | None = None) -> dict:
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *extra],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("t", 80),
        "client": (client, 1),
        "root_path": "",
    }


async def _post(
    app, client: str, path: str, body: dict, events: list | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict, bytes]:
    """POST ``body`` from ``client`` (with ``headers``); each body part sent is appended to
    ``events`` with the time it was sent. The client never disconnects."""
    first = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if first:
            return first.pop()
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if events is not None and message["type"] == "http.response.body":
            events.append((time.monotonic(), message.get("body", b"")))

    await app(_scope(client, path, headers), receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_the_limits_are_on_by_default():
    config = ServerConfig()
    assert config.max_queue == 1024 and config.max_prompts_per_request == 2048
    assert config.max_embedding_inputs == 2048 and config.max_request_tokens == 262144
    assert config.max_inflight_prompts_per_client == 32


@pytest.mark.parametrize(
    "path,body,flag",
    [
        ("/v1/completions", {"prompt": ["a"] * 4, "max_tokens": 1}, "--max-prompts-per-request"),
        ("/v1/completions", {"prompt": [[1, 2]] * 4, "max_tokens": 1}, "--max-prompts-per-request"),
        ("/v1/embeddings", {"input": ["a"] * 4}, "--max-embedding-inputs"),
        ("/v1/completions", {"prompt": ["abcdef", "abcdef"], "max_tokens": 1}, "--max-request-tokens"),
        ("/v1/embeddings", {"input": ["abcdef", "abcdef"]}, "--max-request-tokens"),
    ],
)
def test_a_request_over_a_limit_is_a_400_naming_its_flag_and_leaves_nothing_behind(path, body, flag):
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    )
    config = ServerConfig(
        served_model_name=MODEL, max_prompts_per_request=3, max_embedding_inputs=3, max_request_tokens=10
    )
    app = build_app(engine, ToyTokenizer(), 64, config)
    try:
        status, _, raw = asyncio.run(_post(app, "10.0.0.1", path, {"model": MODEL, **body}))
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == 400 and flag in err["message"], err
        assert err["param"] in ("prompt", "input")
        assert engine.engine.core.num_unfinished_requests == 0
        ok = {"prompt": ["abc", "abc"], "max_tokens": 1} if path == "/v1/completions" else {"input": ["abc", "abc"]}
        status, _, raw = asyncio.run(_post(app, "10.0.0.1", path, {"model": MODEL, **ok}))
        assert status == 200, raw
    finally:
        engine.shutdown()


def test_a_many_prompt_request_shares_the_engine_with_another_clients_request():
    """One client's 12 prompts, streamed, against an engine that runs 2 sequences at a
    time; another client's one prompt arrives once they run. Before, the 12 went in
    first in full and the other request waited for all of them; with a window of 2
    places per client, the other request is answered while most of the 12 still wait,
    and the first client never holds more than its 2 places."""
    scheduler = SchedulerConfig(max_num_seqs=2)
    engine = AsyncEngine(
        Engine.create(
            SlowRunner(4),
            ToyTokenizer(),
            EngineConfig(num_blocks=64, block_size=4, max_model_len=64, scheduler=scheduler),
        )
    )
    app = build_app(
        engine, ToyTokenizer(), 64, ServerConfig(served_model_name=MODEL, max_inflight_prompts_per_client=2)
    )
    windows = app.state.served.windows
    many = {"model": MODEL, "prompt": [f"p{i}" for i in range(12)], "max_tokens": 12, "stream": True}

    async def main():
        events: list = []
        held: list[int] = []
        big = asyncio.create_task(_post(app, "10.0.0.1", "/v1/completions", many, events))

        async def watch():
            while not big.done():
                held.append(windows.in_use("addr:10.0.0.1"))
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        while engine.engine.core.num_unfinished_requests == 0:
            await asyncio.sleep(0.001)
        small = await _post(app, "10.0.0.2", "/v1/completions", {"model": MODEL, "prompt": "q", "max_tokens": 4})
        answered_at = time.monotonic()
        await big
        await watcher
        return events, held, small, answered_at

    try:
        events, held, small, answered_at = asyncio.run(main())
    finally:
        engine.shutdown()
    assert small[0] == 200 and json.loads(small[2])["choices"][0]["text"]
    finished_before = set()
    finished = set()
    for t, body in events:
        for line in body.decode().splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("finish_reason"):
                        finished.add(choice["index"])
                        if t < answered_at:
                            finished_before.add(choice["index"])
    assert finished == set(range(12))  # the many-prompt request was answered in full
    assert len(finished_before) <= 4, f"{len(finished_before)} of the 12 prompts went before the other client's one"
    assert max(held) == 2


def test_a_window_shrinks_to_a_few_places_while_others_wait():
    """While busy() (other requests wait for the engine), a client's prompts past BUSY_PLACES
    wait even though its window has room; once nobody waits, they enter."""
    from tokenmill.server.guards.admission import BUSY_PLACES, ClientWindows

    windows = ClientWindows(32)
    others_waiting = True

    async def main():
        entered = asyncio.Event()
        release = asyncio.Event()

        async def prompt():
            async with windows.place("addr:a", lambda: others_waiting):
                entered.set()
                await release.wait()

        tasks = [asyncio.create_task(prompt()) for _ in range(10)]
        await asyncio.sleep(0.1)
        held_while_busy = windows.in_use("addr:a")
        nonlocal others_waiting
        others_waiting = False
        await asyncio.sleep(0.1)
        held_when_idle = windows.in_use("addr:a")
        release.set()
        await asyncio.gather(*tasks)
        return held_while_busy, held_when_idle

    busy, idle = asyncio.run(main())
    assert busy == BUSY_PLACES and idle == 10
    assert windows.in_use("addr:a") == 0


# Issue 57: the client is who it really is, fairness by tokens, priority by permission.


def _app(scheduler: SchedulerConfig, runner: ScriptedRunner | None = None, **server):
    engine = AsyncEngine(
        Engine.create(
            runner or ScriptedRunner(4),
            ToyTokenizer(),
            EngineConfig(num_blocks=256, block_size=4, max_model_len=128, scheduler=scheduler),
        )
    )
    return engine, build_app(engine, ToyTokenizer(), 128, ServerConfig(served_model_name=MODEL, **server))


def test_a_bearer_token_no_one_configured_does_not_make_a_new_client():
    """No --api-key: two many-prompt requests from one address, each with a random
    bearer token of its own, share that address's window (2 places), rather than each
    opening a window as a client of its own (the engine held 4 of their prompts)."""
    engine, app = _app(SchedulerConfig(max_num_seqs=8), SlowRunner(4), max_inflight_prompts_per_client=2)
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(6)], "max_tokens": 8, "ignore_eos": True}

    async def main():
        peak = 0

        async def one(token: str):
            return await _post(app, "10.0.0.1", "/v1/completions", body, headers={"Authorization": f"Bearer {token}"})

        both = asyncio.gather(one(secrets.token_hex(8)), one(secrets.token_hex(8)))
        while not both.done():
            peak = max(peak, engine.engine.core.num_unfinished_requests)
            await asyncio.sleep(0.001)
        return await both, peak

    try:
        answers, peak = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [status for status, _, _ in answers] == [200, 200]
    assert all(len(json.loads(raw)["choices"]) == 6 for _, _, raw in answers)
    assert peak == 2, f"{peak} prompts of one address were in the engine at once (its window has 2 places)"


def test_another_clients_embedding_is_computed_beside_a_heavy_request_not_behind_it():
    """One client's embedding request of 8 long inputs, 4 of them in the engine, then
    another client's one input: while both have prompt tokens to compute, each gets half
    of a step's budget (64 tokens), so the other client's input is computed in the first
    step, not after the 4 ahead of it in the queue (FCFS: 4 x 60 tokens, 4 steps)."""
    import threading

    runner = ScriptedRunner(4)
    engine, app = _app(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), runner)
    heavy = {"model": MODEL, "input": [chr(65 + i) * 60 for i in range(8)]}
    light = {"model": MODEL, "input": "z" * 40}
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:  # the engine's loop waits here, so that both requests are queued when it steps
        entered.set()
        gate.wait()

    async def main():
        held = asyncio.create_task(engine.run_on_loop(hold))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        big = asyncio.create_task(_post(app, "10.0.0.1", "/v1/embeddings", heavy))
        for _ in range(500):  # its first 4 inputs queued (the window's places while others wait)
            if engine.num_waiting >= 4:
                break
            await asyncio.sleep(0.01)
        small = asyncio.create_task(_post(app, "10.0.0.2", "/v1/embeddings", light))
        for _ in range(500):
            if engine.num_waiting >= 5:
                break
            await asyncio.sleep(0.01)
        gate.set()
        await held
        return await big, await small

    try:
        (big_status, _, _), (small_status, _, _) = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert big_status == 200 and small_status == 200
    first = runner.batches[0]
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in first.new_requests}
    chunks = sorted((prompt_len[s.request_id], s.num_tokens) for s in first.scheduled)
    assert chunks == [(40, 32), (60, 32)], chunks  # each client half the budget; before: [(60, 60), (60, 4)]


def test_a_priority_ahead_of_the_default_needs_the_operators_leave():
    """--scheduling-policy priority: any client may put itself behind (priority > 0), but
    ahead (below --min-priority, 0) only with a --priority-api-key: otherwise a 400 that
    names the flags, and nothing is queued; a bearer token no one configured is no key."""
    engine, app = _app(SchedulerConfig(scheduling_policy="priority"), priority_api_key=("prio-key",))
    cases = [
        ({}, -3, 400),
        ({"Authorization": "Bearer a-random-token"}, -3, 400),
        ({"Authorization": "Bearer prio-key"}, -3, 200),
        ({}, 3, 200),
    ]
    try:
        for headers, priority, status in cases:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "priority": priority}
            got, _, raw = asyncio.run(_post(app, "10.0.0.1", "/v1/completions", body, headers=headers))
            assert got == status, (headers, priority, raw)
            if status == 400:
                err = json.loads(raw)["error"]
                assert err["param"] == "priority" and err["type"] == "BadRequestError"
                assert "--priority-api-key" in err["message"] and "--min-priority" in err["message"]
            assert engine.engine.core.num_unfinished_requests == 0
    finally:
        engine.shutdown()
