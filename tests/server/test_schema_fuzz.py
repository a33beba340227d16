"""Schema-driven fuzzing of every route in /openapi.json, in process on a scripted
engine (no model, so a few hundred requests take seconds): no 5xx, ever, and every
4xx in OpenAI's error shape. Bodies mix valid values of each field with hostile
ones (wrong types, huge and negative integers, lone surrogates, deep nesting);
generated max_tokens and n are capped so the valid ones finish quickly."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import LORA_CFG, ScriptedRunner, ToyTokenizer, tiny_adapter
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

HOSTILE = st.sampled_from(
    [
        None,
        True,
        -1,
        0,
        2**31,
        2**63,
        10**30,
        -(10**30),
        1e308,
        -0.5,
        "",
        "16",
        "\ud800",
        "x" * 3000,
        [],
        [1, 2],
        ["a"],
        [[1]],
        {},
        {"a": 1},
        [[[[[[[[[[1]]]]]]]]]],
    ]
)
ENDLESS = {"/tokenmill/live/events"}  # an event stream that ends only with the client (tests/server/test_live_view.py)
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2}


@pytest.fixture(scope="module")
def fuzz_app():
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=256, block_size=4, max_model_len=64))
    )
    app = build_app(
        engine, ToyTokenizer(), 64, ServerConfig(served_model_name="toy", max_queue=64, max_request_bytes=1 << 16)
    )
    yield app, engine
    engine.shutdown()


def routes(app) -> list[tuple[str, str, dict | None]]:
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    out = []
    for path, methods in doc["paths"].items():
        if path in ENDLESS:
            continue
        for method, op in methods.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            out.append((method.upper(), path, schemas[ref.rsplit("/", 1)[1]] if ref else None))
    return out


def valid_value(name: str, prop: dict) -> st.SearchStrategy:
    if name in CAPS:
        return st.integers(1, CAPS[name])
    if name == "messages":
        return st.just([{"role": "user", "content": "hi"}])
    if name == "input":  # /v1/responses
        return st.sampled_from(
            [
                "hello",
                [{"role": "user", "content": "hi"}],
                [
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "42"},
                ],
            ]
        )
    if name == "prompt":
        return st.sampled_from(["hello", [1, 2, 3], ["a", "b"]])
    if name == "tokens":
        return st.lists(st.integers(0, 49), max_size=5)
    kinds = {t.get("type") for t in prop.get("anyOf", [prop])}
    if "boolean" in kinds:
        return st.booleans()
    if "integer" in kinds:
        return st.integers(0, 5)
    if "number" in kinds:
        return st.floats(0, 1)
    return st.none()


@st.composite
def requests(draw, app):
    method, path, schema = draw(st.sampled_from(routes(app)))
    if schema is None:
        return method, path, None
    props = schema.get("properties", {})
    body = {}
    for name, prop in props.items():  # a valid body first ...
        if name in schema.get("required", []) or draw(st.integers(0, 3)) == 0:
            body[name] = draw(valid_value(name, prop))
    body = {k: v for k, v in body.items() if v is not None}
    for name in draw(st.lists(st.sampled_from(sorted(props)), max_size=2)):  # ... then up to two hostile fields
        body[name] = draw(HOSTILE)
    return method, path, body


GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def settles(condition, timeout: float = 5.0) -> bool:
    """The engine's thread frees a finished request after the client has its last
    output (the next loop turn): poll for it rather than race it."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def call(app, method: str, path: str, body: dict | None) -> httpx.Response:
    """One request to the app, in process."""

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            content = None if body is None else json.dumps(body).encode()
            return await c.request(method, path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(go())


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_route_answers_fuzzed_bodies_without_a_5xx(fuzz_app, data):
    app, engine = fuzz_app
    method, path, body = data.draw(requests(app))

    r = call(app, method, path, body)
    assert r.status_code < 500, (method, path, body, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert path not in GENERATING or settles(lambda: engine.engine.core.num_unfinished_requests == 0)


@pytest.mark.parametrize(
    "fields",
    [{"add_special_tokens": True}, {"continue_final_message": True, "add_generation_prompt": False}],
    ids=["add_special_tokens", "continue_final_message"],
)
def test_chat_rendering_fields_reach_the_tokenizer(fuzz_app, fields):
    """A chat rendering field a request sets is passed to the tokenizer's encode_chat
    and answered (the fuzz found a 500 where the test tokenizer lacked one)."""
    app, engine = fuzz_app
    body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert settles(lambda: engine.engine.core.num_unfinished_requests == 0)


# --------------------------------------- structured output, tools and LoRA routes
# Issue 24: the same fuzz against a server that compiles grammars (our real tokenizer
# and llguidance), offers tools and loads adapters at run time (real adapter files,
# read and checked against a small model config), still on a scripted engine.

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    {"$ref": "#"},
    {"type": "nope"},
    {"type": "object", "properties": {f"p{i}": {} for i in range(700)}},
    {"anyOf": [{"type": "string", "pattern": "(a+)+$"}, {"type": "null"}]},
    {"$ref": "http://example.com/x"},
]
STRUCTURED = {
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "xml"},
            *({"type": "json_schema", "json_schema": {"name": "s", "schema": s}} for s in SCHEMAS),
            {"type": "json_schema"},
        ]
    ),
    "guided_json": st.sampled_from(SCHEMAS),
    "guided_regex": st.sampled_from(["[a-z]{1,5}", "a{1000000}", "(unclosed", "(a|aa)*b", "\\d+"]),
    "guided_choice": st.sampled_from([["yes", "no"], [""], ["x"] * 3, [f"o{i}" for i in range(5000)]]),
    "guided_grammar": st.sampled_from(['root ::= "a" root', 'root ::= "yes" | "no"', "start: /[0-9]+/", "root ::="]),
    "structured_outputs": st.sampled_from([{"regex": "[0-9]+"}, {"choice": ["a", "b"]}, {"json": {}}, {"jsonn": 1}]),
    "tools": st.sampled_from(
        [
            [WEATHER],
            [WEATHER, WEATHER],
            [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
            [{"type": "function"}],
            [{"type": "function", **WEATHER["function"]}],
            [{"type": "web_search"}],
        ]
    ),
    "text": st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {"format": {}},
            *({"format": {"type": "json_schema", "name": "s", "schema": s}} for s in SCHEMAS),
            {"verbosity": "low"},
        ]
    ),
    "tool_choice": st.sampled_from(
        [
            "auto",
            "none",
            "required",
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "nope"}},
        ]
    ),
    "lora_name": st.sampled_from(["ad1", "ad2", "ad1", "ad2", "toy", "../x", "a\nb", ""]),
}


