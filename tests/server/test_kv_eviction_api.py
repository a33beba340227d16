"""KV eviction over the API (``kv_eviction``, ``--kv-eviction-window``): a request past the
context is served within its cache, opts out by name, and bad or unfit asks are 400s."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, Server

LIMIT = 256
LONG = "The harbour ledgers list tolls, weather and ships for every day of the year. " * 40  # ~640 tokens


@pytest.fixture(scope="module")
def evicting():
    s = Server("--max-model-len", str(LIMIT), "--kv-eviction-window", "64")
    yield s
    assert s.stop() == 0


def test_a_request_past_the_context_is_served_by_the_servers_eviction(evicting):
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=evicting.url, timeout=120) as http:
        before = evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL)
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > LIMIT and usage["completion_tokens"] == 300
        evicted = evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL) - before
        assert evicted >= usage["prompt_tokens"] + 300 - LIMIT
        live = http.get("/tokenmill/live").json()["models"][0]["gauges"]
        assert live["kv_evicted_tokens"] == evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL)

        off = http.post("/v1/completions", json=body | {"kv_eviction": {"policy": "none"}})
        assert off.status_code == 400 and "maximum context length" in off.json()["error"]["message"]

        chat = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        beams = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "use_beam_search": True, "n": 2}
        assert http.post("/v1/completions", json=beams).status_code == 200, "the server's default broke beam search"

        snap = body | {"prompt": LONG[:700], "max_tokens": 16, "kv_eviction": {"policy": "snapkv", "window": 64}}
        before = evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL)
        r = http.post("/v1/completions", json=snap)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL) - before == prompt_tokens - 64
        too_long = http.post("/v1/completions", json=snap | {"prompt": LONG})  # snapkv stays within the context
        assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]


def test_the_responses_api_takes_the_servers_eviction_and_its_opt_out(evicting):
    body = {"model": MODEL, "input": LONG, "max_output_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=evicting.url, timeout=120) as http:
        before = evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL)
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] > LIMIT
        assert evicting.metric("tokenmill:kv_evicted_tokens_total", model_name=MODEL) > before
        off = http.post("/v1/responses", json=body | {"kv_eviction": {"policy": "none"}})
        assert off.status_code == 400 and "maximum context length" in off.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"kv_eviction": {"policy": "h2o"}}, "kv_eviction policy"),
        ({"kv_eviction": {"window": 4096}}, "kv_eviction keeps up to"),
        ({"kv_eviction": {"window": 64}, "use_beam_search": True, "n": 2}, "use_beam_search cannot be combined"),
    ],
)
def test_eviction_that_cannot_apply_is_a_400_that_names_it(evicting, extra, says):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4} | extra
    with httpx.Client(base_url=evicting.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"] and r.json()["error"]["param"] == "kv_eviction"
