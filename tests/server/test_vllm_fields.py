"""vLLM's request fields that its clients send (issue 43 item 1, 3 and 5), each doing what it
does in vLLM, through the official openai client where vLLM's users pass them
(``extra_body``, ``extra_headers``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tests.server.conftest import MODEL
from tokenmill.configuration.config import SchedulerConfig
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "Name a colour."}]


def test_x_request_id_names_the_request_and_comes_back_on_the_response(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "chatcmpl-trace-42"
    # the body's request_id where no header is sent (vLLM: the header wins)
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"request_id": "mine-1"})
    assert r.id == "cmpl-mine-1"
    both = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"request_id": "body"}, extra_headers={"X-Request-Id": "hdr"}
    )
    assert both.id == "cmpl-hdr"


def test_a_request_id_that_cannot_name_a_request_is_refused_by_name(http):
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "a b"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert "x-request-id" not in r.headers  # an id that cannot name a request is not echoed (a valid one is)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "request_id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, llm):
    r = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    ids = llm.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert r.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert all(k.startswith("token_id:") for top in r.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert all(
        t.token.startswith("token_id:") and t.bytes == list(t.token.encode()) for t in chat.choices[0].logprobs.content
    )


def test_numbers_sent_as_strings_are_taken_as_vllm_takes_them(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": "3", "temperature": "0", "top_k": "5", "seed": "7"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    for field, value in (("max_tokens", "three"), ("max_tokens", "1.5"), ("temperature", "nan"), ("stream", "yes")):
        bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
        assert bad.status_code == 400 and field in bad.text, (field, value, bad.text)


def test_guided_decoding_backend_must_be_the_servers_and_then_constrains(client, http):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        extra_body={"guided_choice": ["red", "blue"], "guided_decoding_backend": "guidance"},
    )
    assert r.choices[0].message.content in ("red", "blue")
    bad = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "guided_decoding_backend": "xgrammar"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_decoding_backend"
    assert "guidance" in bad.json()["error"]["message"]


def test_spaces_between_special_tokens_is_accepted_with_the_fast_tokenizers_output(client):
    """vLLM's detokenizer for fast tokenizers (all of ours) joins special tokens without
    spaces whatever this field says; so does this server: both values give the same text."""
    kwargs = dict(model=MODEL, prompt="<|im_start|>user", max_tokens=4, temperature=0, echo=True)
    on = client.completions.create(**kwargs, extra_body={"skip_special_tokens": False})
    off = client.completions.create(
        **kwargs, extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False}
    )
    assert on.choices[0].text == off.choices[0].text and on.choices[0].text.startswith("<|im_start|>user")


def test_a_priority_without_the_priority_policy_is_refused_by_name(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]


class _BosToy(ToyTokenizer):
    """The toy tokenizer with a BOS (id 1) where special tokens are asked for."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + super().encode(text, add_special_tokens)


def _toy_app(policy: str = "fcfs", **server):
    config = EngineConfig(
        num_blocks=64,
        block_size=4,
        max_model_len=64,
        scheduler=SchedulerConfig(max_num_seqs=1, scheduling_policy=policy),
    )
    engine = AsyncEngine(Engine.create(ScriptedRunner(4), _BosToy(), config))
    return engine, build_app(engine, _BosToy(), 64, ServerConfig(served_model_name="toy", **server))


def test_add_special_tokens_on_completions_adds_the_bos_or_not():
    engine, app = _toy_app()

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            with_bos = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
            without = await c.post(
                "/v1/completions", json={"prompt": "abc", "max_tokens": 1, "add_special_tokens": False}
            )
            return with_bos.json(), without.json()

    try:
        with_bos, without = asyncio.run(go())
    finally:
        engine.shutdown()
    assert with_bos["usage"]["prompt_tokens"] == 4 and without["usage"]["prompt_tokens"] == 3


def test_under_the_priority_policy_the_lower_priority_value_is_served_first():
    """One sequence at a time (max_num_seqs 1); the engine's loop is held while three requests
    arrive, so that they wait together: they are served by priority value, not arrival."""
    import threading

    engine, app = _toy_app("priority", min_priority=-3)  # (below 0 only where the operator allows it)
    scheduled: dict[str, float] = {}
    gate, entered = threading.Event(), threading.Event()

    async def one(c, name, priority):
        body = {"prompt": name, "max_tokens": 3, "priority": priority, "ignore_eos": True, "return_timings": True}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        scheduled[name] = r.json()["timings"][0]["first_scheduled"]  # when the engine first ran it

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:

            def hold() -> None:  # the loop thread waits here, between steps
                entered.set()
                gate.wait()

            held = asyncio.create_task(engine.run_on_loop(hold))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            tasks = [asyncio.create_task(one(c, name, p)) for name, p in (("late", 5), ("zero", 0), ("urgent", -3))]
            for _ in range(200):  # until all three are queued for the loop
                if engine.num_waiting == 3:
                    break
                await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(held, *tasks)

    try:
        asyncio.run(go())
    finally:
        gate.set()
        engine.shutdown()
    assert sorted(scheduled, key=scheduled.get) == ["urgent", "zero", "late"]


def test_continue_final_message_continues_the_assistants_text(client, llm):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message and
    the answer continues it; the same tokens as the offline engine on that prompt."""
    from tokenmill import SamplingParams

    chat = [{"role": "user", "content": "Describe the sky."}, {"role": "assistant", "content": "The sky is"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=5,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    ids = llm.tokenizer.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nThe sky is")
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == llm.generate(ids, SamplingParams(max_tokens=5, temperature=0))[0].text
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=2, extra_body={"continue_final_message": True}
        )


def test_a_request_chat_template_needs_the_servers_trust(http):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_a_trusted_request_template_renders_the_prompt_with_its_documents(llm):
    """With --trust-request-chat-template, the request's template renders the prompt, and
    ``documents`` reach it as a variable (vLLM's RAG field); in process, on the real tokenizer."""
    template = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[-1].content }}"
    docs = [{"title": "a", "text": "Paris is in France."}, {"title": "b", "text": "Rome is in Italy."}]
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), llm.tokenizer, EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
    )
    config = ServerConfig(served_model_name="toy", trust_request_chat_template=True)
    app = build_app(engine, llm.tokenizer, 128, config)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            body = {"messages": CHAT, "max_tokens": 1, "chat_template": template, "documents": docs}
            return await c.post("/v1/chat/completions", json=body)

    try:
        r = asyncio.run(go())
    finally:
        engine.shutdown()
    want = "[a] Paris is in France.\n[b] Rome is in Italy.\nName a colour."
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(want, add_special_tokens=False))
