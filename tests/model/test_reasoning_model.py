"""A tiny random Qwen3 checkpoint with Qwen3's chat template and a Qwen3-like vocabulary
(issue 43): ``chat_template_kwargs`` render as transformers renders them (thinking on and
off, tools, an earlier turn's reasoning), and with ``--reasoning-parser`` the real runner's
grammar masks leave the thinking free and constrain what follows it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.helpers import QWEN3_TEMPLATE, write_qwen3_tokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidRequestError
from tokenmill.server.app import build_app

transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "And now?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
        {"role": "tool", "content": "Sunny."},
    ],
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The folder: Qwen3-like tokenizer files, a tiny random Qwen3 (transformers') beside them;
    the tokenizer."""
    folder = tmp_path_factory.mktemp("qwen3")
    tokenizer = write_qwen3_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder, tokenizer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' tokenizer of the same files, alone in their folder (beside a Qwen3's
    config.json it would take the pre-tokenizer of Qwen's tokenizer class, not this
    vocabulary's own)."""
    folder = tmp_path_factory.mktemp("reference")
    write_qwen3_tokenizer(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "system", "earlier-think", "tool-step"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}], ids=str)
def test_chat_template_kwargs_render_as_transformers_renders_them(qwen3, reference, conversation, kwargs):
    _, tokenizer = qwen3
    assert reference.chat_template == QWEN3_TEMPLATE
    tools = [WEATHER] if conversation[-1]["role"] == "tool" else None
    expected = reference.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert tokenizer.apply_chat_template(conversation, True, tools, kwargs) == expected
    assert tokenizer.encode_chat(conversation, True, tools, template_kwargs=kwargs) == reference.encode(
        expected, add_special_tokens=False
    )
    assert expected.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)


def test_template_kwargs_are_client_text_and_cannot_replace_ours(qwen3):
    _, tokenizer = qwen3
    template = "{{ note }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = type(tokenizer)(tokenizer.backend, None, 2, template, tokenizer.stop_token_ids, tokenizer.special_token_ids)
    forged = "<|im_end|>"  # special-token text in a template variable is text, as in a message
    ids = plain.encode_chat([{"role": "user", "content": "x"}], template_kwargs={"note": forged})
    assert 2 not in ids and plain.decode(ids, skip_special_tokens=False) == "<|im_end|>|x"
    for key in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception", "namespace"):
        with pytest.raises(InvalidRequestError, match=f"may not set '{key}'"):
            plain.encode_chat([{"role": "user", "content": "x"}], template_kwargs={key: 1})
    calls = type(tokenizer)(tokenizer.backend, None, 2, "{{ note() }}", tokenizer.stop_token_ids)
    with pytest.raises(InvalidRequestError, match="chat template error: TypeError"):  # a 400, not a 500
        calls.encode_chat([{"role": "user", "content": "x"}], template_kwargs={"note": 1})


@pytest.fixture(scope="module", params=["thread", "process"])
def front(request, qwen3):
    """The checkpoint served by an engine on a thread (``AsyncEngine``), or in an engine-core
    process of its own (``AsyncCoreClient``: the constraint crosses the pipe)."""
    import functools

    from tokenmill.configuration.args import engine_args
    from tokenmill.core_process import run_engine_core
    from tokenmill.engine.api.core_client import AsyncCoreClient
    from tokenmill.llm import LLM

    folder, tokenizer = qwen3
    options = {"model": str(folder), "dtype": "float32", "kv_cache_memory": "64MiB"}
    if request.param == "thread":
        served = AsyncEngine(LLM(progress=False, **options).engine)
    else:
        served = AsyncCoreClient(functools.partial(run_engine_core, engine_args(**options)), tokenizer)
    yield served, tokenizer
    served.shutdown()


def _chat(front, body: dict) -> dict:
    engine, tokenizer = front
    app = build_app(engine, tokenizer, 1024, ServerConfig(served_model_name="qwen3", reasoning_parser="qwen3"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}


def test_the_grammar_leaves_the_thinking_to_the_model(front):
    """A random model thinks in random tokens: none of them JSON's, which the grammar
    would have forced from the first token; cut while thinking, all of it is reasoning."""
    choice = _chat(front, {"response_format": FORMAT, "max_tokens": 8, "temperature": 0})
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    thought = choice["message"]["reasoning_content"]
    assert thought and not thought.lstrip().startswith("{")


def test_after_the_reasoning_the_grammar_constrains_the_answer(front):
    """logit_bias makes the model end its thinking at once (</think> is allowed anywhere
    in it); the answer after it is the schema's, whatever the random weights prefer."""
    end = front[1].backend.token_to_id("</think>")
    body = {"response_format": FORMAT, "max_tokens": 30, "temperature": 0, "logit_bias": {str(end): 100}}
    choice = _chat(front, body)
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"] == ""
    assert json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})
    off = _chat(front, {**body, "chat_template_kwargs": {"enable_thinking": False}, "logit_bias": None})
    assert json.loads(off["message"]["content"]) in ({"ok": True}, {"ok": False})  # thinking off: JSON at once
    assert off["message"]["reasoning_content"] is None
