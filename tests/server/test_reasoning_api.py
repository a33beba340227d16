"""Reasoning models over HTTP (issue 43): ``chat_template_kwargs`` into Qwen3's template,
``--reasoning-parser`` splitting answers into reasoning_content and content (whole and
streamed, through the official ``openai`` client), the Responses API's reasoning item and
reasoning_tokens, tool calls and structured output after the reasoning. In process: a
Qwen3-like vocabulary with Qwen3's chat template, on a scripted engine whose "model"
writes the answer a test gives it, so the parser meets the answers a Qwen3 writes."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer, write_qwen3_tokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MODEL = "qwen3"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "\nThe user asks 2 + 2. That is 4.\n"
ANSWER = f"<think>{THOUGHT}</think>\n\nIt is 4."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class WritingRunner(ScriptedRunner):
    """A scripted model that writes ``self.script`` (token ids), then ends its turn."""

    script: list[int] = []
    end: int = 0

    def choose(self, state: dict, history: list[int]) -> int:
        written = len(history) - state["prompt_len"]
        return self.script[written] if written < len(self.script) else self.end


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))


@asynccontextmanager
async def served(tokenizer, answer: str, parser: str | None = "qwen3"):
    """An OpenAI client of an app whose model answers ``answer``; the runner (its
    ``batches`` hold the prompts it was given); an HTTP client of the app."""
    from tokenmill.structured.grammar import GrammarCompiler

    runner = WritingRunner(4)
    runner.script = tokenizer.encode(answer, add_special_tokens=False)
    runner.end = tokenizer.backend.token_to_id("<|im_end|>")
    engine = AsyncEngine(
        Engine.create(
            runner,
            tokenizer,
            EngineConfig(num_blocks=512, block_size=4, max_model_len=2048),
            GrammarCompiler(tokenizer, tokenizer.vocab_size),
        )
    )
    app = build_app(engine, tokenizer, 2048, ServerConfig(served_model_name=MODEL, reasoning_parser=parser))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
    try:
        yield client, runner, http
    finally:
        await http.aclose()
        engine.shutdown()


def prompt_text(tokenizer, runner) -> str:
    """The last prompt the engine was given, as text."""
    new = [r for batch in runner.batches for r in batch.new_requests]
    return tokenizer.decode(new[-1].prompt_token_ids, skip_special_tokens=False)


async def streamed(client, **kwargs) -> tuple[str, str, list[str | None], list]:
    """A streamed chat's reasoning_content and content deltas joined, its finish reasons
    and tool-call deltas."""
    reasoning, content, reasons, calls = [], [], [], []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            calls += delta.tool_calls or []
            reasons.append(choice.finish_reason)
    return "".join(reasoning), "".join(content), [r for r in reasons if r], calls


def run(coro):
    return asyncio.run(coro)


def test_an_answer_splits_into_reasoning_and_content_whole_and_streamed(tokenizer):
    async def go():
        async with served(tokenizer, ANSWER) as (client, runner, _):
            whole = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)
            assert prompt_text(tokenizer, runner).endswith(
                "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
            )
            return whole, await streamed(client, model=MODEL, messages=ASK, max_tokens=100)

    whole, (reasoning, content, reasons, _) = run(go())
    message = whole.choices[0].message
    assert (
        message.reasoning_content == THOUGHT and message.content == "\n\nIt is 4."
    )  # as vLLM's qwen3 parser splits it
    assert whole.choices[0].finish_reason == "stop" and reasons == ["stop"]
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert whole.usage.completion_tokens == len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
    assert whole.usage.completion_tokens_details is None  # (vLLM's chat counts no reasoning_tokens)


def test_thinking_off_renders_the_empty_think_block_and_answers_content(tokenizer):
    async def go():
        async with served(tokenizer, "It is 4.") as (client, runner, http):
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            whole = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=50, extra_body=off)
            rendered = prompt_text(tokenizer, runner)
            counted = (await http.post("/tokenize", json={"messages": ASK, **off})).json()
            assert counted["count"] == whole.usage.prompt_tokens  # /tokenize renders it alike
            return whole, rendered, await streamed(client, model=MODEL, messages=ASK, max_tokens=50, extra_body=off)

    whole, rendered, (reasoning, content, _, _) = run(go())
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # what Qwen3's template writes
    assert whole.choices[0].message.content == "It is 4." and whole.choices[0].message.reasoning_content is None
    assert (reasoning, content) == ("", "It is 4.")


def test_an_answer_cut_while_thinking_is_all_reasoning(tokenizer):
    async def go():
        async with served(tokenizer, ANSWER) as (client, _, _):
            whole = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
            return whole, await streamed(client, model=MODEL, messages=ASK, max_tokens=5)

    whole, (reasoning, content, reasons, _) = run(go())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "length" and reasons == ["length"]
    assert message.content is None and message.reasoning_content and THOUGHT.startswith(message.reasoning_content)
    assert (reasoning, content) == (message.reasoning_content, "")


def test_deepseek_r1_starts_inside_the_reasoning(tokenizer):
    async def go():
        async with served(tokenizer, "Plan: add.</think>It is 4.", parser="deepseek_r1") as (client, _, _):
            whole = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=50)
            return whole, await streamed(client, model=MODEL, messages=ASK, max_tokens=50)

    whole, (reasoning, content, _, _) = run(go())
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == ("Plan: add.", "It is 4.")
    assert (reasoning, content) == ("Plan: add.", "It is 4.")


def test_no_parser_leaves_the_answer_whole(tokenizer):
    async def go():
        async with served(tokenizer, ANSWER, parser=None) as (client, _, _):
            return await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)

    message = run(go()).choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None


def test_template_variables_the_server_sets_are_refused_by_name(tokenizer):
    async def go():
        async with served(tokenizer, ANSWER) as (client, _, _):
            for key in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token"):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(
                        model=MODEL, messages=ASK, max_tokens=5, extra_body={"chat_template_kwargs": {key: []}}
                    )
                assert f"chat_template_kwargs may not set '{key}'" in e.value.message
                assert e.value.body["param"] == "chat_template_kwargs"
            with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):  # an object, as vLLM's
                await client.chat.completions.create(
                    model=MODEL, messages=ASK, max_tokens=5, extra_body={"chat_template_kwargs": "no"}
                )

    run(go())


def test_a_tool_call_after_the_reasoning_is_parsed_from_the_content(tokenizer):
    thought = "\nI should call get_weather; a <tool_call> here is only a thought.\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    async def go():
        async with served(tokenizer, f"<think>{thought}</think>\n\n{call}") as (client, runner, _):
            whole = await client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=200)
            assert "# Tools" in prompt_text(tokenizer, runner)  # Qwen3's template described them
            return whole, await streamed(client, model=MODEL, messages=ask, tools=[WEATHER], max_tokens=200)

    whole, (reasoning, content, reasons, calls) = run(go())
    message = whole.choices[0].message
    assert message.reasoning_content == thought  # the <tool_call> inside the thinking is not a call
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert whole.choices[0].finish_reason == "tool_calls" and reasons == ["tool_calls"]
    assert reasoning == thought and content.strip() == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_structured_output_constrains_what_follows_the_reasoning(tokenizer):
    """The scripted model writes what the test says whatever the grammar's mask: a token the
    grammar refuses ends the answer ("length"). With the parser, free thinking then JSON
    passes; without one the grammar refuses the thinking's first token."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    answer = '<think>\nFirst {not json, then the object.\n</think>{"a": 4}'

    async def go(parser, text, **extra):
        async with served(tokenizer, text, parser=parser) as (client, _, _):
            r = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=100, response_format=fmt, **extra
            )
            return r.choices[0]

    constrained = run(go("qwen3", answer))
    assert constrained.finish_reason == "stop"  # the grammar ended it, complete
    assert constrained.message.content == '{"a": 4}'
    assert constrained.message.reasoning_content == "\nFirst {not json, then the object.\n"
    refused = run(go(None, answer))
    assert refused.finish_reason == "length" and refused.message.content == ""
    off = run(go("qwen3", '{"a": 4}', extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert off.finish_reason == "stop" and off.message.content == '{"a": 4}'  # thinking off: JSON at once


def test_the_responses_api_returns_a_reasoning_item_and_counts_its_tokens(tokenizer):
    async def go():
        async with served(tokenizer, ANSWER) as (client, runner, _):
            whole = await client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=100)
            events = [e async for e in await client.responses.create(model=MODEL, input="What is 2 + 2?", stream=True)]
            cut = await client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=5)
            follow = await client.responses.create(model=MODEL, input="And 3 + 3?", previous_response_id=whole.id)
            followed = prompt_text(tokenizer, runner)
            again = await client.responses.create(  # the output items sent back as input, as OpenAI's guide says
                model=MODEL,
                input=[
                    {"role": "user", "content": "What is 2 + 2?"},
                    *whole.output,
                    {"role": "user", "content": "And 3 + 3?"},
                ],
            )
            return whole, events, cut, follow, followed, again

    whole, events, cut, follow, followed, again = run(go())
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    thought, message = whole.output
    assert thought.content[0].type == "reasoning_text" and thought.content[0].text == THOUGHT and thought.summary == []
    assert message.content[0].text == "\n\nIt is 4."
    until_end = tokenizer.encode(f"<think>{THOUGHT}</think>", add_special_tokens=False)
    assert whole.usage.output_tokens_details.reasoning_tokens == len(until_end)
    assert whole.usage.output_tokens == len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1

    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nIt is 4."
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == THOUGHT and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta"
    )
    final = events[-1].response
    assert final.output[0].model_dump() == thought.model_dump() | {"id": final.output[0].id}
    assert final.usage.output_tokens_details.reasoning_tokens == len(until_end)

    assert cut.status == "incomplete" and [item.type for item in cut.output] == ["reasoning"]  # no message
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 5

    assert follow.status == "completed"  # the stored turn's reasoning went back to the template
    assert (
        "<|im_start|>assistant\n\n\nIt is 4.<|im_end|>\n<|im_start|>user\nAnd 3 + 3?" in followed
    )  # (Qwen3's drops it)
    assert again.status == "completed"


