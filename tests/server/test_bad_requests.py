"""Hostile and malformed requests, in process on a scripted engine (no model): every
one gets a 4xx in OpenAI's error shape, and nothing is left running."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app
from tokenmill.server.protocol.openai import ChatCompletionRequest

KEY = "sekrit"
MODEL = "toy"


@pytest.fixture(scope="module")
def app_engine():
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    )
    config = ServerConfig(served_model_name=MODEL, api_key=KEY, max_queue=2, max_request_bytes=4096)
    yield build_app(engine, ToyTokenizer(), 64, config), engine
    engine.shutdown()


def call(
    app,
    method: str,
    path: str,
    body=None,
    raw: bytes | None = None,
    auth: str | None = f"Bearer {KEY}",
    headers: dict[str, str | bytes] | None = None,
):
    async def go():
        sent = {"content-type": "application/json", **(headers or {})}
        if auth is not None:
            sent["authorization"] = auth
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            return await c.request(method, path, content=content, headers=sent)

    return asyncio.run(go())


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "hi", "model": "\\udfff", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "\\ud83d", "content": "hi"}], "max_tokens": 2}'),
        ("/tokenize", b'{"prompt": "\\udc00"}'),
    ],
    ids=["prompt", "model", "chat-content", "role", "tokenize"],
)
def test_a_lone_surrogate_is_a_400_not_a_500(app_engine, path, raw):
    # a role is one of OpenAI's names, checked first: pydantic's words ("not a unicode string")
    word = "unicode" if b'"role": "\\ud83d"' in raw else "surrogate"
    assert_error(call(app_engine[0], "POST", path, raw=raw), 400, word)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"top_k": 2**63, "top_p": 0.5}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"n": 10**6}, "n"),
        ({"max_tokens": "sixteen"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"allowed_token_ids": [0], "min_tokens": 1, "stop_token_ids": [0]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3], "guided_regex": "[a-z]+"}, "allowed_token_ids"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"suffix": "!"}, "suffix"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_out_of_range_wrongly_typed_or_unsupported_fields_are_400s_naming_the_field(app_engine, body, field):
    r = call(app_engine[0], "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert assert_error(r, 400)["param"] in (field, f"{field}.0", f"{field}.5") or field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/tokenize", {"prompt": "hi"}),
    ],
)
def test_a_field_we_do_not_know_is_refused_by_name_and_no_effect_fields_are_accepted(app_engine, path, body):
    for name, value in (("foo_unknown", 1), ("min_tokens_typo", 3), ("media_kwargs_typo", {"x": 1})):
        err = assert_error(
            call(app_engine[0], "POST", path, {**body, name: value}),
            400,
            f"Unrecognized request argument supplied: {name}",
        )
        assert err["param"] == name
    if path != "/tokenize":
        from tokenmill.server.protocol.openai import NO_EFFECT

        accepted = {
            "user": "u1",
            "metadata": {"k": "v"},
            "service_tier": "auto",
            "prompt_cache_key": "p",
            "safety_identifier": "s",
            "store": path == "/v1/responses",
        }
        assert set(accepted) == set(NO_EFFECT)
        assert call(app_engine[0], "POST", path, {**body, **accepted}).status_code == 200


def test_unknown_stream_options_are_refused_by_name(app_engine):
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"usage_every_n": 2}}
    err = assert_error(call(app_engine[0], "POST", "/v1/completions", body), 400, "usage_every_n")
    assert err["param"] == "usage_every_n"
    ok = {**body, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert call(app_engine[0], "POST", "/v1/completions", ok).status_code == 200


def test_echo_with_best_of_and_no_logprobs_answers(app_engine):
    r = call(
        app_engine[0], "POST", "/v1/completions", {"prompt": "hi", "echo": True, "n": 1, "best_of": 2, "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi")
    assert r.json()["choices"][0]["logprobs"] is None and len(r.json()["choices"]) == 1


def test_models_by_id_version_ping_and_a_body_that_is_not_json(app_engine):
    app = app_engine[0]
    card = call(app, "GET", f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert_error(call(app, "GET", "/v1/models/other"), 404, "other")
    assert call(app, "GET", "/version", auth=None).json()["version"]
    assert call(app, "GET", "/ping", auth=None).status_code == 200 == call(app, "POST", "/ping", auth=None).status_code
    info = call(app, "GET", "/tokenizer_info").json()
    assert info["model_max_length"] == 64 and "eos_token" in info and info["vocab_size"] > 0
    assert call(app, "GET", "/tokenizer_info", auth=None).status_code == 401  # behind the key, as /tokenize
    err = assert_error(
        call(app, "POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": '), 400, "not valid JSON"
    )
    assert err["param"] is None


def test_unknown_routes_and_methods_answer_in_the_openai_shape(app_engine):
    assert_error(call(app_engine[0], "GET", "/v1/nope"), 404, "/v1/nope")
    assert_error(call(app_engine[0], "GET", "/v1/completions"), 405)
    assert_error(call(app_engine[0], "POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": '), 400)
    assert_error(call(app_engine[0], "POST", "/v1/completions", raw=b"\xff\xfe{}"), 400)


def test_the_key_guards_tokenize_and_its_scheme_is_case_insensitive(app_engine):
    app = app_engine[0]
    assert_error(call(app, "POST", "/tokenize", {"prompt": "hi"}, auth=None), 401)
    assert_error(call(app, "POST", "/detokenize", {"tokens": [1]}, auth="Bearer wrong"), 401)
    assert call(app, "POST", "/tokenize", {"prompt": "hi"}, auth=f"bearer {KEY}").json()["count"] == 2
    assert call(app, "GET", "/health", auth=None).status_code == 200  # health and metrics stay open
    assert call(app, "GET", "/metrics", auth=None).status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_with_a_key_the_api_description_needs_it_too(app_engine, path):
    """Every route and field of the API is in /openapi.json (and the pages that draw it):
    with --api-key it is no more public than the API."""
    app = app_engine[0]
    assert_error(call(app, "GET", path, auth=None), 401, "API key")
    assert_error(call(app, "GET", path, auth="Bearer wrong"), 401, "API key")
    assert call(app, "GET", path).status_code == 200

    async def signed_in() -> int:  # the web page's sign-in cookie is a browser's key: /docs opens
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/login", data={"key": KEY})).status_code == 303
            return (await c.get(path)).status_code

    assert asyncio.run(signed_in()) == 200


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
)
@pytest.mark.parametrize("bad", [b"x" * 100_000, b"a b", "caf\u00e9".encode()])
def test_an_invalid_request_id_is_refused_by_name_and_not_echoed(app_engine, path, body, bad):
    """A 400 that names the header and its rule, with neither the value in its body nor the
    header sent back: a 100 KB id came back whole on the error's X-Request-Id."""
    app, engine = app_engine
    r = call(app, "POST", path, body, headers={"X-Request-Id": bad})
    err = assert_error(r, 400, "X-Request-Id", "printable ASCII")
    assert err["param"] == "X-Request-Id"
    assert "x-request-id" not in r.headers, r.headers.get("x-request-id", "")[:80]
    assert bad not in r.content and len(r.content) < 1000
    assert engine.engine.core.num_unfinished_requests == 0
    # nor on a route that does not read it; a valid id still comes back everywhere
    assert "x-request-id" not in call(app, "GET", "/v1/models", headers={"X-Request-Id": bad[:300]}).headers
    assert call(app, "GET", "/v1/models", headers={"X-Request-Id": "trace-7"}).headers["x-request-id"] == "trace-7"


