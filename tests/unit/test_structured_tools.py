"""Constraints and tool-call formats, checked with our real tokenizer and llguidance
(no model): what each grammar allows and refuses, token by token."""

from __future__ import annotations

import json

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.model.gguf_file import read_gguf
from tokenmill.model.paths import default_model_path
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.server.jobs.tools import parse_tool_request
from tokenmill.structured.constraint import StructuredOutputs
from tokenmill.structured.grammar import GrammarCompiler

pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string"}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall them as <tool_call>{...}</tool_call><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    meta, _ = read_gguf(path)
    return load_tokenizer(path, meta)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 49152)


def allows(compiler, tokenizer, spec: StructuredOutputs, text: str) -> bool:
    """The grammar accepts all of ``text`` (as our tokenizer encodes it) and is then complete."""
    matcher = compiler.compile(spec).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.num_valid(ids) == len(ids) and matcher.accept(ids) and matcher.is_accepting


def test_parallel_calls_are_allowed_only_when_asked(compiler, tokenizer):
    two = json.dumps(
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Oslo"}},
                {"name": "get_time", "arguments": {"tz": "CET"}},
            ]
        }
    )
    one = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]})
    parallel = parse_tool_request([WEATHER, TIME], "required", True, None)
    single = parse_tool_request([WEATHER, TIME], "required", False, None)
    assert allows(compiler, tokenizer, parallel.constraint(), two)
    assert allows(compiler, tokenizer, single.constraint(), one)
    assert not allows(compiler, tokenizer, single.constraint(), two)
    # the arguments follow the function's schema, and only offered functions are callable
    assert not allows(compiler, tokenizer, single.constraint(), one.replace('"city"', '"town"'))
    assert not allows(compiler, tokenizer, single.constraint(), one.replace("get_weather", "get_stock"))
    named = parse_tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True, None)
    assert not allows(compiler, tokenizer, named.constraint(), one)
    auto = parse_tool_request([WEATHER], "auto", True, None)
    assert allows(compiler, tokenizer, auto.constraint(), '{"response": "It is sunny."}')
    assert allows(compiler, tokenizer, auto.constraint(), one)
    assert not allows(compiler, tokenizer, parallel.constraint(), '{"response": "It is sunny."}')


