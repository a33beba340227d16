"""echo and prompt logprobs over HTTP (what lm-eval's local-completions sends for every
loglikelihood), equal to the offline engine's prompt logprobs."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tokenmill import SamplingParams

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def test_echo_with_logprobs_returns_the_prompt_scored_as_offline(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=2, echo=True, temperature=0)
    choice = r.choices[0]
    ids = llm.tokenizer.encode(PROMPT)
    offline = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, logprobs=2))[0]
    lp = choice.logprobs
    assert choice.text == PROMPT + offline.text and len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens) == choice.text and lp.text_offset[-1] == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got, want = lp.token_logprobs[1 : len(ids)], offline.prompt_logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert abs(lp.token_logprobs[-1] - offline.outputs[0].logprobs[0]) < 1e-4
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # token ids as the prompt (lm-eval sends them): the same scores
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert by_ids.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs[: len(ids)]
    # streamed: the prompt first, then the completion, the same logprobs
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    streamed = [v for c in chunks for v in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert streamed[1 : len(ids)] == lp.token_logprobs[1 : len(ids)]


def test_echo_without_logprobs_and_with_n(client):
    r = client.completions.create(
        model=MODEL, prompt=["Hello", "Bye"], max_tokens=2, n=2, echo=True, temperature=1.0, seed=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompts = ["Hello", "Hello", "Bye", "Bye"]
    assert all(c.text.startswith(p) and len(c.text) > len(p) for c, p in zip(r.choices, prompts, strict=True))
    assert r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, echo=True, logprobs=1, stream=True)


def test_vllm_prompt_logprobs_on_completions_and_chat(client, llm):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    scored = r.choices[0].model_extra["prompt_logprobs"]
    ids = llm.tokenizer.encode(PROMPT)
    assert scored[0] is None and len(scored) == len(ids)
    for j in range(1, len(ids)):
        own = scored[j][str(ids[j])]
        assert own["decoded_token"] == llm.tokenizer.decode([ids[j]], skip_special_tokens=False) and own["rank"] >= 1
        assert 1 <= len(scored[j]) <= 2 and min(v["rank"] for v in scored[j].values()) == 1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5


def test_chat_echo_continues_the_assistant_message(client):
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"add_generation_prompt": False}
    )
    assert r.choices[0].message.content == "My favourite colour is" + plain.choices[0].message.content
    ask = [{"role": "user", "content": "Name a colour."}]  # the last message is not the assistant's: nothing echoed
    a = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    b = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
