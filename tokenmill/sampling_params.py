"""SamplingParams: per-request generation controls, validated on construction.

Free of torch so that the engine (which imports no torch) can hold and inspect it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 256  # sequences per request: each holds KV blocks and a slot in every step
MAX_INT32 = 2**31 - 1  # integers that end up in tensors (top-k, token ids) must fit
KV_EVICTION_POLICIES = ("streaming", "snapkv")
SNAPKV_OBSERVED = 32  # SnapKV: the prompt's last tokens whose attention chooses what else is kept
SNAPKV_POOL = 7  # SnapKV: scores max-pooled over this many neighbouring tokens (keeps phrases whole)


@dataclass(frozen=True)
class KVEviction:
    """Which of a request's tokens keep their K/V when it outgrows ``window`` (opt-in).

    ``streaming`` (StreamingLLM, Xiao et al. 2023): the first ``sinks`` tokens (the
    attention sinks, rounded up to whole KV blocks; llama.cpp's n_keep) and at least the
    last ``window`` tokens before each query keep their K/V; the blocks between go back to
    the pool. Positions are those within the cache, as the paper's: each drop re-rotates
    the kept recent keys (RoPE) to their new places, so no query ever sees a distance
    longer than its cache, and a request may generate (or read) past the model's context.
    Blocks are dropped a ``stride`` at a time (a quarter of the window, at least a block),
    so a query sees between ``window`` and ``window + stride`` recent tokens, and keys are
    re-rotated once a stride, not once a token.

    ``snapkv`` (SnapKV, Li et al. 2024): a prompt longer than ``window`` keeps the K/V of only
    ``window`` of its tokens once read: its last ``SNAPKV_OBSERVED`` tokens, and those the
    attention of these (summed over layers and heads, max-pooled over ``SNAPKV_POOL``
    neighbours) weighs most. One choice for every layer and head, not one per head as the
    paper's: a KV block holds every layer's and head's K/V of its tokens, so only a whole
    token can go back to the pool. Kept keys keep their positions (the paper's); what follows
    the prompt is kept whole, within the context as any request. ``sinks`` does not apply."""

    policy: str = "streaming"
    window: int = 1024  # recent tokens every query sees, at least
    sinks: int = 4  # first tokens kept whatever the length (whole blocks: rounded up)

    def __post_init__(self) -> None:
        if self.policy not in KV_EVICTION_POLICIES:
            raise InvalidRequestError(
                f"invalid kv_eviction policy {self.policy!r}: one of {', '.join(KV_EVICTION_POLICIES)}",
                param="kv_eviction",
            )
        for name, low in (("window", 1), ("sinks", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= MAX_INT32:
                raise InvalidRequestError(
                    f"invalid kv_eviction {name}={v!r}: must be an integer >= {low}", param="kv_eviction"
                )
        if self.policy == "snapkv" and self.window <= SNAPKV_OBSERVED:
            raise InvalidRequestError(
                f"invalid kv_eviction window={self.window!r}: snapkv keeps the prompt's last {SNAPKV_OBSERVED} "
                "tokens and more, so it must be larger",
                param="kv_eviction",
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEviction:
        unknown = set(d) - {"policy", "window", "sinks"}
        if unknown:
            raise InvalidRequestError(
                f"unknown kv_eviction field(s) {', '.join(sorted(unknown))}: policy, window, sinks",
                param="kv_eviction",
            )
        return cls(**d)

    def sink_tokens(self, block_size: int) -> int:
        return -(-self.sinks // block_size) * block_size

    def stride(self, block_size: int) -> int:
        return max(block_size, self.window // 4 // block_size * block_size)

    def budget(self, block_size: int) -> int:
        """The most tokens whose K/V a streaming request holds after a step (sinks, window, stride)."""
        return self.sink_tokens(block_size) + self.window + self.stride(block_size)

    @property
    def streams(self) -> bool:
        """StreamingLLM: positions within the cache, no end to the length."""
        return self.policy == "streaming"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls, named as in vLLM and the OpenAI API."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    # The prompt tokens' logprobs (the first has none), computed during prefill: None:
    # none; k: each token's, plus the top k. Such a request skips the prefix cache
    # (a cached position has no logits): it computes its whole prompt.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # The output must match this JSON schema, regex, choice or grammar (a dict of the
    # same keys is accepted: {"json": schema}, {"regex": "..."}, ...).
    structured: StructuredOutputs | None = None
    min_tokens: int = 0  # end-of-sequence and stop_token_ids held back until this many; stop strings until after
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit (a dict is
    # accepted; kept as sorted (id, bias) pairs)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    # vLLM's bad_words: never generated (the last token of a word is banned where the
    # output ends with the tokens before it); their token ids, with and without a
    # leading space, are filled in by ``with_bad_word_ids`` where a tokenizer is.
    bad_words: tuple[str, ...] = ()
    # vLLM's request priority: with --scheduling-policy priority, lower values are admitted
    # first and preempted last (ties: arrival order); refused unless that policy is on.
    priority: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The model's end-of-sequence ids, filled in by the engine (as vLLM's
    # all_stop_token_ids): what min_tokens holds back besides stop_token_ids.
    eos_token_ids: tuple[int, ...] = ()
    # Whom the request is for, opaque (the server's API-key digest or client address;
    # offline requests share ""): while several clients have prompt tokens to compute,
    # each gets a share of a step's token budget (engine/core/fairness.py).
    client: str = ""
    # vLLM's cache_salt: requests share prefix-cache blocks only with requests of the same salt
    # (a tenant's prompts cannot be probed by another's timing); None: the common cache.
    cache_salt: str | None = None
    # Past ``window`` tokens, the K/V of the tokens that matter least go back to the pool
    # (``KVEviction``; a dict of its fields is accepted); None: every token keeps its K/V.
    kv_eviction: KVEviction | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_eviction, dict):
            object.__setattr__(self, "kv_eviction", KVEviction.from_dict(self.kv_eviction))
        elif self.kv_eviction is not None and not isinstance(self.kv_eviction, KVEviction):
            raise InvalidRequestError("kv_eviction must be a KVEviction or a dict of its fields", param="kv_eviction")
        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", StructuredOutputs.from_dict(self.structured))
        elif self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise InvalidRequestError(
                "structured must be a StructuredOutputs or a dict of its fields", param="structured"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias") from None
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            raise InvalidRequestError("bad_words must be a list of strings", param="bad_words")
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid {param}={getattr(self, param)!r}: {why}", param=param)

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_INT32:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer below 2**31")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for p in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, p)) or not -2 <= getattr(self, p) <= 2:
                raise bad(p, "must be in [-2, 2]")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_INT32:
            raise bad("max_tokens", "must be an integer in [1, 2**31)")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - self.n):
            raise bad("seed", "must be an integer in [-2**63, 2**64 - n]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.allowed_token_ids is not None and self.structured is not None:  # their intersection may be empty
            raise bad("allowed_token_ids", "cannot be combined with structured output (the grammar says what may come)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be non-empty strings")
        if any(
            not w or any(not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in w) for w in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "must be non-empty lists of token ids")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids in [0, 2**31)")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or abs(self.priority) > MAX_INT32:
            raise bad("priority", "must be an integer in (-2**31, 2**31)")
        if not isinstance(self.client, str):
            raise bad("client", "must be a string")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "must be a non-empty string")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        for t, v in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_INT32:
                raise bad("logit_bias", f"keys must be token ids in [0, 2**31), not {t!r}")
            if not _finite(v) or not -100 <= v <= 100:
                raise bad("logit_bias", f"biases must be numbers in [-100, 100], not {v!r}")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids in [0, 2**31)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_logit_controls(self) -> bool:
        """min_tokens, logit_bias, allowed_token_ids or bad words: logits the sampler changes first."""
        return (
            self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    def with_bad_word_ids(self, tokenizer: Any) -> SamplingParams:
        """These parameters with ``bad_words`` tokenised as vLLM does: each word alone and
        after a space (when that is another token sequence of the same length)."""
        if not self.bad_words or self.bad_words_token_ids:
            return self
        ids: list[tuple[int, ...]] = []
        for word in self.bad_words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            ids += [plain] + ([spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        return replace(self, bad_words_token_ids=tuple(w for w in dict.fromkeys(ids) if w))

    def token_ids_named(self) -> list[int]:
        """Every token id these parameters name (checked against the vocabulary)."""
        return [
            *self.stop_token_ids,
            *(t for t, _ in self.logit_bias),
            *(self.allowed_token_ids or ()),
            *(t for w in self.bad_words_token_ids for t in w),
        ]

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
