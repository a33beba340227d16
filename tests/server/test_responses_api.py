"""OpenAI's Responses API through the official `openai` client: a Responses request
answers exactly what the equivalent chat request answers (greedy), whole or streamed."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat_text(client, messages: list[dict], max_tokens: int, **extra) -> tuple[str, object]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    return r.choices[0].message.content, r


def test_text_input_and_instructions_answer_as_chat_does(client):
    r = client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0
    )
    text, chat = chat_text(client, [{"role": "user", "content": "What is the capital of France?"}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == text and text
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    r = client.responses.create(
        model=MODEL,
        instructions="Answer in one word.",
        max_output_tokens=12,
        temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Sky colour?"}]}],
    )
    text, _ = chat_text(
        client, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}], 12
    )
    assert r.output_text == text and r.instructions == "Answer in one word."


def test_streamed_events_build_the_same_response(client):
    kwargs = dict(model=MODEL, input="Name three fruits.", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    kinds, deltas = [], ""
    with client.responses.stream(**kwargs) as stream:  # the SDK's helper checks the event order as it accumulates
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert kinds.count("response.output_text.delta") > 3 and deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


def test_json_schema_text_format_is_enforced(client):
    r = client.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with client.responses.stream(
        model=MODEL,
        input="Describe a person as JSON.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    ) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == r.output_text  # the same constrained answer, streamed
    r = client.responses.create(
        model=MODEL,
        input="Any JSON object.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_function_call_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
        parallel_tool_calls=False,
    )
    assert r.status == "completed"
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # streamed: the same call, its arguments in pieces
    kinds, pieces = [], ""
    with client.responses.stream(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
        parallel_tool_calls=False,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                pieces += event.delta
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments) == (call.name, pieces)
    assert (
        kinds.count("response.function_call_arguments.delta") > 2 and "response.function_call_arguments.done" in kinds
    )
    # the result goes back as a function_call_output item; the answer is what chat answers
    follow = ask + [item.model_dump(exclude_none=True) for item in r.output]
    follow.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"})
    r2 = client.responses.create(
        model=MODEL, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0
    )
    history = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"},
    ]
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    text, _ = chat_text(client, history, 30, tools=chat_tools, tool_choice="none")
    assert r2.output_text == text and text


def test_previous_response_id_continues_the_conversation_and_is_stored(client):
    r1 = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", max_output_tokens=16, temperature=0)
    r2 = client.responses.create(
        model=MODEL, previous_response_id=r1.id, input="What is my name?", max_output_tokens=16, temperature=0
    )
    text, _ = chat_text(
        client,
        [
            {"role": "user", "content": "My name is Ada. Say hello."},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        16,
    )
    assert r2.output_text == text and r2.previous_response_id == r1.id
    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    assert client.responses.delete(r1.id) is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.create(model=MODEL, previous_response_id=r1.id, input="Again?", max_output_tokens=4)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tools": [{"type": "web_search"}]}, "web_search tools are not supported"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "file_search tools are not supported"),
        ({"background": True}, "background responses are not supported"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning is not supported"),
        ({"truncation": "auto"}, "truncation"),
        ({"foo_unknown": 1}, "Unrecognized request argument supplied: foo_unknown"),
        ({"input": []}, "input is empty"),
        (
            {"input": [{"type": "image_generation_call"}]},
            "input items of type 'image_generation_call' are not supported",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input is empty (a reasoning item alone is no turn)"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "tool_call_id"),
        ({"text": {"format": {"type": "xml"}}}, "text.format type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_responses_requests_are_400_naming_the_problem(http, extra, needle):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "BadRequestError"
    assert http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).status_code == 200


def test_unknown_response_ids_are_404(http):
    for r in (
        http.get("/v1/responses/resp_nope"),
        http.delete("/v1/responses/resp_nope"),
        http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}),
    ):
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
