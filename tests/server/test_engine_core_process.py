"""The engine core in its own process (AsyncCoreClient + core_loop), against the
offline engine: same tokens and text, stop strings ended in the core, aborts and
refusals that leave nothing behind, and a dead core that fails its streams."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import signal
import time

import httpx
import pytest

from tests.helpers import engine_core_pid, loads_torch
from tests.server.conftest import MODEL, Server
from tokenmill import PoolingParams, SamplingParams
from tokenmill.configuration.args import engine_args
from tokenmill.core_process import run_engine_core
from tokenmill.engine.api.core_client import AsyncCoreClient
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError

PROMPTS = ["The sun is", "Water boils at", "My favourite book is", "Cats and dogs", "List three colours:"]


def start_client(heartbeat_timeout: float = 30.0, **options) -> AsyncCoreClient:
    from tokenmill.model.paths import resolve_model_path
    from tokenmill.model.tokenizer import load_tokenizer

    args = engine_args(dtype="float32", kv_cache_memory="256MiB", **options)
    return AsyncCoreClient(
        functools.partial(run_engine_core, args),
        load_tokenizer(resolve_model_path(None)),
        heartbeat_timeout=heartbeat_timeout,
    )


@pytest.fixture(scope="module")
def client():
    c = start_client()
    yield c
    c.shutdown()


async def collect(client, rid, prompt, params):
    outs = []
    async for out in client.generate(rid, prompt, params):
        outs.append(out)
    return outs


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_streams_from_the_core_process_equal_the_offline_engine(client, llm):
    params = [
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop=[" the", "."]),
        SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, include_stop_str_in_output=True, stop=["e"]),
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[13]),
    ]
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    offline = llm.generate(ids, params)

    async def run():
        return await asyncio.gather(*(collect(client, f"r{i}", ids[i], params[i]) for i in range(len(ids))))

    served = asyncio.run(run())
    for want, outs in zip(offline, served, strict=True):
        finals = sorted((o for o in outs if o.finished), key=lambda o: o.outputs[0].index)
        assert len(finals) == len(want.outputs)
        for w, got in zip(want.outputs, finals, strict=True):
            c = got.outputs[0]
            assert c.token_ids == w.token_ids
            assert c.text == w.text
            assert (c.finish_reason, c.stop_reason) == (w.finish_reason, w.stop_reason)
            # the streamed deltas add up to the whole
            assert "".join(o.delta_text for o in outs if o.outputs[0].index == c.index) == w.text
            if w.logprobs is not None:
                assert c.logprobs == pytest.approx(w.logprobs, abs=1e-4)
                assert [dict(t) for t in c.top_logprobs] == [pytest.approx(dict(t), abs=1e-4) for t in w.top_logprobs]
    wait_for(lambda: client.snapshot().num_running == 0 and client.snapshot().kv_usage == 0)


def test_a_stop_string_found_in_the_api_process_ends_the_sequence_in_the_core(client):
    # ignore_eos and a long max_tokens (tens of seconds of decoding): only the stop string ends it soon
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True, stop=[" "])
    outs = asyncio.run(collect(client, "stop-1", "Once upon a time", params))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == " "
    assert len(outs[-1].outputs[0].token_ids) < 20
    wait_for(lambda: client.snapshot().num_running == 0 and client.snapshot().kv_usage == 0, timeout=5)


def test_leaving_a_stream_early_aborts_the_request_in_the_core(client):
    async def run():
        seen = 0
        async for _ in client.generate(
            "early", "Tell me a long story", SamplingParams(max_tokens=500, ignore_eos=True)
        ):
            seen += 1
            if seen == 3:
                assert client.snapshot().num_running == 1
                break

    asyncio.run(run())
    wait_for(lambda: client.snapshot().num_running == 0 and client.snapshot().kv_usage == 0)


def test_bad_requests_are_refused_with_the_field_at_fault_and_leave_nothing(client):
    async def run(prompt, params):
        return await collect(client, f"bad-{time.time_ns()}", prompt, params)

    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(run([1, 2, 10**7], SamplingParams(max_tokens=4)))
    assert e.value.param == "prompt" and "vocabulary" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(run("x", SamplingParams(max_tokens=4, structured={"regex": "(unclosed"})))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        asyncio.run(_generate_with_lora(client))
    assert not client.outputs._seqs and not client._seq_ids and not client._accepting
    # and the core still serves
    outs = asyncio.run(collect(client, "after-bad", "Hello", SamplingParams(max_tokens=3, temperature=0)))
    assert outs[-1].finished and len(outs[-1].token_ids) == 3


async def _generate_with_lora(client):
    async for _ in client.generate("lora-1", "x", SamplingParams(max_tokens=4), lora="nope"):
        pass


def test_a_structured_request_is_compiled_in_the_core_and_obeyed(client):
    params = SamplingParams(max_tokens=20, temperature=0, structured={"choice": ["yes", "no"]})
    outs = asyncio.run(collect(client, "choice", "Is water wet? Answer:", params))
    assert outs[-1].text in ("yes", "no") and outs[-1].finish_reason == "stop"


def test_a_core_that_fails_to_start_reports_why():
    with pytest.raises(TokenmillError, match="no-such-model"):
        start_client(model="/nonexistent/no-such-model.gguf")


def test_a_core_that_dies_fails_its_streams_and_says_so():
    c = start_client()
    try:

        async def run():
            async for _ in c.generate(
                "doomed", "Count to a thousand:", SamplingParams(max_tokens=2000, ignore_eos=True)
            ):
                if c.process.is_alive():
                    os.kill(c.process.pid, signal.SIGKILL)

        with pytest.raises(EngineDeadError, match="died"):
            asyncio.run(run())
        assert c.is_dead and c.death is not None
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(c, "after", "x", SamplingParams(max_tokens=2)))
    finally:
        c.shutdown()


def test_serve_runs_the_engine_core_apart_and_exits_when_it_dies():
    server = Server()
    try:
        core = engine_core_pid(server.proc.pid)
        assert loads_torch(core) and not loads_torch(server.proc.pid)  # the model lives in the core only
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        os.kill(core, signal.SIGKILL)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert server.proc.wait(timeout=30) == 1
        assert "the engine died" in server.proc.stderr.read()
    finally:
        server.stop()


def test_serve_with_the_engine_loop_on_a_thread_keeps_one_process():
    server = Server("--engine-core", "thread")
    try:
        assert loads_torch(server.proc.pid)
        with pytest.raises(AssertionError, match="no engine-core child"):
            engine_core_pid(server.proc.pid)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


def big_schema(tag: str, n: int = 2000) -> dict:
    """A schema that takes a good fraction of a second to compile (n required properties)."""
    props = {f"{tag}_{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_grammar_slower_than_its_compile_timeout_is_refused_and_plain_requests_do_not_wait():
    """Issue 24 item 2: compiles run on the engine's own compile thread with a time
    budget. Past it, the request is refused (400 before queueing); the compile goes on
    and is cached, so a retry is served at once; a plain request is never queued
    behind compiles."""
    c = start_client(grammar_compile_timeout=0.05)
    try:

        async def run():
            slow = [
                asyncio.ensure_future(
                    collect(c, f"s{i}", "x", SamplingParams(max_tokens=2, structured={"json": big_schema(f"s{i}")}))
                )
                for i in range(3)
            ]
            plain = await collect(c, "plain", "Hello", SamplingParams(max_tokens=2))
            assert plain[-1].finished and not any(s.done() and not s.exception() for s in slow)
            return await asyncio.gather(*slow, return_exceptions=True)

        results = asyncio.run(run())
        assert all(isinstance(r, InvalidRequestError) and "--grammar-compile-timeout" in str(r) for r in results), (
            results
        )
        wait_for(lambda: c.snapshot().num_running == 0)
        # the refused compiles finish in the background (one thread: seconds on a busy
        # machine), into the cache: a retry is then served, however short its budget
        deadline = time.monotonic() + 60
        for attempt in itertools.count():
            try:
                outs = asyncio.run(
                    collect(
                        c, f"retry{attempt}", "x", SamplingParams(max_tokens=2, structured={"json": big_schema("s0")})
                    )
                )
                break
            except InvalidRequestError:
                assert time.monotonic() < deadline, "the refused grammar never reached the cache"
                time.sleep(0.5)
        assert outs[-1].finished
    finally:
        c.shutdown()


def _within(seconds: float, scenario) -> None:
    """Run ``scenario`` (a coroutine function) on a thread's event loop; fail if it has not
    ended in ``seconds`` (a locked pipe never ends: the thread is left behind)."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(scenario())
        except BaseException as e:
            error.append(e)

    import threading

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: the pipe to the core is locked"
    if error:
        raise error[0]


