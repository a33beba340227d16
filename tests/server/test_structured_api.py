"""Structured output and tool calling over HTTP, with the official `openai` client."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 40}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_parse_returns_a_pydantic_object(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population: int = pydantic.Field(ge=0, le=100_000_000)  # bounded: a small model repeats digits otherwise

    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name and isinstance(parsed.population, int)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json"])
def test_every_spelling_of_a_json_schema_is_enforced(client, field):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    extra = {
        "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        "structured_outputs": {"extra_body": {"structured_outputs": {"json": schema}}},
        "guided_json": {"extra_body": {"guided_json": schema}},
    }[field]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=40,
        temperature=1.0,
        seed=3,
        **extra,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_regex_choice_and_grammar_over_completions(client):
    r = client.completions.create(
        model=MODEL,
        prompt="A JSON object:",
        max_tokens=60,
        temperature=0.7,
        seed=2,  # a sample that closes its object within max_tokens (some run on: a number's digits, unbounded)
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(
        model=MODEL,
        prompt="Date:",
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": r"20\d\d-[01]\d-[0-3]\d"},
    )
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", r.choices[0].text)
    r = client.completions.create(
        model=MODEL,
        prompt="Colour:",
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=4,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in r.choices)
    grammar = 'root ::= num " + " num (" + " num)?\nnum ::= [1-9] [0-9]?'
    r = client.completions.create(
        model=MODEL, prompt="Sum:", max_tokens=20, temperature=1.0, seed=5, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,2}", r.choices[0].text)


def test_streamed_structured_output_is_the_same_text(client):
    body = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "p",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 12}},
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
        }
    }
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0, **body)
    chunks = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, temperature=0, stream=True, **body
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and "name" in json.loads(text)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "nope",
        ),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"guided_grammar": 'root ::= "a" missing'}, "missing"),
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_regex": "a[^\\x00-\\x{10FFFF}]"}, "matches no text"),
        ({"guided_choice": []}, "choice"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
        ({"response_format": {"type": "xml"}}, "xml"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one constraint"),
        # issue 24 item 1: what the matcher cannot enforce (found at compile time), what is too big
        ({"guided_grammar": 'root ::= "a" root'}, "cannot be enforced"),
        ({"guided_regex": "a{1000000}"}, "cannot be enforced"),
        (
            {"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}}},
            "cannot be enforced",
        ),
        ({"guided_choice": [f"option {i}" for i in range(30000)]}, "--max-grammar-bytes"),
    ],
    ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:40],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_before_queueing(http, body, needle, stream):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400
    assert len(err["message"]) < 400  # the reason, not the grammar
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_many_choices_are_one_lexeme_and_enforced(http):
    """10,000 choices (an Earley row each, before, past the matcher's limit of 2,000)."""
    choices = [f"option {i}" for i in range(10000)]
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Pick one option:",
            "max_tokens": 8,
            "temperature": 0,
            "guided_choice": choices,
        },
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] in choices and c["finish_reason"] == "stop", c


# ------------------------------------------------------------------------- tools


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(_args(call), WEATHER["function"]["parameters"])


def test_required_tool_choice_streamed_and_not(client):
    # parallel_tool_calls=false: SmolLM2-135M, free to add calls, repeats them until max_tokens
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        parallel_tool_calls=False,
    )
    full = client.chat.completions.create(**kwargs)
    calls = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(_args(call), schema)
    # streamed: OpenAI's deltas (id, type and name first, then the arguments in pieces as
    # they are generated), accumulated by index
    streamed: dict[int, dict] = {}
    finish, pieces = None, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            pieces += bool(tc.function and tc.function.arguments)
            acc = streamed.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            acc["id"] = tc.id or acc["id"]
            acc["name"] += (tc.function.name or "") if tc.function else ""
            acc["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed.items())] == [
        (c.function.name, _args(c)) for c in calls
    ]
    assert all(v["id"] and v["id"].startswith("call_") for v in streamed.values())
    assert pieces > 3  # incremental, not one piece at the end


@pytest.mark.parametrize("max_tokens", [8, 30, 45])
def test_calls_cut_by_max_tokens_are_the_same_streamed_and_not(client, max_tokens):
    """Parallel calls cut by max_tokens: the calls made so far (the last one's arguments
    as far as they got, as OpenAI's), the same streamed or not; the wrapper never in content.
    (A question for both tools, so that greedy decoding makes two calls.)"""
    both = [{"role": "user", "content": "What is the weather in Paris right now, and what time is it there?"}]
    kwargs = dict(
        model=MODEL, messages=both, tools=[WEATHER, TIME], tool_choice="required", max_tokens=max_tokens, temperature=0
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    streamed: dict[int, list[str]] = {}
    content = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                acc = streamed.setdefault(tc.index, ["", ""])
                acc[0] += tc.function.name or ""
                acc[1] += tc.function.arguments or ""
    assert content == "" and [tuple(v) for _, v in sorted(streamed.items())] == calls
    if max_tokens == 8:
        assert calls == []  # still in the wrapper
    elif max_tokens == 45:  # greedy: one whole call, the next one begun
        assert len(calls) == 2 and json.loads(calls[0][1]) and calls[1][1] and not calls[1][1].endswith("}")


def test_auto_reply_streams_as_content(client):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=40, temperature=0
    )
    full = client.chat.completions.create(**kwargs)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert full.choices[0].message.tool_calls is None and full.choices[0].finish_reason == "stop"
    assert text == full.choices[0].message.content and text.startswith("Hello")  # the reply, not its JSON
    assert sum(bool(c.choices[0].delta.content) for c in chunks) > 2  # streamed as it decodes


def test_auto_tool_choice_answers_or_calls_and_results_render_back(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=80, temperature=0
    )
    m = r.choices[0].message
    assert (m.tool_calls and r.choices[0].finish_reason == "tool_calls") or (m.content and not m.tool_calls)
    # a conversation with an earlier call and its result renders and answers
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=60, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "combined"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}],
                "tool_choice": "required",
            },
            "cannot be enforced",
        ),
    ],
)
def test_bad_tool_requests_are_400(http, body, needle):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_tools_on_completions_are_refused(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and "chat" in r.json()["error"]["message"]


# ------------------------------------------- a chat template that knows tools (Hermes)

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks.<|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory, llm):
    """A tiny random Llama with SmolLM2's vocabulary and a Hermes-style template."""
    from tests.helpers import make_tiny_chat_model
    from tests.server.conftest import Server

    path = tmp_path_factory.mktemp("hermes")
    make_tiny_chat_model(path, llm.tokenizer, llm.config.vocab_size, HERMES_TEMPLATE)
    server = Server("--model", str(path), "--kv-cache-memory", "64MiB")
    yield server
    server.stop()


def test_hermes_template_gets_tools_and_its_calls_are_parsed(hermes_server):
    client = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_time"}}
    parsed = 0
    for choice, parallel in ((named, True), ("required", False), ("required", True)):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=120,
            temperature=0,
        )
        c = r.choices[0]
        if c.finish_reason == "length":  # random weights may repeat calls (parallel) until max_tokens
            assert parallel and c.message.content.startswith("<tool_call>\n{"), c.message.content
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
        assert len(c.message.tool_calls) == 1 or parallel
        parsed += 1
        for call in c.message.tool_calls:
            assert choice != named or call.function.name == "get_time"
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(_args(call), schema)
    assert parsed >= 2  # the named and the single call always end
