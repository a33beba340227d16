"""`tokenmill serve` with two settings of the real model, a router between them and the
exact response cache: what the command line promises, end to end."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import Server

KEYS = ("tenant-one", "tenant-two")


@pytest.fixture(scope="module")
def two_models():
    # small: the Q4_1 file as it is; large: the same weights dequantised to float32 (slower, the reference)
    s = Server(
        "--model",
        "small=default,kv_cache_memory=96MiB",
        "--model",
        "large=default,quantization=none",
        "--kv-cache-memory",
        "192MiB",
        "--dtype",
        "float32",
        "--router",
        "auto=small,large",
        "--router-threshold",
        "0.3",
        "--response-cache",
        "exact",
        "--api-key",
        KEYS[0],
        "--api-key",
        KEYS[1],
        one_model=False,
    )
    yield s
    s.stop()


def chat(server: Server, model: str, key: str = KEYS[0], **fields) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        **fields,
    }
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r


def tokens(r: httpx.Response) -> list[str]:
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_both_models_and_the_router_are_served_each_with_its_own_kv_pool(two_models):
    cards = httpx.get(two_models.url + "/v1/models", headers={"authorization": f"Bearer {KEYS[0]}"}).json()["data"]
    assert [c["id"] for c in cards] == ["small", "large", "auto"]
    # 96 MiB of float32 KV for small, the rest of the 192 MiB budget for large: their contexts differ
    assert cards[0]["max_model_len"] < cards[1]["max_model_len"]
    for model in ("small", "large"):
        assert chat(two_models, model, cache=False).json()["model"] == model
        assert two_models.metric("tokenmill:generation_tokens_total", model_name=model) > 0


def test_a_cache_hit_is_token_identical_to_a_fresh_greedy_answer(two_models):
    first = chat(two_models, "large", max_tokens=16)
    hit = chat(two_models, "large", max_tokens=16)
    fresh = chat(two_models, "large", max_tokens=16, cache=False)
    assert (first.headers["x-tokenmill-cache"], hit.headers["x-tokenmill-cache"]) == ("miss", "hit")
    assert fresh.headers["x-tokenmill-cache"] == "bypass"
    assert tokens(hit) == tokens(fresh) == tokens(first) and len(tokens(hit)) > 1
    assert (
        chat(two_models, "large", key=KEYS[1], max_tokens=16).headers["x-tokenmill-cache"] == "miss"
    )  # another tenant


def test_the_router_answers_with_the_model_it_names_and_counts_it(two_models):
    r = chat(two_models, "auto", cache=False)
    routed, reason = r.headers["x-tokenmill-route"], r.headers["x-tokenmill-route-reason"]
    confidence = float(r.headers["x-tokenmill-route-confidence"])
    assert (routed, reason) == (("small", "confident") if confidence >= 0.3 else ("large", "low_confidence"))
    direct = chat(two_models, routed, cache=False)
    assert r.json()["model"] == routed and tokens(r) == tokens(direct)
    assert two_models.metric("tokenmill:model_router_requests_total", router="auto", model_name=routed) == 1
