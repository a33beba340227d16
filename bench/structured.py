"""Structured output (issue 13): what the grammar costs, and what it buys.

    python bench/structured.py [--dtype auto] [--batches 1 8 32] [--extraction 32]

Measures, in one run, with the CPU recorded:
- grammar compile time for a typical extraction schema: llguidance's tokenizer built
  from ours (once per engine), the schema cold, and again (our LRU cache);
- mask overhead per step at batch 1, 8 and 32 with every request constrained to the
  extraction schema: the median decode-step time (steps where the whole batch runs)
  constrained vs free (the free requests ignore EOS; noisy on a shared machine, as
  the steps compared differ), and, measured inside the constrained steps, the time
  filling the masks (mask thread, overlapped with the forward), the runner's wait
  for them after the forward, and applying them to the logits;
- a JSON-extraction workload (short bios -> {name, age, city, occupation}), free vs
  constrained: throughput, and the share of outputs that parse and validate (the
  reason to constrain at all).
Writes bench/results/structured.json and bench/results/structured.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import jsonschema

import tokenmill.engine.core.grammar_masks as grammar_masks
import tokenmill.worker.model_runner as model_runner
from tokenmill import LLM, SamplingParams
from tokenmill.engine.model_input import GrammarMasks
from tokenmill.kernels.cpu import cpu_info
from tokenmill.structured.constraint import StructuredOutputs
from tokenmill.structured.grammar import GrammarCompiler

RESULTS = Path(__file__).parent / "results"
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "occupation", "skills"],
    "additionalProperties": False,
}
NAMES = [
    "Maria Lopez",
    "Kenji Sato",
    "Amara Okafor",
    "Lars Nilsson",
    "Priya Raman",
    "Tom Becker",
    "Ines Duarte",
    "Omar Haddad",
]
CITIES = ["Lisbon", "Osaka", "Lagos", "Uppsala", "Chennai", "Leipzig", "Porto", "Beirut"]
JOBS = ["nurse", "carpenter", "data analyst", "teacher", "chef", "pilot", "architect", "pharmacist"]
SKILLS = ["welding", "Python", "French", "first aid", "accounting", "baking", "sailing", "drawing"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timers:
    """Wall time of the mask fill (mask thread), of the runner's wait for it after the
    forward (the part of the fill not hidden behind the forward), and of applying the
    masks to the logits (runner)."""

    def __init__(self) -> None:
        self.fill: list[float] = []
        self.wait: list[float] = []
        self.apply: list[float] = []
        fill, apply, get = grammar_masks._fill_masks, model_runner.apply_grammar_bias, GrammarMasks.get

        def timed_get(masks):
            t0 = time.perf_counter()
            try:
                return get(masks)
            finally:
                self.wait.append(time.perf_counter() - t0)

        def timed_fill(*args):
            t0 = time.perf_counter()
            try:
                return fill(*args)
            finally:
                self.fill.append(time.perf_counter() - t0)

        def timed_apply(*args):
            t0 = time.perf_counter()
            apply(*args)
            self.apply.append(time.perf_counter() - t0)

        grammar_masks._fill_masks = timed_fill
        model_runner.apply_grammar_bias = timed_apply
        GrammarMasks.get = timed_get

    def reset(self) -> None:
        self.fill.clear()
        self.wait.clear()
        self.apply.clear()


def bio(rng: random.Random) -> str:
    name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
    skills = ", ".join(rng.sample(SKILLS, 2))
    return (
        f"{name} is {rng.randint(21, 70)} years old and works as a {job} in {city}. "
        f"In their spare time they practise {skills}."
    )


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]), False)


def compile_times(llm: LLM) -> dict:
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    t0 = time.perf_counter()
    _ = compiler.lltokenizer
    tokenizer_s = time.perf_counter() - t0
    spec = StructuredOutputs(json=EXTRACTION_SCHEMA)
    t0 = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - t0
    cached = []
    for _ in range(20):
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputs(json=EXTRACTION_SCHEMA))
        cached.append(time.perf_counter() - t0)
    return {"tokenizer_ms": tokenizer_s * 1e3, "cold_ms": cold * 1e3, "cached_ms": statistics.median(cached) * 1e3}


def decode_steps(llm: LLM, batch: int) -> list[float]:
    return [s.duration for s in llm.engine.core.step_stats if s.num_seqs == batch and s.num_prefill_tokens == 0]


def overhead(llm: LLM, timers: Timers, batch: int, tokens: int, rounds: int) -> dict:
    """Constrained and free runs of the same batch, alternated ``rounds`` times."""
    rng = random.Random(batch)
    prompts = [chat_ids(llm, f"Extract the person as JSON: {bio(rng)}") for _ in range(batch)]
    free_steps, con_steps, fill, wait, apply, con_tokens = [], [], [], [], [], []
    for r in range(rounds):
        for constrained in (False, True):
            llm.engine.core.step_stats.clear()
            timers.reset()
            # free: exactly `tokens` tokens; constrained: the extraction schema (steps with the
            # whole batch still running are compared: same batch, similar context)
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=r * 1000 + i,
                    max_tokens=tokens if not constrained else 160,
                    ignore_eos=not constrained,
                    structured={"json": EXTRACTION_SCHEMA} if constrained else None,
                )
                for i in range(batch)
            ]
            outs = llm.generate(prompts, params)
            steps = decode_steps(llm, batch)
            if constrained:
                con_steps += steps
                fill += timers.fill
                wait += timers.wait
                apply += timers.apply
                con_tokens += [len(o.outputs[0].token_ids) for o in outs]
            else:
                free_steps += steps
    free, con = statistics.median(free_steps), statistics.median(con_steps)
    res = {
        "batch": batch,
        "free_step_ms": free * 1e3,
        "constrained_step_ms": con * 1e3,
        "overhead_pct": (con / free - 1) * 100,
        "mask_fill_ms": statistics.median(fill) * 1e3,
        "mask_apply_ms": statistics.median(apply) * 1e3,
        "mask_wait_ms": statistics.median(wait) * 1e3,
        "mask_fill_pct_of_step": statistics.median(fill) / free * 100,
        # on the step's critical path: the wait for the fill after the forward, and the apply
        "critical_path_pct_of_step": (statistics.median(wait) + statistics.median(apply)) / free * 100,
        "steps": [len(free_steps), len(con_steps)],
        "constrained_tokens_mean": statistics.mean(con_tokens),
    }
    log(
        f"  batch {batch}: free {res['free_step_ms']:.1f} ms, constrained {res['constrained_step_ms']:.1f} ms "
        f"({res['overhead_pct']:+.1f}%), fill {res['mask_fill_ms']:.2f} ms, wait {res['mask_wait_ms']:.2f} ms, "
        f"apply {res['mask_apply_ms']:.2f} ms"
    )
    return res


def extraction(llm: LLM, n: int) -> dict:
    rng = random.Random(0)
    prompts = [
        chat_ids(
            llm,
            "Extract the person in this text as a JSON object with the keys name, age, city, "
            f"occupation and skills (a list):\n{bio(rng)}",
        )
        for _ in range(n)
    ]
    out: dict = {"requests": n}
    for label, structured in (("free", None), ("constrained", {"json": EXTRACTION_SCHEMA})):
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=160, structured=structured) for i in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        texts = [o.outputs[0].text for o in outs]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[label] = {
            "seconds": elapsed,
            "requests_per_s": n / elapsed,
            "output_tok_per_s": tokens / elapsed,
            "valid_json": sum(_parses(t) for t in texts) / n,
            "valid_json_after_stripping_fences": sum(_parses(_strip_fences(t)) for t in texts) / n,
            "valid_schema": sum(_validates(_strip_fences(t)) for t in texts) / n,
            "example": texts[0],
        }
        log(
            f"  extraction {label}: {n / elapsed:.2f} req/s, {tokens / elapsed:.1f} tok/s, "
            f"valid JSON {out[label]['valid_json']:.0%}, valid schema {out[label]['valid_schema']:.0%}"
        )
    return out


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), EXTRACTION_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _strip_fences(text: str) -> str:
    """The JSON inside a ```json fence, as a lenient client would dig it out."""
    if "```" in text:
        parts = text.split("```")
        if len(parts) >= 3:
            body = parts[1]
            return body[4:] if body.startswith("json") else body
    return text.strip()


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = res["overhead"]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["free_step_ms"] for r in rows], 0.4, label="free")
    a.bar([i + 0.2 for i in x], [r["constrained_step_ms"] for r in rows], 0.4, label="every request constrained")
    for i, r in enumerate(rows):
        a.text(
            i + 0.2,
            r["constrained_step_ms"],
            f"{r['overhead_pct']:+.1f}%\nmasks {r['mask_fill_pct_of_step']:.1f}%",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    a.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    a.set_ylabel("median decode step (ms)")
    a.set_title("Grammar mask overhead per step")
    a.legend()
    ex = res["extraction"]
    labels = ["valid JSON", "valid JSON\n(fences stripped)", "matches schema"]
    keys = ["valid_json", "valid_json_after_stripping_fences", "valid_schema"]
    b.bar([i - 0.2 for i in range(3)], [ex["free"][k] * 100 for k in keys], 0.4, label="free")
    b.bar([i + 0.2 for i in range(3)], [ex["constrained"][k] * 100 for k in keys], 0.4, label="constrained")
    b.set_xticks(range(3), labels)
    b.set_ylabel(f"% of {ex['requests']} outputs")
    b.set_title("JSON extraction: outputs a program can use")
    b.legend(loc="center left")
    fig.suptitle(f"CPU: {cpu_info().describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request in the overhead runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extraction", type=int, default=32, help="requests in the extraction workload")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / "structured.json").read_text()), RESULTS / "structured.png")
        return
    log(f"CPU: {cpu_info().describe()}")
    llm = LLM(dtype=args.dtype, progress=True, max_num_seqs=max(args.batches + [args.extraction]))
    timers = Timers()
    res: dict = {"cpu": cpu_info().as_dict(), "dtype": str(llm.dtype), "command": " ".join(sys.argv)}
    log("compile times")
    res["compile"] = compile_times(llm)
    log(f"  {res['compile']}")
    llm.generate(chat_ids(llm, "warm up"), SamplingParams(max_tokens=8, structured={"json": EXTRACTION_SCHEMA}))
    log("mask overhead per step")
    res["overhead"] = [overhead(llm, timers, b, args.tokens, args.rounds) for b in args.batches]
    log("JSON extraction")
    res["extraction"] = extraction(llm, args.extraction)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "structured.png")
    log(f"wrote {RESULTS / 'structured.json'} and structured.png")


if __name__ == "__main__":
    main()
