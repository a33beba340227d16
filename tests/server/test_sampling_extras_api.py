"""vLLM's sampling and prompt extras over HTTP: each does what it says (none ignored)."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")
PROMPT = "The capital of France is"


def test_min_tokens_logit_bias_allowed_and_bad_words(client, llm):
    base = dict(model=MODEL, prompt=PROMPT, temperature=0)
    greedy = client.completions.create(**base, max_tokens=12).choices[0].text
    assert (
        "Paris"
        not in client.completions.create(**base, max_tokens=12, extra_body={"bad_words": ["Paris"]}).choices[0].text
    )
    assert "Paris" in greedy
    yes = [{"role": "user", "content": "Say just the word 'yes'."}]
    short = client.chat.completions.create(model=MODEL, messages=yes, temperature=0, max_tokens=40)
    held = client.chat.completions.create(
        model=MODEL,
        messages=yes,
        temperature=0,
        max_tokens=40,
        extra_body={"min_tokens": short.usage.completion_tokens + 5},
    )
    assert held.usage.completion_tokens >= short.usage.completion_tokens + 5
    banana = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(**base, max_tokens=3, logit_bias={str(banana): 100}, logprobs=0)
    assert r.choices[0].text == " banana" * 3
    allowed = llm.tokenizer.encode(" red green", add_special_tokens=False)
    r = client.completions.create(**base, max_tokens=6, extra_body={"allowed_token_ids": allowed})
    assert set(llm.tokenizer.encode(r.choices[0].text, add_special_tokens=False)) <= set(allowed)


def test_truncate_prompt_tokens_and_token_strs(client, http, llm):
    long = "one two three four five six seven eight nine ten " * 4 + PROMPT
    ids = llm.tokenizer.encode(long)
    r = client.completions.create(
        model=MODEL, prompt=long, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 6}
    )
    tail = client.completions.create(model=MODEL, prompt=ids[-6:], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 6 and r.choices[0].text == tail.choices[0].text
    e = client.embeddings.create(model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 6})
    assert e.usage.prompt_tokens == 6
    got = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert got["token_strs"] == [llm.tokenizer.token_to_str(t) for t in got["tokens"]] and len(got["token_strs"]) == 2
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_models_retrieve_and_an_unknown_field_through_the_sdk(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: foo_unknown"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"foo_unknown": 1}
        )


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds():
    """In process, on a scripted engine with a 64-token context (the real server's 8,192
    tokens would take a minute of prefill on two cores)."""
    import asyncio

    import httpx

    from tests.helpers import ScriptedRunner, ToyTokenizer
    from tokenmill.configuration.serving_config import ServerConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import Engine, EngineConfig
    from tokenmill.server.app import build_app

    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    )
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name="toy"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            embedded = await c.post("/v1/embeddings", json={"input": "w" * 500, "truncate_prompt_tokens": -1})
            completed = await c.post(
                "/v1/completions", json={"prompt": "w" * 500, "truncate_prompt_tokens": -1, "max_tokens": 1}
            )
            return embedded, completed

    try:
        embedded, completed = asyncio.run(go())
    finally:
        engine.shutdown()
    assert embedded.status_code == 200 and embedded.json()["usage"]["prompt_tokens"] == 63  # the context, less one
    assert completed.status_code == 200 and completed.json()["usage"]["prompt_tokens"] == 63
