"""Prefill (and decode) of one model under settings given as environment variables, A/B in one
process: each setting its own LLM, loaded and called with its variables set (those read at
load, like TOKENMILL_BLOCK_GEMM_ROWS, and those read at each call, like TOKENMILL_AMX), the
settings alternating round by round so that a slow patch of a shared machine falls on all.

    .venv/bin/python bench/prefill_ab.py --gguf FILE \\
        --setting "int8 tiles=TOKENMILL_BLOCK_GEMM_ROWS=never" \\
        --setting "zmm=TOKENMILL_BLOCK_GEMM_ROWS=never,TOKENMILL_AMX=0" --setting "measured choice=" [--rounds 5]

A round: a --prompt-tokens prompt prefilled (prefix caching off, one output token), then
--decode-tokens greedy tokens at batch 1. Prints each round and the medians; writes
bench/results/prefill_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info


@contextmanager
def environment(pairs: dict[str, str]):
    old = {k: os.environ.get(k) for k in pairs}
    os.environ.update(pairs)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    name, _, env = text.partition("=")
    pairs = dict(p.split("=", 1) for p in env.split(",") if p)
    return name, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--setting", action="append", required=True, help="NAME=VAR=VALUE[,VAR=VALUE]")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_ab.json")
    args = ap.parse_args()
    settings = [parse_setting(s) for s in args.setting]
    llms = {}
    for name, env in settings:
        with environment(env):
            llms[name] = LLM(args.gguf, enable_prefix_caching=False, progress=False, kv_cache_memory="256MiB")
    tokenizer = next(iter(llms.values())).tokenizer
    text = (Path(__file__).parent / "prompt.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = (ids * (1 + args.prompt_tokens // len(ids)))[: args.prompt_tokens]
    one = SamplingParams(max_tokens=1, temperature=0)
    many = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    runs: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name, _ in settings}
    for rnd in range(args.rounds + 1):  # round 0 warms each setting (its first-call costs)
        order = settings if rnd % 2 == 0 else list(reversed(settings))
        for name, env in order:
            with environment(env):
                llm = llms[name]
                start = time.perf_counter()
                llm.generate([prompt], one)
                prefill = args.prompt_tokens / (time.perf_counter() - start)
                start = time.perf_counter()
                llm.generate([prompt[:8]], many)
                decode = args.decode_tokens / (time.perf_counter() - start)
            if rnd:
                runs[name]["prefill"].append(prefill)
                runs[name]["decode"].append(decode)
                print(f"round {rnd} {name}: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s", flush=True)
    summary = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}
    print(cpu_info().describe())
    for name, s in summary.items():
        print(f"{name}: prefill {s['prefill']:.0f} tok/s, decode {s['decode']:.1f} tok/s (medians of {args.rounds})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"cpu": cpu_info().as_dict(), "gguf": args.gguf, "runs": runs, "medians": summary}, indent=1)
    )


if __name__ == "__main__":
    main()
