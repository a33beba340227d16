"""Grammars compiled with llguidance, cached by content, and one matcher per sequence.

Why llguidance (measured against xgrammar on our tokenizer: bench/RESULTS.md,
"Structured output"): one abi3 wheel with no dependencies (xgrammar pulls in
transformers, triton and a torch of its own choosing), grammars that compile
lazily in well under a millisecond for typical schemas, a per-token mask in tens of
microseconds, and ``rollback`` for speculative decoding.

The tokenizer llguidance needs is built from ours (``tokenizers.Tokenizer.to_str``),
its vocabulary as wide as the logits (rows past the tokenizer's vocabulary are never
allowed), and every token that ends generation counted as end-of-sequence: the
grammar allows them once it is in an accepting state.

Compiling (``GrammarCompiler.compile``) is thread-safe and is meant to run off the
engine's step loop (the engine's fronts compile on a thread of their own before
queueing a request); an invalid or unsupported schema, regex or grammar raises
``InvalidRequestError`` naming the problem, and so does one that cannot be enforced:
over ``max_grammar_bytes``, or past the matcher's limits (an Earley row or a lexer
that explodes: a schema with hundreds of optional properties, ``a{1000000}``, a rule
that never ends). Those limits are llguidance's, and they are found by walking a few
tokens into the grammar at compile time (``_probe``), not by a user's request halfway
through its answer. A compiled grammar is a pristine matcher that each sequence copies.

A spec with ``reasoning_end`` (a reasoning model's ``</think>``) compiles to its grammar
behind a free prefix (``after_reasoning``): the thinking is not constrained, what
follows it is; the checks above run from where the constraint begins.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.configuration.config import StructuredConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (LRU) ...
# ... and at most this much spec text among them: a compiled matcher takes ~90x its
# spec's size (4 MB for a 45 KB schema of 1,500 properties), so a cache bounded by
# count alone grew by hundreds of MB under distinct big schemas (bench/soak.py).
DEFAULT_CACHE_BYTES = 1 << 20
# Between JSON tokens: one space after ',' and ':' (what json.dumps writes and models
# mostly saw), and no free whitespace, which a small model at temperature 1 can
# otherwise repeat until max_tokens. ``whitespace_pattern`` overrides it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The compile-time probe: from the first mask, this many allowed tokens (spread over the
# vocabulary), each followed this many tokens deep.
PROBE_TOKENS, PROBE_DEPTH = 4, 4


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit i of word w: token 32*w + i)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One sequence's position in its grammar (an ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, tokens: Iterable[int]) -> bool:
        """Advance past sampled tokens; False (and an error state) if one is not allowed."""
        return bool(self._m.consume_tokens(list(tokens)))

    def num_valid(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows from here (drafts to keep)."""
        return int(self._m.validate_tokens(tokens)) if tokens else 0

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words)."""
        target = bitmask[row]
        assert target.flags["C_CONTIGUOUS"] and target.dtype == np.int32
        self._m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more but end-of-sequence."""
        return bool(self._m.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher stopped, in one short line (None while it has not)."""
        if not self._m.is_error():
            return None
        lines = self._m.get_error().replace("<non-verbose/>", "").strip().splitlines()
        return lines[0][:200] if lines else "a token the grammar does not allow"


@dataclass
class CompiledGrammar:
    template: Any  # a pristine LLMatcher: sequences get deep copies

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy())


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0  # spent compiling (misses)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; an LRU cache by content."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        config: StructuredConfig | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width
        self.config = config or StructuredConfig()
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes  # of spec text (what a compiled grammar's memory grows with)
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()
        self.stats = CompileStats()

    @property
    def lltokenizer(self) -> Any:
        """llguidance's view of our tokenizer, built on first use (about 0.3 s)."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = build_lltokenizer(self._tokenizer, self.vocab_size)
            return self._lltokenizer

    def check_size(self, spec: StructuredOutputs) -> None:
        """400 for a spec over ``max_grammar_bytes`` (before any work on it)."""
        limit = self.config.max_grammar_bytes
        if spec.size_bytes > limit:
            raise InvalidRequestError(
                f"structured output {spec.kind} is {spec.size_bytes} bytes, over the server's "
                f"limit of {limit} (--max-grammar-bytes)",
                param=spec.kind,
            )

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
            return hit

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        self.check_size(spec)
        hit = self.cached(spec)
        if hit is not None:
            return hit
        lltok = self.lltokenizer
        t0 = time.perf_counter()
        compiled = CompiledGrammar(_build_matcher(spec, lltok, self.vocab_size, self._reasoning_end_id(spec)))
        with self._lock:
            self.stats.misses += 1
            self.stats.seconds += time.perf_counter() - t0
            if spec not in self._cache:
                self._cache[spec] = compiled
                self._cached_bytes += spec.size_bytes
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes
            ):
                evicted, _ = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.size_bytes
        return compiled

    def _reasoning_end_id(self, spec: StructuredOutputs) -> int | None:
        """The token id of ``spec.reasoning_end`` (None: the constraint starts at once)."""
        if spec.reasoning_end is None:
            return None
        found = self._tokenizer.backend.token_to_id(spec.reasoning_end)
        if found is None:
            raise InvalidRequestError(
                f"structured output after reasoning: {spec.reasoning_end!r} is not a token of this vocabulary",
                param=spec.kind,
            )
        return found

    @property
    def cached_bytes(self) -> int:
        """Spec text held by the cache (bounded by ``cache_bytes``, but for one entry)."""
        return self._cached_bytes