def test_an_answer_with_its_reasoning_content_can_be_sent_back(tokenizer):
    """The openai SDK's way of continuing a chat: the answer's message appended as it came,
    reasoning_content included; Qwen3's template renders it for the current turn only."""

    async def go():
        async with served(tokenizer, ANSWER) as (client, runner, _):
            first = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)
            turns = [*ASK, first.choices[0].message.model_dump(exclude_none=True)]
            later = [*turns, {"role": "user", "content": "And 3 + 3?"}]
            await client.chat.completions.create(model=MODEL, messages=later, max_tokens=100)
            return prompt_text(tokenizer, runner)

    rendered = run(go())
    assert rendered.endswith(
        "<|im_start|>assistant\n\n\nIt is 4.<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_parser_for_a_model_without_the_markers_serves_it_without_one_and_says_so_once(caplog):
    """A deployment that sets --reasoning-parser for every model starts whatever the model."""
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    try:
        with caplog.at_level(logging.WARNING):
            app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name="toy", reasoning_parser="qwen3"))
        assert [m.reasoning_parser for m in app.state.served.models.values()] == [None]
        said = [r.getMessage() for r in caplog.records if "served without it" in r.getMessage()]
        assert said == ["--reasoning-parser qwen3: model toy has no <think> and </think> tokens; served without it"]
    finally:
        engine.shutdown()


