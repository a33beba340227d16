"""vLLM's scoring routes over HTTP (/score, /rerank, /pooling: the cosine of the
embeddings /v1/embeddings returns, or those embeddings), and the legacy prompt scoring
of /v1/completions (echo with max_tokens 0); bad input refused naming its field."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")

QUERY = "What is the capital of France?"
DOCS = ["The cat sat on the mat.", "Paris is the capital of France.", "France is a country in Europe."]
PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _embeddings(client, texts: list[str]) -> list[list[float]]:
    return [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]


def test_score_is_the_cosine_of_the_embeddings(client, http):
    query, *docs = _embeddings(client, [QUERY, *DOCS])
    r = http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS}).json()
    assert r["object"] == "list" and r["id"].startswith("score-") and r["model"] == MODEL
    assert [(d["index"], d["object"]) for d in r["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    for d, doc in zip(r["data"], docs, strict=True):
        assert abs(d["score"] - _cosine(query, doc)) < 1e-5
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0
    # N:N, pairwise, at the unversioned path
    pairs = http.post("/score", json={"model": MODEL, "text_1": DOCS[:2], "text_2": [QUERY, DOCS[2]]}).json()
    want = [_cosine(docs[0], query), _cosine(docs[1], docs[2])]
    assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(pairs["data"], want, strict=True))


def test_rerank_orders_documents_best_first(http):
    scores = [d["score"] for d in http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()["data"]]
    best_first = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    r = http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}).json()
    assert r["model"] == MODEL and r["usage"]["total_tokens"] > 0
    assert [x["index"] for x in r["results"]] == best_first
    assert all(abs(x["relevance_score"] - scores[x["index"]]) < 1e-6 for x in r["results"])
    assert all(x["document"] == {"text": DOCS[x["index"]]} for x in r["results"])
    # Cohere's document objects, top_n, no documents back; /v2 and the unversioned path alike
    for path in ("/v2/rerank", "/rerank"):
        body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False}
        top = http.post(path, json=body).json()["results"]
        assert [x["index"] for x in top] == best_first[:2] and all("document" not in x for x in top)


def test_pooling_returns_the_embeddings(client, http):
    want = _embeddings(client, DOCS[:2])
    r = http.post("/pooling", json={"model": MODEL, "input": DOCS[:2]}).json()
    assert r["object"] == "list" and [(d["index"], d["object"]) for d in r["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, w in zip(r["data"], want, strict=True):
        assert max(abs(a - b) for a, b in zip(d["data"], w, strict=True)) < 1e-5
    raw = http.post("/pooling", json={"input": DOCS[0], "encoding_format": "base64"}).json()["data"][0]["data"]
    floats = struct.unpack(f"<{len(want[0])}f", base64.b64decode(raw))
    assert max(abs(a - b) for a, b in zip(floats, want[0], strict=True)) < 1e-5
    mean = client.embeddings.create(model=MODEL, input=DOCS[0], extra_body={"pooling": "mean"}).data[0].embedding
    got = http.post("/pooling", json={"input": DOCS[0], "pooling": "mean"}).json()["data"][0]["data"]
    assert max(abs(a - b) for a, b in zip(got, mean, strict=True)) < 1e-5


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"text": "a", "title": "b"}]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["text"]}, "rank_fields"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "foo": 1}, "foo"),
        ("/pooling", {"input": "hi", "dimensions": 8}, "dimensions"),
        ("/pooling", {"input": "hi", "pooling": "max"}, "pooling"),
    ],
)
def test_bad_scoring_requests_are_400_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and error["type"] == "BadRequestError", r.text


def test_scoring_routes_need_the_api_key(server):
    for path in ("/score", "/v1/score", "/rerank", "/v2/rerank", "/pooling"):
        r = httpx.post(server.url + path, json={"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]})
        assert r.status_code == 401, path


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client):
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert "".join(lp.tokens) == PROMPT and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(lp.tokens)
    # the same prompt logprobs as echo with a token generated, without that token
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:-1] == lp.token_logprobs
    # streamed: the prompt, then an empty end
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True, temperature=0
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == PROMPT and chunks[-1].choices[0].finish_reason == "length"
    streamed = [v for c in chunks for v in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    # no echo: nothing to answer
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
