"""vLLM's use_beam_search and OpenAI's best_of over HTTP."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tokenmill import BeamSearchParams

openai = pytest.importorskip("openai")


def test_use_beam_search_answers_the_offline_beams(client, llm):
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        n=2,
        best_of=3,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.8},
    )
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8))[0].beams
    want = [llm.tokenizer.decode(b.tokens[:-1] if b.finished else b.tokens) for b in beams[:2]]
    assert [c.text for c in r.choices] == want and [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(b.tokens) for b in beams[:2])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)


def test_beam_search_with_logprobs_returns_each_beams_own(client, llm):
    """vLLM returns each beam's logprobs (issue 43): the tokens of the answered beam, their
    logprobs summing to the beam's cumulative logprob, and the top k alternatives of each step."""
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        n=2,
        best_of=2,
        temperature=0,
        logprobs=3,
        extra_body={"use_beam_search": True},
    )
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=5))[0].beams
    for choice, beam in zip(r.choices, beams, strict=True):
        kept = beam.tokens[:-1] if beam.finished else beam.tokens
        lp = choice.logprobs
        assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in kept]
        assert lp.token_logprobs == pytest.approx(beam.logprobs[: len(kept)], abs=1e-4)
        assert all(
            len(top) == 3 and max(top.values()) >= v - 1e-6
            for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
        )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"use_beam_search": True, "return_tokens_as_token_ids": True},
    )
    for c in chat.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert all(t.token.startswith("token_id:") for t in c.logprobs.content)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"return_timings": True}, "return_timings"),
        ({"n": 3, "best_of": 2}, "best_of must be in [n"),
        ({"n": 11}, "beam_width"),
        ({"stop": ["x"]}, "stop"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(http, extra, needle):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "use_beam_search": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_best_of_answers_the_samples_with_the_highest_cumulative_logprob(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(**kwargs, n=4, logprobs=0)  # the same four samples (seeds 11..14)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(**kwargs, n=2, best_of=4)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all four were generated
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(**kwargs, n=1, best_of=2, stream=True)
