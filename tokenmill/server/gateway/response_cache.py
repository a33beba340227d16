"""The response cache: answers kept in memory and served again for the same request.

**Exact** (``--response-cache exact``): the key is a digest of the tenant (a digest of
the API key presented), the route, the model (its adapter, and the generation of its
adapters) and the request's every field but ``stream``, ``stream_options`` and
``cache``; so a changed model, sampling field, message or key is a different entry.
Only reproducible answers are kept: temperature 0 or a fixed seed, every choice ended
by a stop or its length, no message marked ``private``.

**Semantic** (``--response-cache semantic``, opt-in): a greedy chat whose every field
but the last user message's text equals a cached one's (the same *bucket*, within one
tenant) is answered with that one's answer when the two last user messages' embeddings
(the model's own, mean-pooled) are at least ``threshold`` alike (cosine). Never for
requests with tools, a constrained output, logprobs, temperature above 0 or a private
message: those are bypassed (bench/RESULTS.md has the false-hit rate that chose the
threshold).

Entries expire after a TTL; past the byte cap the least recently used go first.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.engine.outputs import CompletionOutput, RequestOutput, RequestTimings, TopLogprobs


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# Look-alikes compared per semantic lookup, at most: the bucket's most recent entries (a
# lookup is this many cosines, off the event loop; a chat app with one system prompt
# would otherwise put every answer it ever cached in one bucket).
BUCKET_LIMIT = 256

KEY_EXCLUDES = frozenset({"stream", "stream_options", "cache"})  # how an answer is sent, not what it is


def request_key(tenant: str, endpoint: str, identity: str, body: dict[str, Any]) -> str:
    """The exact key: everything the answer depends on."""
    return digest(tenant, endpoint, identity, {k: v for k, v in body.items() if k not in KEY_EXCLUDES})


def reproducible(body: dict[str, Any]) -> bool:
    """Whether the request's answer is the same every time: greedy, or seeded."""
    return body.get("temperature") == 0 or body.get("seed") is not None


def semantic_text(body: dict[str, Any]) -> str | None:
    """The last user message's text, when the request may be answered by a look-alike
    (greedy chat, no tools, no constrained output, no logprobs, nothing private), else None."""
    messages = body.get("messages")
    if not messages or messages[-1].get("role") != "user" or body.get("temperature") != 0:
        return None
    if body.get("tools") or body.get("logprobs") or body.get("echo") or body.get("prompt_logprobs") is not None:
        return None
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
        body.get(k) for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    ):
        return None
    content = messages[-1].get("content")
    return content if isinstance(content, str) and content.strip() else None


def bucket_key(tenant: str, endpoint: str, identity: str, body: dict[str, Any]) -> str:
    """The semantic bucket: the exact key with the last user message's text left out."""
    messages = [*body["messages"][:-1], {**body["messages"][-1], "content": None}]
    return request_key(tenant, endpoint, identity, {**body, "messages": messages})


@dataclass
class _Frozen:
    """A finished sequence's record, detached from the engine's output processor."""

    token_ids: list[int]
    logprobs: list[float | None] | None
    top_logprobs: list[TopLogprobs] | None
    text: str

    def text_prefix(self, num_chars: int) -> str:
        return self.text[:num_chars]


def detach(out: RequestOutput) -> RequestOutput:
    """A finished output as plain data, whole in its delta (a replay streams it as one
    chunk), holding nothing of the engine's."""
    c = out.outputs[0]
    frozen = _Frozen(
        list(c.token_ids), c.logprobs and list(c.logprobs), c.top_logprobs and list(c.top_logprobs), c.text
    )
    completion = CompletionOutput(
        c.index, c.finish_reason, c.stop_reason, frozen, len(frozen.token_ids), len(frozen.text)
    )
    return replace(
        out,
        outputs=[completion],
        timings=list(out.timings),
        delta_text=frozen.text,
        delta_token_ids=frozen.token_ids,
        delta_logprobs=frozen.logprobs,
        delta_top_logprobs=frozen.top_logprobs,
        embedding=None,
    )


