"""vLLM's request fields beyond OpenAI's, over HTTP on the real model: each does what it does in
vLLM (continuous usage in a stream, token ids and the rendered prompt returned, a cache salt that
keeps prefix-cache blocks apart, which side a truncation keeps), or is refused with a 400 that says
why it cannot apply here; none is ignored."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import MODEL, Server
from tokenmill.server.protocol.vllm_fields import CANNOT

ASK = [{"role": "user", "content": "Name three rivers in France."}]


def events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http, path):
    """guidellm always asks for it: every chunk carries the usage so far, the last the whole."""
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"messages": ASK} if "chat" in path else {"prompt": "The capital of France is"}
    whole = http.post(path, json=body).json()["usage"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(http, path, body | {"stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and len(counts) > 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole
    final_only = events(http, path, body | {"stream_options": {"include_usage": True}})
    assert [c["usage"] for c in final_only if c["choices"]] == [None] * (len(final_only) - 1)


def test_return_token_ids_and_prompt_text_whole_and_streamed(http, llm):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 10, "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body | {"return_token_ids": True, "return_prompt_text": True})
    answer = whole.json()
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == answer["usage"]["completion_tokens"]
    assert llm.tokenizer.decode(ids) == answer["choices"][0]["message"]["content"]
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    assert llm.tokenizer.decode(answer["prompt_token_ids"], skip_special_tokens=False) == answer["prompt_text"]
    assert answer["prompt_text"].endswith("Name three rivers in France.<|im_end|>\n<|im_start|>assistant\n")
    chunks = events(http, "/v1/chat/completions", body | {"return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    plain = http.post("/v1/chat/completions", json=body).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    completion = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "return_token_ids": True}
    ).json()["choices"][0]
    assert completion["prompt_token_ids"] == llm.tokenizer.encode("Hello there")
    assert len(completion["token_ids"]) == 3


def test_a_cache_salt_keeps_prefix_cache_blocks_apart(http, server):
    prompt = "A long shared context about the rivers of France and their towns. " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def hits_of(**extra) -> float:
        before = server.metric("tokenmill:prefix_cache_hits_total")
        assert http.post("/v1/completions", json=body | extra).status_code == 200
        return server.metric("tokenmill:prefix_cache_hits_total") - before

    hits_of(cache_salt="tenant-a")  # fills the cache under salt a
    assert hits_of(cache_salt="tenant-a") > 100  # the same salt: the prompt's blocks are found
    assert hits_of(cache_salt="tenant-b") == 0  # another salt: nothing found, whatever is cached
    assert hits_of() == 0  # nor without one
    assert hits_of() > 100
    bad = http.post("/v1/completions", json=body | {"cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_truncation_side_says_which_end_truncate_prompt_tokens_keeps(http, llm):
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    kept = {
        side: http.post("/v1/completions", json=body | {"truncation_side": side}).json()["choices"][0]
        for side in ("left", "right")
    }
    assert kept["left"]["prompt_token_ids"] == ids[-4:] and kept["right"]["prompt_token_ids"] == ids[:4]


@pytest.mark.parametrize(
    "field, value, path",
    [
        ("kv_transfer_params", {"do_remote_prefill": True}, "/v1/completions"),
        ("vllm_xargs", {"my_processor": 1}, "/v1/chat/completions"),
        ("mm_processor_kwargs", {"num_crops": 4}, "/v1/chat/completions"),
        ("media_io_kwargs", {"video": {"num_frames": 8}}, "/v1/chat/completions"),
        ("thinking_token_budget", 64, "/v1/chat/completions"),
        ("logits_processors", ["my.module:Proc"], "/v1/chat/completions"),
        ("verbosity", "low", "/v1/chat/completions"),
        ("prompt_embeds", "AAAA", "/v1/completions"),
        ("structural_tag", {"type": "structural_tag"}, "/v1/chat/completions"),
    ],
)
def test_a_field_that_cannot_apply_here_is_refused_with_why(http, field, value, path):
    body = {"model": MODEL, "max_tokens": 2}
    body |= {"messages": ASK} if "chat" in path else {"prompt": "Hi"}
    r = http.post(path, json=body | {field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["message"] == f"{field} cannot apply here: {CANNOT[field]}"
    empty = {} if isinstance(value, dict) else None  # sent empty, as some SDKs do: served
    assert http.post(path, json=body | {field: empty}).status_code == 200


def test_fields_asked_empty_or_at_their_default_are_served(http):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "modalities": ["text"], "stream_interval": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    audio = http.post("/v1/chat/completions", json=body | {"modalities": ["text", "audio"]})
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"
    interval = http.post("/v1/chat/completions", json=body | {"stream_interval": 4})
    assert interval.status_code == 400 and "every token is streamed" in interval.json()["error"]["message"]


def test_tokenize_with_messages_renders_as_the_chat_request_would(http):
    """vLLM's tokenize-chat fields: the ids are those the same chat request runs on."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    reply = [*ASK, {"role": "assistant", "content": "The Seine, the"}]
    cases = [
        {"messages": ASK},
        {"messages": ASK, "add_generation_prompt": False},
        {"messages": reply, "add_generation_prompt": False, "continue_final_message": True},
        {"messages": ASK, "tools": [tool]},
    ]
    counted = []
    for case in cases:
        tokens = http.post("/tokenize", json=case).json()["tokens"]
        chat = {"model": MODEL, "max_tokens": 1, "return_token_ids": True, **case}
        ran = http.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"]
        assert tokens == ran, case
        counted.append(len(tokens))
    assert counted[1] < counted[0] < counted[3]  # no assistant header; the tools described
    both = http.post("/tokenize", json={"messages": reply, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    "first, second", [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")]
)
def test_score_takes_vllms_newer_names_for_its_two_sides(http, first, second):
    body = {
        "model": MODEL,
        first: "rivers of France",
        second: ["The Seine flows through Paris.", "A recipe for bread."],
    }
    r = http.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    old = http.post("/v1/score", json={"model": MODEL, "text_1": body[first], "text_2": body[second]}).json()
    assert scores == [d["score"] for d in old["data"]]
    mixed = http.post("/v1/score", json={"model": MODEL, "text_1": "a", "documents": ["b"]})
    assert mixed.status_code == 400 and "queries and documents" in mixed.json()["error"]["message"]


def test_identical_requests_get_identical_answers_and_scores_whatever_runs_beside_them():
    """At the server's defaults (this CPU's dtype: bfloat16 where it is native): the first call
    (nothing cached) and later ones (its prompt's blocks from the prefix cache), alone or among
    other requests in the same steps, get the same greedy tokens and logprobs, and the same scores."""
    server = Server("--served-model-name", MODEL, "--kv-cache-memory", "256MiB", one_model=False)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            _identical_answers(http)
    finally:
        assert server.stop() == 0


def _identical_answers(http) -> None:

    ask = [{"role": "user", "content": "Name a famous French river, and a city on it, in one line."}]
    body = {"model": MODEL, "messages": ask, "temperature": 0, "max_tokens": 16, "logprobs": True, "top_logprobs": 2}

    def answer(b: dict) -> tuple:
        c = http.post("/v1/chat/completions", json=b).json()["choices"][0]
        return c["message"]["content"], [
            (t["token"], t["logprob"], str(t["top_logprobs"])) for t in c["logprobs"]["content"]
        ]

    first = answer(body)
    assert answer(body) == first
    others = [
        dict(body, messages=[{"role": "user", "content": f"Tell story {i} about a lighthouse keeper."}])
        for i in range(6)
    ]
    with ThreadPoolExecutor(7) as pool:
        crowded = list(pool.map(answer, [*others[:3], body, *others[3:]]))[3]
    assert crowded == first
    pair = {"model": MODEL, "text_1": "rivers of France", "text_2": ["The Seine flows through Paris.", "Bread."]}
    scores = [[d["score"] for d in http.post("/v1/score", json=pair).json()["data"]] for _ in range(3)]
    assert scores[0] == scores[1] == scores[2]


def test_embeddings_encode_in_the_dtype_and_byte_order_vllm_asks(http):
    import base64

    import numpy as np

    body = {"model": MODEL, "input": "rivers of France"}
    floats = np.array(http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"], dtype=np.float32)

    def decoded(dtype: str, endianness: str, numpy_type: str) -> np.ndarray:
        asked = body | {"encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
        raw = base64.b64decode(http.post("/v1/embeddings", json=asked).json()["data"][0]["embedding"])
        return np.frombuffer(raw, dtype=numpy_type)

    assert np.array_equal(decoded("float32", "little", "<f4"), floats)
    assert np.array_equal(decoded("float32", "big", ">f4"), floats)
    assert np.allclose(decoded("float16", "little", "<f2").astype(np.float32), floats, rtol=1e-3, atol=1e-4)
    bf16 = decoded("bfloat16", "big", ">u2").astype(np.uint32) << 16
    assert np.allclose(bf16.view(np.float32), floats, rtol=8e-3, atol=1e-3)
    refused = http.post("/v1/embeddings", json=body | {"embed_dtype": "float16"})  # floats in JSON: float32 only
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "embed_dtype"


def test_routes_that_embed_take_the_salt_and_the_side_and_refuse_what_cannot_apply(http, server, llm):
    text = "A long shared context about the rivers of France and their towns. " * 12

    def hits_of(**extra) -> float:
        before = server.metric("tokenmill:prefix_cache_hits_total")
        assert http.post("/v1/embeddings", json={"model": MODEL, "input": text, **extra}).status_code == 200
        return server.metric("tokenmill:prefix_cache_hits_total") - before

    hits_of(cache_salt="a")
    assert hits_of(cache_salt="a") > 100 and hits_of(cache_salt="b") == 0
    ids = llm.tokenizer.encode("one two three four five six seven eight")
    cut = {"model": MODEL, "input": [ids], "truncate_prompt_tokens": 3, "truncation_side": "right"}
    first = http.post("/v1/embeddings", json=cut).json()["data"][0]["embedding"]
    assert (
        first == http.post("/v1/embeddings", json={"model": MODEL, "input": [ids[:3]]}).json()["data"][0]["embedding"]
    )
    for path, body, field in (
        ("/v1/rerank", {"query": "rivers", "documents": ["Seine"], "use_activation": True}, "use_activation"),
        ("/v1/score", {"text_1": "rivers", "text_2": "Seine", "instruction": "Judge relevance"}, "instruction"),
        ("/v1/embeddings", {"input": "rivers", "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
    ):
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "cannot apply here" in r.text


def test_the_responses_api_takes_vllms_fields_as_the_chat_request_it_becomes(http):
    base = {"model": MODEL, "input": "Count from one to ten in words, separated by commas.", "max_output_tokens": 40}
    whole = http.post("/v1/responses", json=base | {"temperature": 0}).json()
    text = whole["output"][-1]["content"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece of the greedy answer: it ends there
    stopped = http.post("/v1/responses", json=base | {"temperature": 0, "stop": [stop], "top_k": 1}).json()
    assert stopped["output"][-1]["content"][0]["text"] == text[: text.index(stop)]
    seeded = [
        http.post("/v1/responses", json=base | {"temperature": 1.0, "seed": 7, "cache_salt": "t"}).json()
        for _ in range(2)
    ]
    assert seeded[0]["output"][-1]["content"] == seeded[1]["output"][-1]["content"]
    for field, value, said in (
        ("kv_transfer_params", {"do_remote_decode": True}, CANNOT["kv_transfer_params"]),
        ("prompt", {"id": "pmpt_123"}, "prompt template stored on OpenAI's platform"),
    ):
        r = http.post("/v1/responses", json=base | {field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and said in r.json()["error"]["message"]


def test_embeddings_of_messages_are_those_of_the_rendered_chat(http, llm):
    """vLLM's chat embeddings: the messages through the template (no generation prompt by
    default), embedded as the same ids given as input would be."""
    chat = http.post("/v1/embeddings", json={"model": MODEL, "messages": ASK}).json()
    rendered = http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": False}).json()["tokens"]
    same = http.post("/v1/embeddings", json={"model": MODEL, "input": [rendered]}).json()
    assert chat["data"][0]["embedding"] == same["data"][0]["embedding"]
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    both = http.post("/v1/embeddings", json={"model": MODEL, "messages": ASK, "input": "x"})
    assert both.status_code == 400 and "exactly one of input and messages" in both.json()["error"]["message"]