def test_thousands_of_requests_put_in_at_once_and_dropped_never_lock_the_pipe():
    """Issue 40: 10,000 embeddings put in at once filled the pipe both ways (the event loop
    sending adds, the core sending their answers) and locked the server for good."""
    c = start_client()
    try:

        async def flood() -> None:
            params = PoolingParams("last")
            ids = c.tokenizer.encode("word after word " * 20)

            async def one(i: int) -> None:
                async for _ in c.generate(f"flood-{i}", ids, params):
                    pass

            tasks = [asyncio.create_task(one(i)) for i in range(10_000)]
            await asyncio.sleep(3)  # answers flowing back while adds still go in
            for t in tasks:  # the client drops: every request is aborted
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            outs = await collect(c, "after-flood", "Hello", SamplingParams(max_tokens=4, temperature=0))
            assert outs[-1].finished and len(outs[-1].token_ids) == 4

        try:
            _within(120, flood)
        except AssertionError:
            c.process.kill()  # a locked client cannot be shut down: its lock is held for good
            raise
        wait_for(lambda: c.snapshot().num_running == 0 and c.snapshot().num_waiting == 0, 30)
    finally:
        c.shutdown()


def test_a_core_that_stops_answering_is_counted_dead_within_the_heartbeat_timeout():
    c = start_client(heartbeat_timeout=3.0)
    try:
        os.kill(c.process.pid, signal.SIGSTOP)  # frozen: the pipe stays open, nothing comes
        started = time.monotonic()
        wait_for(lambda: c.is_dead, 15)
        assert time.monotonic() - started < 10 and "not answered" in str(c.death)
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(c, "after", "x", SamplingParams(max_tokens=2)))
        c.process.join(5)
        assert not c.process.is_alive()  # killed, not left frozen
    finally:
        if c.process.is_alive():
            os.kill(c.process.pid, signal.SIGCONT)
        c.shutdown()
