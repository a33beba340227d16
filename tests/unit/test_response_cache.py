"""The response cache's bookkeeping: keys, what may be cached, TTL, the byte cap, nearest look-alikes."""

from __future__ import annotations

import pytest

from tokenmill.configuration.args import model_specs
from tokenmill.errors import TokenmillError
from tokenmill.server.gateway.response_cache import (
    BUCKET_LIMIT,
    CachedAnswer,
    ResponseCache,
    best_match,
    bucket_key,
    reproducible,
    request_key,
    semantic_text,
)

BODY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(size: int = 0, embedding=None, bucket=None) -> CachedAnswer:
    return CachedAnswer([(0, "x" * size)], "m", None, embedding=embedding, bucket=bucket)  # type: ignore[list-item]


def test_keys_hold_everything_but_how_the_answer_is_sent():
    key = request_key("t", "/v1/chat/completions", "m", BODY)
    assert request_key("t", "/v1/chat/completions", "m", {**BODY, "stream": True, "cache": True}) == key
    for other in (
        request_key("u", "/v1/chat/completions", "m", BODY),
        request_key("t", "/v1/completions", "m", BODY),
        request_key("t", "/v1/chat/completions", "m2", BODY),
        request_key("t", "/v1/chat/completions", "m", {**BODY, "max_tokens": 9}),
    ):
        assert other != key
    # a bucket leaves out the last user message's text, and only that
    other_text = {**BODY, "messages": [{"role": "user", "content": "hello"}]}
    assert bucket_key("t", "e", "m", BODY) == bucket_key("t", "e", "m", other_text)
    assert bucket_key("t", "e", "m", BODY) != bucket_key("t", "e", "m", {**other_text, "max_tokens": 9})


def test_what_is_reproducible_and_what_a_look_alike_may_answer():
    assert reproducible({"temperature": 0}) and reproducible({"temperature": 1.0, "seed": 3})
    assert not reproducible({"temperature": None}) and not reproducible({"temperature": 0.7})
    assert semantic_text(BODY) == "hi"
    tool = {"type": "function", "function": {"name": "f"}}
    for change in (
        {"temperature": 0.5, "seed": 1},
        {"tools": [tool]},
        {"response_format": {"type": "json_object"}},
        {"guided_choice": ["a"]},
        {"logprobs": True},
        {"echo": True},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    ):
        assert semantic_text({**BODY, **change}) is None, change
    assert semantic_text({**BODY, "response_format": {"type": "text"}}) == "hi"


def test_entries_expire_after_the_ttl():
    clock = Clock()
    cache = ResponseCache(False, 1 << 20, ttl=10, threshold=0.9, clock=clock)
    cache.put("k", entry())
    clock.now = 9.9
    assert cache.get("k") is not None
    clock.now = 10.0
    assert cache.get("k") is None and cache.stats.expirations == 1 and cache.bytes == 0


def test_the_byte_cap_drops_the_least_recently_used():
    cache = ResponseCache(False, 3000, ttl=100, threshold=0.9)
    for k in "abc":
        cache.put(k, entry(800))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", entry(800))
    assert [k for k in "abcd" if cache.get(k) is not None] == ["a", "c", "d"]
    assert cache.stats.evictions == 1 and cache.bytes <= 3000
    cache.put("huge", entry(5000))  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get("huge") is None and cache.stats.evictions == 1


def test_the_best_match_is_the_most_similar_at_or_above_the_threshold_in_its_bucket():
    cache = ResponseCache(True, 1 << 20, ttl=100, threshold=0.9)
    cache.put("x", entry(embedding=[1.0, 0.0], bucket="b"))
    cache.put("y", entry(embedding=[0.8, 0.6], bucket="b"))
    key, sim = best_match(cache.candidates("b"), [0.95, 0.31], cache.threshold)
    assert key == "x" and sim == pytest.approx(0.95 / (0.95**2 + 0.31**2) ** 0.5)
    assert best_match(cache.candidates("b"), [0.0, 1.0], cache.threshold) is None  # below the threshold
    assert cache.candidates("other") == []  # another bucket
    assert best_match([("z", [1.0, 0.0, 0.0])], [1.0, 0.0], 0.5) is None  # another model's width: never compared
    for k in [f"k{i}" for i in range(BUCKET_LIMIT + 10)]:
        cache.put(k, entry(embedding=[0.0, 1.0], bucket="b"))
    assert len(cache.candidates("b")) == BUCKET_LIMIT  # the oldest leave the index...
    assert cache.get("x") is not None  # ...but still answer their exact twins
    for k in list(cache.entries):
        cache._drop(k)
    assert cache.buckets == {}


def test_several_models_are_named_and_take_their_own_options():
    specs = model_specs(["small=default,kv_cache_memory=128MiB", "large=/m/x.gguf,dtype=float32,max_model_len=512"])
    assert [(s.name, s.path) for s in specs] == [("small", None), ("large", "/m/x.gguf")]
    assert specs[1].options == {"dtype": "float32", "max_model_len": 512}
    assert model_specs(["/m/a=b.gguf"])[0].name is None  # one path, as ever
    for bad, words in (
        (["a=x", "/m/y.gguf"], "NAME=PATH"),
        (["a=x", "a=y"], "twice"),
        (["a=x,nope=1", "b=y"], "engine option"),
        (["a=x,max_model_len=big", "b=y"], "not a int"),
    ):
        with pytest.raises(TokenmillError, match=words):
            model_specs(bad)