def replayed(out: RequestOutput) -> RequestOutput:
    """A cached output as a new answer's: its timings are now's (it took no engine time)."""
    t = time.perf_counter()
    return replace(
        out, timings=[RequestTimings(arrival=t, first_scheduled=t, first_token=t, token_times=[t], finished=t)]
    )


@dataclass
class CachedAnswer:
    outputs: list[tuple[int, RequestOutput]]  # (prompt index, a finished sequence), detached
    model: str  # the served model that answered
    lora: str | None
    route: Any = None  # a router's Route, replayed in the headers
    embedding: list[float] | None = None  # semantic entries: the last user message's
    nbytes: int = 0
    expires: float = 0.0
    bucket: str | None = None


@dataclass
class CacheStats:
    hits: dict[str, int] = field(default_factory=lambda: {"exact": 0, "semantic": 0})
    misses: int = 0
    evictions: int = 0
    expirations: int = 0


class ResponseCache:
    def __init__(
        self, semantic: bool, max_bytes: int, ttl: float, threshold: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.semantic, self.max_bytes, self.ttl, self.threshold, self.clock = semantic, max_bytes, ttl, threshold, clock
        self.entries: OrderedDict[str, CachedAnswer] = OrderedDict()  # least recently used first
        self.pending: dict[str, Any] = {}  # key -> an asyncio.Future, done once the request answering it has ended
        self.buckets: dict[str, dict[str, None]] = {}  # bucket -> its entries' keys (semantic), in order
        self.bytes = 0
        self.stats = CacheStats()

    def get(self, key: str) -> CachedAnswer | None:
        entry = self.entries.get(key)
        if entry is not None and entry.expires <= self.clock():
            self._drop(key)
            self.stats.expirations += 1
            entry = None
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def candidates(self, bucket: str) -> list[tuple[str, list[float]]]:
        """The bucket's live entries' keys and embeddings (compared off the event loop:
        ``best_match``; the entry is then fetched with ``get``, which may find it gone)."""
        out = []
        for key in list(self.buckets.get(bucket, ())):
            entry = self.get(key)
            if entry is not None and entry.embedding is not None:
                out.append((key, entry.embedding))
        return out

    def hit(self, kind: str) -> None:
        self.stats.hits[kind] += 1

    def miss(self) -> None:
        self.stats.misses += 1

    def put(self, key: str, entry: CachedAnswer) -> bool:
        """Keep an answer (False: larger than the whole cache, not kept)."""
        entry.nbytes = len(pickle.dumps((key, entry.outputs, entry.embedding), protocol=pickle.HIGHEST_PROTOCOL))
        if entry.nbytes > self.max_bytes:
            return False
        if key in self.entries:
            self._drop(key)
        entry.expires = self.clock() + self.ttl
        self.entries[key] = entry
        self.bytes += entry.nbytes
        if entry.bucket is not None:
            bucket = self.buckets.setdefault(entry.bucket, {})
            bucket[key] = None
            if len(bucket) > BUCKET_LIMIT:  # the oldest leave the semantic index (they still answer exact twins)
                bucket.pop(next(iter(bucket)))
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        return True

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key)
        self.bytes -= entry.nbytes
        if entry.bucket is not None:
            keys = self.buckets.get(entry.bucket, {})
            keys.pop(key, None)
            if not keys:
                self.buckets.pop(entry.bucket, None)


def best_match(
    candidates: list[tuple[str, list[float]]], embedding: list[float], threshold: float
) -> tuple[str, float] | None:
    """The most similar candidate at or above ``threshold`` (cosine), with its similarity."""
    best = None
    for key, other in candidates:
        if len(other) != len(embedding):
            continue
        sim = cosine(other, embedding)
        if sim >= threshold and (best is None or sim > best[1]):
            best = (key, sim)
    return best


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm else 0.0