def test_the_rerank_limit_counts_the_documents_not_the_query():
    """--max-embedding-inputs 3 takes a query and 3 documents; 4 documents are a 400 that
    counts 4 (it said 5: the query was counted as an input)."""
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    )
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name=MODEL, max_embedding_inputs=3))
    try:
        body = {"model": MODEL, "query": "abc", "documents": ["ab", "cd", "ef"]}
        ok = call(app, "POST", "/v1/rerank", body, auth=None)
        assert ok.status_code == 200, ok.text
        assert sorted(r["index"] for r in ok.json()["results"]) == [0, 1, 2]
        r = call(app, "POST", "/v1/rerank", {**body, "documents": ["ab", "cd", "ef", "gh"]}, auth=None)
        err = assert_error(r, 400, "has 4 inputs", "at most 3", "--max-embedding-inputs")
        assert err["param"] == "documents"
        assert engine.engine.core.num_unfinished_requests == 0
    finally:
        engine.shutdown()


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(app_engine):
    r = call(app_engine[0], "POST", "/tokenize", {"prompt": "x" * 10_000})
    assert_error(r, 413, "4096 bytes")
    ok = call(app_engine[0], "POST", "/tokenize", {"prompt": "x" * 1000})
    assert ok.status_code == 200 and ok.json()["count"] == 1000


