"""Overload, SIGTERM drain, a fuzz for 500s, and the serving benchmark, each on a
real server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_until
from tests.server.conftest import API_KEY, MODEL, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_a_full_queue_answers_429_and_the_accepted_requests_finish():
    server = Server("--max-queue", "2", "--max-num-seqs", "1")
    try:

        async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
            await asyncio.sleep(0.05 * i)  # arrive one after another
            return await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 24, "ignore_eos": True}
            )

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                return await asyncio.gather(*(one(c, i) for i in range(10)))

        codes = [r.status_code for r in asyncio.run(main())]
        assert set(codes) == {200, 429} and codes.count(200) >= 3, codes
        busy = next(r for r in asyncio.run(main()) if r.status_code == 429).json()["error"]
        assert busy["type"] == "RateLimitError" and "max_queue=2" in busy["message"]
        assert server.metric("tokenmill:num_requests_running") == 0
    finally:
        assert server.stop() == 0


def refuses_connections(url: str) -> bool:
    """No request gets in: the connection is refused, or (caught in the listening
    socket's backlog as uvicorn closes it) reset before any answer."""
    try:
        httpx.get(url + "/health", timeout=2)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    server = Server("--drain-timeout", "60")
    body = {"model": MODEL, "prompt": "Write a poem.", "max_tokens": 30, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    server.proc.send_signal(signal.SIGTERM)
                    assert wait_until(lambda: refuses_connections(server.url), timeout=10)  # no longer admitting
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 25  # all 30 tokens came (a few chunks may merge)
    assert server.proc.wait(30) == 0


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = {
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 60000), max_size=5) | JSONISH,
    "max_tokens": st.integers(-3, 4) | JSONISH,
    "temperature": st.floats(-1, 3) | JSONISH,
    "top_p": st.floats(-0.5, 1.5) | JSONISH,
    "top_k": st.integers(-3, 100) | JSONISH,
    "min_p": st.floats(-1, 2) | JSONISH,
    "n": st.integers(-1, 3) | JSONISH,
    "seed": st.integers(-(2**70), 2**70) | JSONISH,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | JSONISH,
    "logprobs": st.integers(-2, 25) | JSONISH,
    "presence_penalty": st.floats(-3, 3) | JSONISH,
    "repetition_penalty": st.floats(-1, 3) | JSONISH,
    "stream": st.booleans() | JSONISH,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSONISH,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": st.text(max_size=10) | JSONISH}
        ),
        max_size=3,
    )
    | JSONISH,
    "top_logprobs": st.integers(-1, 25) | JSONISH,
    "max_completion_tokens": st.integers(-1, 4) | JSONISH,
}


@pytest.fixture(scope="module")
def fuzz_client(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
        yield c


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,  # the same 80 bodies every run: CI stays repeatable
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    body=st.fixed_dictionaries({"model": st.just(MODEL)}, optional=FIELDS) | JSONISH,
)
def test_fuzzed_requests_never_get_a_5xx(fuzz_client, path, body):
    if isinstance(body, dict):  # keep generations short: without a limit chat may run to the context's end
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 4:
                body[key] = 4
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
    # json.dumps writes NaN and Infinity as bare words: not JSON, so also a test
    r = fuzz_client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_bench_serve_measures_the_server_and_draws_its_plots(server, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        API_KEY,
        "--num-prompts",
        "6",
        "--dataset",
        "shared-prefix",
        "--request-rate",
        "2,inf",
        "--trace",
        "--output-dir",
        str(tmp_path),
        "--label",
        "t",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "t.json").read_text())
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_token_throughput"] > 0 and run["ttft_s"]["p99"] >= run["ttft_s"]["p50"] > 0
    for png in ("t_latency_cdf.png", "t_trace_inf.png", "t_trace_2.0.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_streams_open_at_the_drain_timeout_end_with_an_error_event_and_done():
    server = Server("--drain-timeout", "2")
    body = {"model": MODEL, "prompt": "Write a long poem.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    server.proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 503 and "drain timeout" in error["message"]
    assert len(lines) < 3000  # ended by the drain, not by max_tokens
    assert server.proc.wait(30) == 0
