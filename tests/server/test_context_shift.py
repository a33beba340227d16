"""Context shift (``--context-shift``): a chat longer than the context drops its oldest turns,
whole, keeping its system messages and its latest turn, and the answer says what was dropped."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL, Server

SYSTEM = "You are Captain Verity, a careful archivist who answers in one short sentence."
LIMIT = 512


def turn(i: int) -> list[dict]:
    filler = f"Note {i}: the shelf {i} holds ledgers about harbour tolls, weather and ships. " * 5
    return [{"role": "user", "content": filler + f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]


def chat(turns: int, last: str = "What is your name?") -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        messages += turn(i)
    return [*messages, {"role": "user", "content": last}]


@pytest.fixture(scope="module")
def shifting():
    s = Server("--max-model-len", str(LIMIT), "--context-shift")
    yield s
    assert s.stop() == 0


def test_a_chat_past_the_context_drops_its_oldest_turns_and_says_so(shifting):
    body = {"model": MODEL, "messages": chat(12), "max_tokens": 16, "temperature": 0, "return_prompt_text": True}
    with httpx.Client(base_url=shifting.url, timeout=120) as http:
        before = shifting.metric("tokenmill:context_shift_requests_total", model_name=MODEL)
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        shift = answer["context_shift"]
        assert shift["dropped_messages"] >= 2 and shift["dropped_messages"] % 2 == 0  # whole turns: question and answer
        assert shift["dropped_prompt_tokens"] > 0
        prompt = answer["prompt_text"]
        assert SYSTEM in prompt and "What is your name?" in prompt  # the system message and the latest turn
        assert "Question 0?" not in prompt and "Question 11?" in prompt  # the oldest turns went first
        assert LIMIT - 100 < answer["usage"]["prompt_tokens"] + 16 <= LIMIT  # no more dropped than needed (a turn: ~90)
        kept = (len(chat(12)) - shift["dropped_messages"] - 2) // 2  # turns left before the latest
        assert f"Question {12 - kept}?" in prompt and f"Question {11 - kept}?" not in prompt
        assert shifting.metric("tokenmill:context_shift_requests_total", model_name=MODEL) == before + 1
        assert (
            shifting.metric("tokenmill:context_shift_dropped_prompt_tokens_total", model_name=MODEL)
            >= (shift["dropped_prompt_tokens"])
        )

        streamed = http.post("/v1/chat/completions", json=body | {"stream": True})
        chunks = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
        assert chunks[0]["context_shift"] == shift
        assert (
            "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            == (answer["choices"][0]["message"]["content"])
        )

        fits = http.post("/v1/chat/completions", json=body | {"messages": chat(1)}).json()
        assert "context_shift" not in fits and fits["usage"]["prompt_tokens"] < LIMIT // 2

        alone = chat(0, last="Tell me about ledgers. " * 200)  # the latest turn alone is past the context
        refused = http.post("/v1/chat/completions", json=body | {"messages": alone})
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]


def test_without_the_flag_a_chat_past_the_context_is_refused(http):
    body = {"model": MODEL, "messages": chat(160), "max_tokens": 16}  # ~20k tokens, past 8,192
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