def test_the_queue_limit_counts_prompts_times_n(app_engine):
    app, engine = app_engine
    r = call(app, "POST", "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
    err = assert_error(r, 429, "adds 3", "max_queue=2")
    assert err["type"] == "RateLimitError" and r.headers["retry-after"] == "1"
    assert_error(call(app, "POST", "/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 2}), 429, "adds 3")
    ok = call(app, "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    assert engine.engine.core.num_unfinished_requests == 0


def test_the_openapi_document_says_400_and_event_stream(app_engine):
    doc = call(app_engine[0], "GET", "/openapi.json").json()
    text = json.dumps(doc)
    assert '"422"' not in text
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in completions and "text/event-stream" in completions["200"]["content"]


def test_a_stream_cancelled_mid_wait_leaves_its_source_closable():
    """A client that goes away cancels the SSE writer while it waits for the next
    output; the source must then close cleanly (it once raised 'aclose(): asynchronous
    generator is already running' for every streamed disconnect)."""
    from tokenmill.server.jobs.streaming import until as _until

    closed = []
    waiting = asyncio.Event()

    async def source():
        try:
            yield 1
            waiting.set()
            await asyncio.sleep(3600)  # an engine that has nothing yet
            yield 2
        finally:
            closed.append(True)

    async def main():
        items = source()

        async def consume():
            async for _ in _until(items, asyncio.Event()):
                pass

        task = asyncio.create_task(consume())
        await asyncio.wait_for(waiting.wait(), timeout=10)  # the consumer is blocked on the source
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await items.aclose()  # must not raise

    asyncio.run(main())
    assert closed == [True]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,words",
    [
        ([{"role": "hacker", "content": "hi"}], ("messages.0.role",)),
        (
            [{"role": "tool", "tool_call_id": "call_1", "content": "r"}, {"role": "user", "content": "hi"}],
            ("messages[0]", "no such tool_call_id"),
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_9", "content": "r"},
            ],
            ("messages[2]", "no such tool_call_id"),
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "r"},
            ],
            ("needs the tool_call_id",),
        ),
    ],
    ids=["unknown-role", "tool-first", "unknown-call-id", "no-call-id"],
)
def test_conversations_openai_refuses_are_400s(app_engine, messages, words):
    """Issue 24 item 10: roles are OpenAI's; a tool message answers an earlier call."""
    app, engine = app_engine
    r = call(app, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert_error(r, 400, *words)
    ok = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ]
    assert len(ChatCompletionRequest(messages=ok, max_tokens=2).messages) == 3  # the same, answered: accepted


def test_a_body_trickled_past_the_timeout_gets_408():
    """Issue 24 item 11: a client that never finishes its body is answered 408 (OpenAI's
    error shape) after --request-body-timeout, instead of holding its connection."""
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name=MODEL, request_body_timeout=0.5))
    sent: list[dict] = []

    async def main():
        parts = [{"type": "http.request", "body": b'{"prompt": "ab', "more_body": True}]

        async def receive():
            if parts:
                return parts.pop()
            await asyncio.sleep(3600)  # the rest never comes

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("t", 80),
            "client": ("c", 1),
            "root_path": "",
        }
        await asyncio.wait_for(app(scope, receive, send), 10)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    err = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert err["code"] == 408 and "--request-body-timeout" in err["message"]


def _scope(method: str, path: str) -> dict:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("t", 80),
        "client": ("c", 1),
        "root_path": "",
    }