def test_generic_format_renders_tools_calls_and_results(tokenizer):
    tools = parse_tool_request([WEATHER], "auto", True, tokenizer.chat_template)
    assert not tools.hermes  # SmolLM2's template knows nothing of tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    rendered = tools.render_messages(messages)
    assert rendered[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    assert json.loads(rendered[3]["content"])["tool_response"]["content"] == "-3 C"
    prompt = tokenizer.apply_chat_template(rendered)
    assert "get_weather" in prompt and "-3 C" in prompt
    content, calls = tools.parse('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert tools.parse('{"response": "Sunny."}') == ("Sunny.", [])
    assert tools.parse('{"tool_calls": [{"name": "get_wea') == ("", [])  # cut short: the wrapper is not content


def test_hermes_format_for_templates_that_take_tools(compiler, tokenizer):
    tools = parse_tool_request([WEATHER, TIME], "required", False, HERMES_TEMPLATE)
    assert tools.hermes
    block = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert allows(compiler, tokenizer, tools.constraint(), block)
    assert not allows(compiler, tokenizer, tools.constraint(), block + "\n" + block)
    parallel = parse_tool_request([WEATHER, TIME], "required", True, HERMES_TEMPLATE)
    assert allows(compiler, tokenizer, parallel.constraint(), block + "\n" + block)
    content, calls = tools.parse("Let me check.\n" + block)
    assert content == "Let me check." and [c.name for c in calls] == ["get_time"]
    assert parse_tool_request([WEATHER], "auto", True, HERMES_TEMPLATE).constraint() is None  # free, parsed after
    from tokenmill.model.chat_template import render_chat_template

    text = render_chat_template(
        HERMES_TEMPLATE,
        {
            "messages": tools.render_messages([{"role": "user", "content": "hi"}]),
            "add_generation_prompt": True,
            "tools": [t.as_openai() for t in tools.offered],
        },
    )
    assert '"get_time"' in text and "<|im_start|>assistant" in text


@pytest.mark.parametrize(
    ("tools", "choice", "needle"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "nope"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "name"),
        ([WEATHER, WEATHER], None, "unique"),
        (None, "required", "needs tools"),
        ([WEATHER], "always", "tool_choice"),
        ([{"type": "retrieval"}], None, "function"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters"),
    ],
)
def test_bad_tool_requests_name_the_problem(tools, choice, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        parse_tool_request(tools, choice, None, None)


def test_tool_choice_none_offers_nothing():
    assert parse_tool_request([WEATHER], "none", None, None) is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "schema object"),
        ({"choice": "yes"}, "list of strings"),
        ({"choice": []}, "must not be empty"),
        ({"regex": ""}, "non-empty"),
        ({"regex": "a", "whitespace_pattern": " "}, "json"),
    ],
)
def test_structured_outputs_validate_on_construction(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        StructuredOutputs(**kwargs)


def test_schema_key_order_is_the_output_order(compiler, tokenizer):
    spec = StructuredOutputs(
        json={
            "type": "object",
            "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
            "required": ["z", "a"],
            "additionalProperties": False,
        }
    )
    assert allows(compiler, tokenizer, spec, '{"z": 1, "a": 2}')
    assert not allows(compiler, tokenizer, spec, '{"a": 2, "z": 1}')


def test_rollback_restores_the_matcher(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputs(regex=r"ab+c")).matcher()
    ids = tokenizer.encode("abbb", add_special_tokens=False)
    assert matcher.accept(ids)
    matcher.rollback(len(ids))
    assert matcher.num_valid(tokenizer.encode("abc", add_special_tokens=False)) >= 1
    assert matcher.num_valid(tokenizer.encode("xbc", add_special_tokens=False)) == 0


def _accumulate(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            acc = calls.setdefault(tc["index"], ["", ""])
            acc[0] += tc.get("function", {}).get("name", "")
            acc[1] += tc.get("function", {}).get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _stream(request, text: str, step: int) -> list[dict]:
    from tokenmill.server.jobs.tools import ToolStream

    stream, out = ToolStream(request), []
    for i in range(0, len(text), step):
        out += stream.feed(text[i : i + step], finished=i + step >= len(text))
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_tool_stream_sends_what_parse_finds(step):
    generic = parse_tool_request([WEATHER, TIME], "auto", True, None)
    calls = (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}", "n": [1, {"a": "}"}]}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]}'
    )
    deltas = _stream(generic, calls, step)
    content, streamed = _accumulate(deltas)
    assert content == "" and [(n, json.loads(a)) for n, a in streamed] == [
        (c.name, json.loads(c.arguments)) for c in generic.parse(calls)[1]
    ]
    assert sum("tool_calls" in d for d in deltas) >= (4 if step < 10 else 2)  # heads, then argument pieces
    reply = '{"response": "Hi \\u00e9\\ud83d\\ude00 \\"quoted\\" \\\\ done"}'
    assert _accumulate(_stream(generic, reply, step)) == (generic.parse(reply)[0], [])
    cut = '{"tool_calls": [{"name": "get_wea'  # cut by max_tokens: no call yet, and no content
    assert _accumulate(_stream(generic, cut, step)) == ("", [])
    hermes = parse_tool_request([WEATHER], "auto", True, HERMES_TEMPLATE)
    text = 'Sure, <tool_ checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = _accumulate(_stream(hermes, text, step))
    assert content == "Sure, <tool_ checking.\n" and calls == [("get_weather", '{"city": "Rome"}')]


def test_a_token_the_grammar_refuses_ends_the_output_as_a_cut_off(tokenizer, compiler, caplog):
    """Where the matcher cannot take a sampled token (the mask allowed it, but taking it
    hit one of the matcher's limits), the token is dropped and the request ends with
    "length": the output stays a valid prefix, never an invalid whole with "error".
    A scripted runner ignores the mask, so its tokens reach the matcher unfiltered:
    from [30, 31] it says ';', '+', then a special token the regex refuses."""
    from tests.helpers import ScriptedRunner
    from tokenmill.engine.engine import Engine, EngineConfig
    from tokenmill.sampling_params import SamplingParams

    engine = Engine.create(
        ScriptedRunner(4), tokenizer, EngineConfig(num_blocks=64, block_size=4, max_model_len=200), grammars=compiler
    )
    engine.add_request("r", [30, 31], SamplingParams(max_tokens=30, structured={"regex": "[;+]{1,40}"}))
    outs = [o for _ in range(40) if engine.has_unfinished() for o in engine.step()]
    final = outs[-1].outputs[0]
    assert (final.text, final.finish_reason) == (";+", "length") and final.token_ids == [43, 27]
    assert any("cut off after 2 tokens" in r.getMessage() and len(r.getMessage()) < 400 for r in caplog.records)
    assert not engine.has_unfinished() and engine.core.snapshot().kv_usage == 0.0  # nothing held


def test_the_grammar_cache_is_bounded_by_spec_bytes_as_well_as_count(tokenizer):
    """A compiled grammar's memory grows with its spec (~90x), so distinct big schemas
    must not pile up in the cache until its entry count is reached."""
    small = GrammarCompiler(tokenizer, 49152, cache_size=256, cache_bytes=20_000)
    specs = [
        StructuredOutputs(json={"type": "object", "properties": {f"k{n}_{i}": {"type": "integer"} for i in range(200)}})
        for n in range(6)
    ]
    for spec in specs:
        small.compile(spec)
        assert small.cached_bytes <= 20_000
    assert small.cached(specs[-1]) is not None and small.cached(specs[0]) is None  # least recently used went first
    assert small.cached_bytes == sum(s.size_bytes for s in specs if small.cached(s) is not None)