def test_a_tool_turns_reasoning_goes_back_into_the_prompt(tokenizer):
    """Multi-step tool calling: the assistant's turn that called the tool is after the last
    user query, so Qwen3's template renders its reasoning; sent back as a chat message's
    reasoning_content or as the Responses API's reasoning item before the call."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Look it up."},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
    ]
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
    ]
    flat = {"type": "function", **WEATHER["function"]}
    rendered = (
        "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )

    async def go():
        async with served(tokenizer, ANSWER) as (client, runner, _):
            await client.chat.completions.create(model=MODEL, messages=chat, tools=[WEATHER], max_tokens=100)
            by_chat = prompt_text(tokenizer, runner)
            await client.responses.create(model=MODEL, input=items, tools=[flat], max_output_tokens=100)
            return by_chat, prompt_text(tokenizer, runner)

    by_chat, by_responses = run(go())
    assert by_chat.endswith(rendered) and by_responses.endswith(rendered)


def test_answers_carry_vllms_new_reasoning_field_and_include_reasoning_false_drops_it(tokenizer):
    """Newer vLLM answers ``reasoning`` beside ``reasoning_content``; ``include_reasoning: false``
    answers the content alone, whole and streamed."""

    async def go():
        async with served(tokenizer, ANSWER) as (client, _, http):
            whole = (await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK})).json()
            body = {"model": MODEL, "messages": ASK, "include_reasoning": False}
            without = (await http.post("/v1/chat/completions", json=body)).json()
            streamed_without = await streamed(
                client, model=MODEL, messages=ASK, extra_body={"include_reasoning": False}
            )
            return whole, without, streamed_without

    whole, without, (reasoning, content, _, _) = run(go())
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == THOUGHT
    assert without["choices"][0]["message"] == {"role": "assistant", "content": "\n\nIt is 4."}
    assert (reasoning, content) == ("", "\n\nIt is 4.")


def test_reasoning_effort_is_a_template_variable_as_vllm_passes_it(tokenizer):
    template = "effort={{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"

    async def go():
        async with served(replace(tokenizer, chat_template=template), "It is 4.") as (_, runner, http):
            body = {"model": MODEL, "messages": ASK, "reasoning_effort": "high", "return_prompt_text": True}
            answer = (await http.post("/v1/chat/completions", json=body)).json()
            return answer, prompt_text(tokenizer, runner)

    answer, rendered = run(go())
    assert rendered.startswith("effort=high|What is 2 + 2?")
    assert answer["prompt_text"] == rendered