async def _call_asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    await app(_scope(method, path), receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_requests_past_the_open_request_cap_get_503_and_probes_still_answer():
    """Issue 24 item 11: while --max-open-requests are open (here: two bodies that never
    finish arriving), a new request is answered 503 at once in OpenAI's shape with
    Retry-After; /health still answers; once they close, requests are served again."""
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    app = build_app(
        engine,
        ToyTokenizer(),
        64,
        ServerConfig(served_model_name=MODEL, max_open_requests=2, request_body_timeout=3600),
    )

    async def trickle():
        first = [{"type": "http.request", "body": b'{"prompt": "ab', "more_body": True}]

        async def receive():
            if first:
                return first.pop()
            await asyncio.sleep(3600)

        async def send(message):
            pass

        await app(_scope("POST", "/v1/completions"), receive, send)

    async def main():
        slow = [asyncio.create_task(trickle()) for _ in range(2)]
        await asyncio.sleep(0.1)
        busy = await _call_asgi(app, "POST", "/v1/completions", json.dumps({"prompt": "ab", "max_tokens": 2}).encode())
        health = await _call_asgi(app, "GET", "/health")
        for t in slow:
            t.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        after = await _call_asgi(app, "POST", "/v1/completions", json.dumps({"prompt": "ab", "max_tokens": 2}).encode())
        return busy, health, after

    try:
        busy, health, after = asyncio.run(main())
    finally:
        engine.shutdown()
    status, headers, body = busy
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == 503 and "--max-open-requests" in err["message"] and headers["retry-after"]
    assert health[0] == 200
    assert after[0] == 200 and json.loads(after[2])["choices"][0]["text"]


def test_a_schema_nested_deeper_than_the_limit_is_a_400_naming_it(app_engine):
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"properties": {"a": schema}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}},
    }
    assert_error(call(app_engine[0], "POST", "/v1/chat/completions", body), 400, "nested more than")


def test_an_unknown_field_inside_a_message_is_refused_by_name(app_engine):
    """Issue 40 item 7: the fields of a message are as strict as the request's. The
    fields of an assistant message clients send back as they got it are accepted when
    empty and refused, by name, with content (nothing would render them)."""
    app = app_engine[0]

    def chat(*messages):
        return call(app, "POST", "/v1/chat/completions", {"messages": list(messages), "max_tokens": 2})

    err = assert_error(
        chat({"role": "user", "content": "hi", "foo": 1}), 400, "Unrecognized request argument supplied: foo"
    )
    assert err["param"] == "foo"
    echoed = {
        "role": "assistant",
        "content": "yes",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "reasoning_content": None,
    }
    assert chat({"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "and?"}).status_code == 200
    err = assert_error(chat({"role": "user", "content": "hi"}, {**echoed, "refusal": "no"}), 400, "refusal")
    assert err["param"] == "messages"


def test_a_nul_byte_in_a_lora_path_is_a_400_naming_it():
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name=MODEL, allow_runtime_lora_updating=True))
    try:
        for field, body in (
            ("lora_path", {"lora_name": "a", "lora_path": "/tmp/x\x00y"}),
            ("lora_name", {"lora_name": "a\x00", "lora_path": "/tmp/x"}),
        ):
            err = assert_error(call(app, "POST", "/v1/load_lora_adapter", body, auth=None), 400, "NUL byte")
            assert err["param"] == field
    finally:
        engine.shutdown()


class _FailingTokenizer(ToyTokenizer):
    """A tokenizer with a bug: text with "boom" in it raises what no handler expects."""

    def encode(self, text, add_special_tokens=True):
        if "boom" in text:
            raise RuntimeError("a bug")
        return super().encode(text, add_special_tokens)


def test_an_unexpected_error_is_a_json_500_and_the_connection_serves_the_next_request():
    """Issue 40 item 3: before, Starlette answered plain text and re-raised, and uvicorn
    dropped the keep-alive connection. On one real uvicorn, one HTTP/1.1 connection: the
    failing request gets OpenAI's error shape, and the next request on it is answered."""
    import http.client
    import socket
    import threading

    import uvicorn

    from tests.helpers import wait_until

    engine = AsyncEngine(
        Engine.create(
            ScriptedRunner(4), _FailingTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64)
        )
    )
    app = build_app(engine, _FailingTokenizer(), 64, ServerConfig(served_model_name=MODEL))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=10)
        conn = http.client.HTTPConnection("127.0.0.1", listener.getsockname()[1], timeout=10)
        conn.request("POST", "/tokenize", json.dumps({"prompt": "boom"}), {"content-type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 500 and err["code"] == 500 and err["type"] == "InternalServerError", err
        sock = conn.sock
        conn.request("POST", "/tokenize", json.dumps({"prompt": "fine"}), {"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["count"] == 4
        assert conn.sock is sock  # the same connection, not a reconnect
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