GENERIC_ANSWER = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "S\\u00e3o \\"Paulo\\" {1}"}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]}'
)
REPLY_ANSWER = '{"response": "It is sunny in S\\u00e3o Paulo, 25 \\u00b0C."}'
HERMES_ANSWER = (
    'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def _whole_calls(text: str, hermes: bool) -> list[tuple[str, dict]]:
    """The calls complete in ``text``, found the slow way: every prefix that parses."""
    if hermes:
        blocks = [b.split("</tool_call>")[0] for b in text.split("<tool_call>")[1:] if "</tool_call>" in b]
        return [(c["name"], c["arguments"]) for c in map(json.loads, blocks)]
    body = text[len('{"tool_calls": [') :] if text.startswith('{"tool_calls": [') else ""
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            call, i = decoder.raw_decode(body, i)
        except ValueError:
            break
        calls.append((call["name"], call["arguments"]))
        i += 2  # ", "
    return calls


@pytest.mark.parametrize("hermes", [False, True], ids=["generic", "hermes"])
def test_parallel_calls_cut_by_max_tokens_are_kept_alike_in_both_formats(hermes):
    """Issue 43: a call cut short keeps the arguments it has once its name is whole (not
    JSON: the finish_reason says length), in both formats, first call or second; a call cut
    before its name is whole is dropped. Streamed and whole answers agree."""
    request = parse_tool_request([WEATHER, TIME], "auto", True, HERMES_TEMPLATE if hermes else None)

    def write(*calls: str) -> str:
        if hermes:
            return "\n".join(f"<tool_call>\n{c}" + ("\n</tool_call>" if c.endswith("}}") else "") for c in calls)
        return '{"tool_calls": [' + ", ".join(calls)

    whole = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    for text, want in (
        (write('{"name": "get_weather", "arguments": {"city": "Ro'), [("get_weather", '{"city": "Ro')]),
        (
            write(whole, '{"name": "get_time", "arguments": {"tz'),
            [("get_weather", '{"city": "Rome"}'), ("get_time", '{"tz')],
        ),
        (write('{"name": "get_wea'), []),
        (write(whole, '{"na'), [("get_weather", '{"city": "Rome"}')]),
    ):
        content, calls = request.parse(text)
        assert [(c.name, c.arguments) for c in calls] == want, text
        streamed_content, streamed_calls = _accumulate(_stream(request, text, 3))
        assert not content and not streamed_content.strip() and streamed_calls == want, text


@pytest.mark.parametrize("hermes", [False, True])
@pytest.mark.parametrize("answer", ["calls", "reply"])
def test_tool_calls_cut_at_every_token_boundary_match_streamed_and_whole(tokenizer, hermes, answer):
    """Cut a real answer (our tokenizer's tokens) after every token, as max_tokens does:
    the non-streamed parse carries exactly the calls and content the stream sent, every
    complete call is among them, and the format's wrapper never lands in content."""
    if hermes and answer == "reply":
        pytest.skip("Hermes replies are free text")
    request = parse_tool_request([WEATHER, TIME], "auto", True, HERMES_TEMPLATE if hermes else None)
    text = HERMES_ANSWER if hermes else GENERIC_ANSWER if answer == "calls" else REPLY_ANSWER
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    from tokenmill.server.jobs.tools import ToolStream

    for k in range(len(ids) + 1):
        stream, deltas, sent = ToolStream(request), [], ""
        for j in range(1, k + 1):  # the detokenizer's deltas, one token at a time
            now = tokenizer.decode(ids[:j])
            deltas += stream.feed(now[len(sent) :], finished=j == k)
            sent = now
        if k == 0:
            deltas += stream.feed("", finished=True)
        prefix = tokenizer.decode(ids[:k])
        content, calls = request.parse(prefix)
        streamed_content, streamed_calls = _accumulate(deltas)
        assert [(c.name, c.arguments) for c in calls] == streamed_calls, (k, prefix)
        assert (content or "").strip() == streamed_content.strip(), (k, prefix)
        whole = _whole_calls(prefix, hermes)
        assert [(c.name, json.loads(c.arguments)) for c in calls[: len(whole)]] == whole, (k, prefix)
        assert len(calls) - len(whole) <= 1  # at most the call being written, cut short
        assert "tool_call" not in (content or "") and "{" not in (content or ""), (k, prefix)
    if answer == "reply":
        assert request.parse(text) == ("It is sunny in S\u00e3o Paulo, 25 \u00b0C.", [])
