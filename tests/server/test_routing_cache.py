"""Several models in one app, routers between them and the response cache, in process on
scripted engines (no weights): what a client is answered, by which model, from where."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
import types

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer, expected_output
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_models_app
from tokenmill.server.gateway.models import ServedModel

KEYS = ("key-a", "key-b")


def scripted(name: str, logprob: float, context: int = 512) -> ServedModel:
    """A model whose every sampled token has probability exp(logprob)."""
    engine = AsyncEngine(
        Engine.create(
            ScriptedRunner(4, logprob=logprob),
            ToyTokenizer(),
            EngineConfig(num_blocks=512, block_size=4, max_model_len=context),
        )
    )
    return ServedModel(name, engine, ToyTokenizer(), context)


@pytest.fixture
def make_app():
    started: list[ServedModel] = []

    def make(small_logprob: float = -0.1, small_context: int = 512, **config):
        models = [scripted("small", small_logprob, small_context), scripted("large", -0.01)]
        started.extend(models)
        base = {"api_key": KEYS, "router": ("auto=small,large",), "response_cache": "exact"}
        return build_models_app(models, ServerConfig(**{**base, **config}))

    yield make
    for m in started:
        m.engine.shutdown()


def call(app, path: str, body: dict | None = None, key: str = KEYS[0], method: str = "POST") -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            return await c.request(method, path, json=body, headers={"authorization": f"Bearer {key}"})

    return asyncio.run(go())


def chat(app, content: str = "hello", key: str = KEYS[0], **fields) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6}
    return call(app, "/v1/chat/completions", {**body, **fields}, key)


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def streamed(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def metric(app, name: str, **labels: str) -> float:
    text = call(app, "/metrics", method="GET").text
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def scripted_answer(content: str, max_tokens: int = 6) -> str:
    tok = ToyTokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), False)
    return tok.decode(expected_output(prompt, max_tokens))


# ------------------------------------------------------------------ several models


def test_every_model_and_router_is_listed_and_chosen_by_name(make_app):
    app = make_app()
    cards = {c["id"]: c for c in call(app, "/v1/models", method="GET").json()["data"]}
    assert set(cards) == {"small", "large", "auto"}
    assert cards["auto"]["router"]["small"] == "small" and cards["auto"]["router"]["large"] == "large"
    for name in ("small", "large"):
        r = chat(app, model=name, cache=False)
        assert r.json()["model"] == name and answer(r) == scripted_answer("hello")
        assert "x-tokenmill-route" not in r.headers
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 6
    assert metric(app, "tokenmill:generation_tokens_total", model_name="large") == 6
    assert metric(app, "tokenmill:num_requests_running", model_name="large") == 0
    types = [line for line in call(app, "/metrics", method="GET").text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))  # each metric once, with a sample per model (the format allows no repeat)


def test_a_router_is_refused_where_nothing_is_routed_and_unknown_models_are_404(make_app):
    app = make_app()
    r = call(app, "/v1/embeddings", {"model": "auto", "input": "hi"})
    assert r.status_code == 400 and "router" in r.json()["error"]["message"] and "small" in r.json()["error"]["message"]
    r = call(app, "/tokenize", {"model": "auto", "prompt": "hi"})
    assert r.status_code == 400
    r = chat(app, model="nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for key in KEYS:  # every key is let in; others are not
        assert chat(app, key=key, model="small").status_code == 200
    assert chat(app, key="other", model="small").status_code == 401


# ------------------------------------------------------------------------- routing


@pytest.mark.parametrize(
    "small_logprob,routed,reason", [(-0.1, "small", "confident"), (-2.0, "large", "low_confidence")]
)
def test_the_cascade_keeps_a_confident_small_answer_and_escalates_an_unsure_one(
    make_app, small_logprob, routed, reason
):
    app = make_app(small_logprob, router_threshold=0.5, response_cache="off")  # exp(-0.1) = 0.90, exp(-2) = 0.14
    for stream in (False, True):
        r = chat(app, stream=stream)
        assert r.headers["x-tokenmill-route"] == routed and r.headers["x-tokenmill-route-reason"] == reason
        assert float(r.headers["x-tokenmill-route-confidence"]) == pytest.approx(2.718281828**small_logprob, abs=1e-3)
        text = streamed(r) if stream else answer(r)
        assert text == scripted_answer("hello")
        if not stream:
            assert r.json()["model"] == routed
            assert r.json()["choices"][0]["logprobs"] is None  # asked by the router, not by the client
    assert metric(app, "tokenmill:model_router_requests_total", router="auto", model_name=routed, reason=reason) == 2
    # the small model answered every time (and was counted once per answer); the large only when escalated
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 12
    large = metric(app, "tokenmill:generation_tokens_total", model_name="large") if routed == "large" else 0
    assert large == (12 if routed == "large" else 0)


@pytest.mark.parametrize("small_logprob,routed", [(-0.1, "small"), (-2.0, "large")])
def test_the_responses_api_is_routed_too(make_app, small_logprob, routed):
    app = make_app(small_logprob)
    for stream in (False, True):
        r = call(
            app,
            "/v1/responses",
            {"model": "auto", "input": "hello", "temperature": 0, "max_output_tokens": 6, "stream": stream},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-tokenmill-route"] == routed and "x-tokenmill-cache" not in r.headers  # (not cached)
        if stream:
            done = [
                json.loads(line[6:])
                for line in r.text.splitlines()
                if line.startswith("data: ") and '"type": "response.incomplete"' in line
            ]  # (max_output_tokens reached)
            body = done[-1]["response"]
        else:
            body = r.json()
        assert body["model"] == routed and body["output"][0]["content"][0]["text"] == scripted_answer("hello")
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 12  # each answer counted once
    if routed == "large":
        assert metric(app, "tokenmill:generation_tokens_total", model_name="large") == 12


def test_rules_route_before_the_small_model_runs(make_app, monkeypatch):
    module = types.ModuleType("tm_test_classifier")
    module.classify = lambda body: "small" if "easy" in body["messages"][-1]["content"] else None
    monkeypatch.setitem(sys.modules, "tm_test_classifier", module)
    app = make_app(
        -2.0, router_max_prompt_tokens=40, router_classifier="tm_test_classifier:classify", response_cache="off"
    )
    cases = [  # (tools and response_format: tests/unit/test_model_router.py; a scripted engine has no grammars)
        ({"content": "easy one"}, "small", "classifier"),  # the classifier first: even an unsure small model answers
        ({"content": "x" * 60}, "large", "long_prompt"),
        ({}, "large", "low_confidence"),
    ]
    for fields, model, reason in cases:
        r = chat(app, **fields)
        assert r.status_code == 200, r.text
        assert (r.headers["x-tokenmill-route"], r.headers["x-tokenmill-route-reason"]) == (model, reason), fields
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 6 + 6  # classifier, cascade


def test_a_prompt_the_small_model_has_no_room_for_goes_to_the_large(make_app):
    app = make_app(small_context=64, response_cache="off")
    r = chat(app, "x" * 100)
    assert (r.headers["x-tokenmill-route"], r.headers["x-tokenmill-route-reason"]) == ("large", "long_prompt")
    assert answer(r) == scripted_answer("x" * 100)
    assert chat(app, "x" * 600).status_code == 400  # nor the large: the large model's own 400


def test_a_streamed_cascade_shows_no_logprobs_the_client_did_not_ask_for(make_app):
    app = make_app(response_cache="off")
    body = {
        "model": "auto",
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "prompt_logprobs": 0,
        "stream": True,
    }
    r = call(app, "/v1/completions", body)
    assert r.headers["x-tokenmill-route"] == "small"
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    assert "prompt_logprobs" in chunks[0]["choices"][0]  # what was asked is there


def test_twins_of_an_answer_too_large_to_keep_compute_alongside_instead_of_queueing(make_app):
    app = make_app(response_cache_memory="100B")  # no answer fits

    async def go():
        body = {"model": "small", "messages": [{"role": "user", "content": "big"}], "temperature": 0, "max_tokens": 6}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            return await asyncio.gather(
                *[
                    c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[0]}"})
                    for _ in range(3)
                ]
            )

    replies = asyncio.run(go())
    assert {answer(r) for r in replies} == {scripted_answer("big")}
    assert [r.headers["x-tokenmill-cache"] for r in replies] == ["miss"] * 3
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 18
    assert app.state.served.cache.pending == {} and app.state.served.cache.entries == {}


def test_a_classifier_that_answers_nonsense_is_a_500_naming_it(make_app, monkeypatch):
    module = types.ModuleType("tm_bad_classifier")
    module.classify = lambda body: "medium"
    monkeypatch.setitem(sys.modules, "tm_bad_classifier", module)
    r = chat(make_app(router_classifier="tm_bad_classifier:classify"))
    assert r.status_code == 500 and "classifier" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- cache


def test_a_repeat_is_a_hit_identical_to_the_fresh_answer_streamed_or_not(make_app):
    app = make_app()
    fresh = chat(app, "what is up", model="small")
    assert fresh.headers["x-tokenmill-cache"] == "miss"
    for stream in (False, True):
        r = chat(
            app, "what is up", model="small", stream=stream, stream_options={"include_usage": True} if stream else None
        )
        assert r.headers["x-tokenmill-cache"] == "hit" and r.headers["x-tokenmill-cache-kind"] == "exact"
        assert (streamed(r) if stream else answer(r)) == answer(fresh)
    usage = chat(app, "what is up", model="small").json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert usage["completion_tokens_details"]["cached_tokens"] == usage["completion_tokens"] == 6
    assert metric(app, "tokenmill:generation_tokens_total", model_name="small") == 6  # computed once
    assert metric(app, "tokenmill:response_cache_hits_total", kind="exact") == 3
    assert metric(app, "tokenmill:response_cache_misses_total") == 1


def test_twins_in_flight_wait_for_one_answer_instead_of_computing_it_again(make_app):
    app = make_app()

    async def go():
        body = {
            "model": "small",
            "messages": [{"role": "user", "content": "popular"}],
            "temperature": 0,
            "max_tokens": 6,
        }
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            return await asyncio.gather(
                *[
                    c.post(
                        "/v1/chat/completions",
                        json={**body, "stream": i == 3},
                        headers={"authorization": f"Bearer {KEYS[0]}"},
                    )
                    for i in range(4)
                ]
            )

    replies = asyncio.run(go())
    assert {streamed(r) if i == 3 else answer(r) for i, r in enumerate(replies)} == {scripted_answer("popular")}
    # the non-streamed twins of the first wait for its answer; a streamed one (it would see its first token only at
    # the end) computes its own unless it was first
    computed = metric(app, "tokenmill:generation_tokens_total", model_name="small")
    hits = [r.headers["x-tokenmill-cache"] for r in replies[:3]].count("hit")
    assert (computed, hits) in ((6, 3), (12, 2))
    assert app.state.served.cache.pending == {}


def test_a_twin_that_fails_lets_the_waiting_one_compute_its_own(make_app):
    app = make_app()
    served = app.state.served
    body = {"model": "small", "messages": [{"role": "user", "content": "x"}], "temperature": 0, "max_tokens": 1000}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            post = functools.partial(c.post, "/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[0]}"})
            return await asyncio.gather(post(json=body), post(json=body))

    bad, worse = asyncio.run(go())  # max_tokens beyond the context: a 400 for both, nobody waits for ever
    assert bad.status_code == worse.status_code == 400 and served.cache.pending == {}


def test_a_routed_answer_is_cached_with_its_route(make_app):
    app = make_app(-2.0)
    first, again = chat(app, "route me"), chat(app, "route me")
    assert again.headers["x-tokenmill-cache"] == "hit"
    assert again.headers["x-tokenmill-route"] == first.headers["x-tokenmill-route"] == "large"
    assert answer(again) == answer(first)


def test_tenants_never_share_an_answer(make_app):
    app = make_app()
    assert chat(app, "secret plan", key=KEYS[0]).headers["x-tokenmill-cache"] == "miss"
    assert chat(app, "secret plan", key=KEYS[1]).headers["x-tokenmill-cache"] == "miss"
    assert chat(app, "secret plan", key=KEYS[1]).headers["x-tokenmill-cache"] == "hit"


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 5},
        {"stop": ["Q"]},
        {"seed": 3},
        {"top_k": 2},
        {"n": 2},
        {"presence_penalty": 0.5},
        {"logprobs": True},
        {"model": "large"},
        {"content": "hello!"},
        {"logit_bias": {"3": 1.0}},
    ],
)
def test_any_change_of_model_message_or_sampling_field_misses(make_app, change):
    app = make_app()
    assert chat(app, model="small").headers["x-tokenmill-cache"] == "miss"
    assert chat(app, model="small").headers["x-tokenmill-cache"] == "hit"
    assert chat(app, **{"model": "small", **change}).headers["x-tokenmill-cache"] == "miss"


def test_only_reproducible_requests_are_cached_and_cache_false_or_private_opt_out(make_app):
    app = make_app()
    sampled = {"model": "small", "temperature": 0.8}
    assert chat(app, **sampled).headers["x-tokenmill-cache"] == "bypass"
    assert chat(app, **sampled, seed=7).headers["x-tokenmill-cache"] == "miss"
    assert chat(app, **sampled, seed=7).headers["x-tokenmill-cache"] == "hit"
    for opt_out in ({"cache": False}, {"messages": [{"role": "user", "content": "hello", "private": True}]}):
        for _ in range(2):
            assert chat(app, model="small", **opt_out).headers["x-tokenmill-cache"] == "bypass"
    off = make_app(response_cache="off")
    for beams in (False, True):
        r = chat(off, model="small", cache=True, use_beam_search=beams)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache"
    r = chat(app, model="small", cache=True, use_beam_search=True)
    assert r.status_code == 400 and "beam search" in r.json()["error"]["message"]
    assert "x-tokenmill-cache" not in chat(off, model="small").headers


def test_completions_are_cached_too_and_expire(make_app):
    app = make_app(response_cache_ttl=0.3)
    body = {"model": "small", "prompt": "abc", "max_tokens": 4, "temperature": 0}
    first = call(app, "/v1/completions", body)
    assert first.headers["x-tokenmill-cache"] == "miss"
    again = call(app, "/v1/completions", body)
    assert again.headers["x-tokenmill-cache"] == "hit" and again.json()["choices"] == first.json()["choices"]
    time.sleep(0.35)
    assert call(app, "/v1/completions", body).headers["x-tokenmill-cache"] == "miss"
    assert metric(app, "tokenmill:response_cache_expirations_total") == 1


def test_semantic_hits_stay_within_the_tenant_and_the_conversation_and_skip_what_they_must(make_app):
    app = make_app(response_cache="semantic")  # the scripted model embeds everything alike: every look-alike is near
    assert chat(app, "what is the capital of France", model="small").headers["x-tokenmill-cache"] == "miss"
    r = chat(app, "capital of france?", model="small")
    assert r.headers["x-tokenmill-cache"] == "hit" and r.headers["x-tokenmill-cache-kind"] == "semantic"
    assert answer(r) == scripted_answer("what is the capital of France")
    assert r.json()["usage"]["prompt_tokens"] == len(ToyTokenizer().encode("user: capital of france?\nassistant: "))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    misses = [
        {"key": KEYS[1]},  # another tenant
        {"max_tokens": 5},  # another bucket: a field besides the last message differs
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "capital?"}]},
        {"tools": [tool], "tool_choice": "none"},
        {"logprobs": True},
    ]
    for fields in misses:
        assert chat(app, "france capital", model="small", **fields).headers["x-tokenmill-cache"] == "miss", fields
    assert chat(app, "france capital?!", model="small", temperature=0.5, seed=1).headers["x-tokenmill-cache"] == "miss"
    private = [{"role": "user", "content": "capital of france", "private": True}]
    assert chat(app, model="small", messages=private).headers["x-tokenmill-cache"] == "bypass"