def build_lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    import llguidance

    backend = tokenizer.backend
    stop = sorted(set(tokenizer.stop_token_ids) | ({tokenizer.eos_token_id} - {None}))
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=stop or None)


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a spec (not yet checked)."""
    from llguidance import LLMatcher, grammar_from

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            options = dict(JSON_OPTIONS)
            if spec.whitespace_pattern is not None:
                options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
            return LLMatcher.grammar_from_json_schema(spec.schema, defaults=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":  # one lexeme (a DFA over all the choices), not a parser row per choice
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return f"start: CHOICE\nCHOICE: {literals}\n"
        return grammar_from("grammar", spec.grammar)  # Lark, or GBNF/EBNF converted to Lark
    except Exception as e:
        raise InvalidRequestError(f"invalid structured output {kind}: {e}", param=kind) from e


def after_reasoning(grammar: str, end_id: int) -> str:
    """``grammar`` (llguidance's JSON or Lark text) with a free prefix: any tokens but
    ``end_id``, then ``end_id``, then ``grammar`` (a reasoning model's thinking, which
    the constraint must not touch: server/jobs/reasoning.py). Token-level, as the thinking may
    hold special tokens; the model may also end there (end-of-sequence is allowed
    throughout the thinking, as vLLM leaves it unconstrained)."""
    try:
        inner = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        inner = [{"lark_grammar": grammar}]  # Lark text
    first = {k: v for k, v in inner[0].items() if v is not None}
    name = first.setdefault("name", "constraint")
    prefix = {"lark_grammar": f"start: <[^{end_id}]>* <[{end_id}]> @{name}\n"}
    return json.dumps({"grammars": [prefix, first, *inner[1:]]})


def parser_limits() -> Any:
    """llguidance's default limits, with errors that name the problem and not the whole
    grammar (which can be hundreds of KB, and is the user's)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def _build_matcher(spec: StructuredOutputs, lltok: Any, vocab_size: int, reasoning_end: int | None = None) -> Any:
    from llguidance import LLMatcher

    kind = spec.kind
    grammar = grammar_text(spec)
    if reasoning_end is not None:
        grammar = after_reasoning(grammar, reasoning_end)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=parser_limits())
    if is_error:
        raise InvalidRequestError(f"invalid structured output {kind}: {_first_line(messages)}", param=kind)
    matcher = LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidRequestError(f"invalid structured output {kind}: {_first_line([matcher.get_error()])}", param=kind)
    start = matcher  # where the constraint begins (after the reasoning, if it has a free prefix)
    if reasoning_end is not None:
        start = matcher.deep_copy()
        start.consume_tokens([reasoning_end])
    mask = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    GrammarMatcher(start).fill_bitmask(mask, 0)
    if start.is_error() or not mask.any():  # a dead end before the first token: no text matches
        raise InvalidRequestError(f"invalid structured output {kind}: it matches no text", param=kind)
    error = _probe(start, mask)
    if error is not None:
        raise InvalidRequestError(
            f"structured output {kind} cannot be enforced: it exceeds the grammar matcher's "
            f"limits ({_first_line([error])}); simplify it",
            param=kind,
        )
    return matcher


def _probe(matcher: Any, first_mask: np.ndarray) -> str | None:
    """Walk a few tokens into the grammar, on copies of its matcher; the matcher's error
    if one of them hits a limit. Grammars whose Earley rows or lexer states explode do
    so within the first tokens (700 optional properties: at ``{``), so a user is told
    before queueing instead of getting a cut-off answer. The path is the allowed tokens
    spread evenly over the vocabulary, then the middle allowed one at each step."""
    allowed = _allowed(first_mask)
    picks = allowed[np.linspace(0, len(allowed) - 1, min(PROBE_TOKENS, len(allowed))).astype(np.int64)]
    mask = np.zeros_like(first_mask)
    for token in picks:
        m = GrammarMatcher(matcher.deep_copy())
        for _ in range(PROBE_DEPTH):
            if not m.accept([int(token)]) or m.is_terminated:
                break
            m.fill_bitmask(mask, 0)
            if m.error is not None:
                break
            following = _allowed(mask)
            if not len(following):
                break
            token = following[len(following) // 2]
        if m.error is not None:
            return m.error
    return None


def _allowed(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))


def _first_line(messages: list[str]) -> str:
    text = messages[0] if messages else "invalid grammar"
    return text.strip().splitlines()[0] if text.strip() else text
