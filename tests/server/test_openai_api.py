"""The official `openai` client against a real `tokenmill serve`."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL

openai = pytest.importorskip("openai")


def test_models_health_and_metrics(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = http.get("/metrics").text
    for name in (
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:time_to_first_token_seconds",
        "tokenmill:prefix_cache_queries_total",
    ):
        assert name in text


def test_completion_matches_the_offline_engine(client, llm):
    from tokenmill import SamplingParams

    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].text == offline.outputs[0].text
    assert r.choices[0].finish_reason == offline.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_and_streaming_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in full.choices[0].message.content and full.choices[0].message.role == "assistant"
    # a natural end (the end-of-sequence token): no stop_reason, as vLLM's (it names a stop string or stop_token_ids)
    assert full.choices[0].finish_reason == "stop" and full.choices[0].model_extra["stop_reason"] is None
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done_and_never_leaks_a_stop_string(http):
    body = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5,",
        "max_tokens": 40,
        "temperature": 0,
        "stop": [" 9"],
        "stream": True,
    }
    lines = [line for line in http.post("/v1/completions", json=body).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text.strip().endswith("8,") and " 9" not in text
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "stop"


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=42)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # n seeds: different samples


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_tokenize_detokenize(http):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    for n in needles:
        assert n in err["message"], err["message"]
    return err


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({"temperature": -1}, "temperature", "invalid temperature=-1"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"n": 0}, "n", "invalid n=0"),
        ({"logprobs": 50}, "logprobs", "logprobs"),
        ({"prompt": [99999999]}, "prompt", "outside the vocabulary"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"temperature": "hot"}, "temperature", "temperature"),
        ({"stop": [""]}, "stop", "stop"),
        ({"seed": 2**70}, "seed", "invalid seed"),
    ],
)
def test_invalid_parameters_are_400(http, body, param, needle):
    err = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body}), 400, needle)
    assert err["param"] == param


def test_prompt_beyond_the_context_window_names_both_numbers(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10_000})
    assert_error(r, 400, "maximum context length is 8192 tokens", "10001 tokens", "10000 for the completion")


def test_unknown_model_is_404_and_bad_key_is_401(server, http):
    assert_error(http.post("/v1/completions", json={"model": "gpt-5", "prompt": "hi"}), 404, "gpt-5")
    assert_error(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401, "API key")
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(server.url + "/v1/models", headers=wrong), 401)


def test_malformed_bodies_are_400(http):
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]}), 400, "role")


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert server.metric("tokenmill:num_requests_running") == 1
    # server_idle_after checks that the request ended and its KV blocks are free


def test_fifty_concurrent_streams_all_finish_with_the_right_text(server, http):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(5)]
    expected = {
        p: http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}).json()[
            "choices"
        ][0]["text"]
        for p in prompts
    }

    async def stream(c: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        text = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    async def main() -> list[str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as c:
            return await asyncio.gather(*(stream(c, prompts[i % 5]) for i in range(50)))

    texts = asyncio.run(main())
    assert texts == [expected[prompts[i % 5]] for i in range(50)]
    assert server.metric("tokenmill:request_success_total", finished_reason="length") >= 50


def test_energy_counter_rises_with_the_engine_processes_work(server, client):
    """bench serve reads the server's own joules from /metrics; they rise with a request's
    work, which the engine core does in its own process (counted: a child of the server)."""
    from tokenmill.host.energy import process_tree_cpu_seconds
    from tokenmill.loadgen.energy_probe import EnergyProbe

    probe = EnergyProbe(server.url, API_KEY)
    assert probe.from_server and probe.local is None
    before = probe.read()
    cpu_before = process_tree_cpu_seconds(server.proc.pid)
    client.completions.create(model=MODEL, prompt="The river mill", max_tokens=24, temperature=0)
    after = probe.read()
    assert after[1] == before[1] in ("measured", "estimated") and after[2] == "the server's /metrics"
    assert after[0] > before[0]
    if after[1] == "estimated":  # 3 W per busy CPU over the server's tree (the core process included)
        cpu = process_tree_cpu_seconds(server.proc.pid) - cpu_before
        assert after[0] - before[0] == pytest.approx(3.0 * cpu, rel=0.5, abs=0.1)