class LoRARunner(ScriptedRunner):
    """The scripted runner with the real adapter reader: files are read and checked
    against a small model config, names served are kept (the scripted 'model' ignores
    them when it samples)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.adapters: dict[str, object] = {}

    def load_lora(self, name: str, path: str) -> object:
        from tokenmill.lora.adapter import load_adapter

        return load_adapter(name, path, LORA_CFG, max_rank=8)

    def add_lora(self, name: str, path: str, loaded: object) -> None:
        self.adapters[name] = loaded

    def remove_lora(self, name: str) -> None:
        self.adapters.pop(name, None)


@pytest.fixture(scope="module")
def full_fuzz_app(tmp_path_factory):
    from tokenmill.model.paths import default_model_path
    from tokenmill.model.tokenizer import load_tokenizer
    from tokenmill.structured.grammar import GrammarCompiler

    pytest.importorskip("llguidance")
    tokenizer = load_tokenizer(default_model_path())
    config = EngineConfig(num_blocks=256, block_size=4, max_model_len=256, max_loras=2)
    engine = AsyncEngine(Engine.create(LoRARunner(4), tokenizer, config, grammars=GrammarCompiler(tokenizer, 49152)))
    app = build_app(
        engine,
        tokenizer,
        256,
        ServerConfig(
            served_model_name="toy", max_queue=64, max_request_bytes=1 << 16, allow_runtime_lora_updating=True
        ),
    )
    good = tiny_adapter(tmp_path_factory.mktemp("lora") / "good")
    yield app, engine, [str(good), str(good), str(good), "/nonexistent", "/etc", str(good.parent)]
    engine.shutdown()


@st.composite
def full_requests(draw, app, lora_paths: list[str]):
    method, path, schema = draw(st.sampled_from(routes(app)))
    if schema is None:
        return method, path, None
    props = schema.get("properties", {})
    constraints = [n for n in STRUCTURED if n in props and n not in ("tools", "tool_choice", "lora_name")]
    constraint = draw(st.sampled_from([None, *constraints])) if constraints else None
    body = {}
    for name, prop in props.items():  # a valid body, often with one constraint or tools ...
        wanted = name in schema.get("required", []) or draw(st.integers(0, 5)) == 0
        if name == "lora_path":
            body[name] = draw(st.sampled_from(lora_paths))
        elif name == "lora_name" or name == constraint or (name in ("tools", "tool_choice") and wanted):
            body[name] = draw(STRUCTURED[name])
        elif name == "model":
            body[name] = draw(st.sampled_from(["toy", "toy", "toy", "ad1", "ad2", "nope"]))
        elif wanted and name not in STRUCTURED and name != "best_of":
            body[name] = draw(valid_value(name, prop))
    body = {k: v for k, v in body.items() if v is not None}
    if draw(st.integers(0, 3)) == 0:  # ... and perhaps one hostile field
        body[draw(st.sampled_from(sorted(props)))] = draw(HOSTILE)
    return method, path, body


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_structured_tool_and_lora_routes_answer_fuzzed_bodies_without_a_5xx(full_fuzz_app, data):
    app, engine, lora_paths = full_fuzz_app
    method, path, body = data.draw(full_requests(app, lora_paths))

    r = call(app, method, path, body)
    assert r.status_code < 500, (method, path, body, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert path not in GENERATING or settles(
        lambda: engine.engine.core.num_unfinished_requests == 0 and engine.engine.core.snapshot().kv_usage == 0.0
    )
