"""What a prefix-cache hit costs from each tier (issue 62): the time to the first token of a
long prompt whose blocks are in the pool, only in the host-memory tier, only in the disk tier,
or nowhere (computed again), in one engine, rounds alternating:

    .venv/bin/python bench/kv_tiers.py [--model PATH] [--prompt-tokens 2000] [--rounds 3]

The pool is sized to hold one such prompt; another prompt as long evicts the first from it.
On a CPU the pool is host memory already (the host tier is for a GPU's pool): these figures
say what a hit pays against a recompute, not what a GPU's would. Writes results/kv_tiers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels.cpu import cpu_info  # noqa: E402
from tokenmill.model.layers.kv_cache import block_nbytes  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0)


def prompt(llm: LLM, seed: int, tokens: int) -> list[int]:
    text = (HERE / "prompt.txt").read_text()
    ids = llm.tokenizer.encode(f"Notes {seed}.\n" + text * (1 + tokens // 500))
    return ids[:tokens]


def timed(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens were prefix-cache hits."""
    stats = llm.engine.core.prefix_cache_stats
    hits = stats.hits
    t = time.perf_counter()
    llm.generate([ids], ONE)
    return time.perf_counter() - t, stats.hits - hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as disk:
        opts = {"model": args.model} if args.model else {}
        with LLM(progress=False, dtype=args.dtype, kv_cache_memory="64MiB", **opts) as probe:
            row = block_nbytes(probe.engine.core.runner.kv_caches)
        pool_bytes = row * (args.prompt_tokens // 16 + 4)  # one prompt's blocks and a few
        common = dict(progress=False, dtype=args.dtype, kv_cache_memory=pool_bytes, **opts)
        engines = {
            "host": LLM(kv_host_cache="1GiB", **common),
            "disk": LLM(kv_disk_cache=disk, **common),
            "none": LLM(**common),
        }
        cases: dict[str, list[float]] = {"pool hit": [], "host tier hit": [], "disk tier hit": [], "recomputed": []}
        hits: dict[str, int] = {}
        for r in range(args.rounds):
            for name, llm in engines.items():
                a, b = prompt(llm, 2 * r, args.prompt_tokens), prompt(llm, 2 * r + 1, args.prompt_tokens)
                timed(llm, a)  # computed, cached (and copied down)
                if name == "disk":
                    llm.engine.core.tiers.disk.flush()
                if name == "none":
                    dt, h = timed(llm, a)
                    cases["pool hit"].append(dt)
                    hits["pool hit"] = h
                timed(llm, b)  # evicts a from the pool
                dt, h = timed(llm, a)
                key = {"host": "host tier hit", "disk": "disk tier hit", "none": "recomputed"}[name]
                cases[key].append(dt)
                hits[key] = h
        for llm in engines.values():
            llm.close()
    rows = {k: {"ttft_s": statistics.median(v), "all_s": v, "hit_tokens": hits[k]} for k, v in cases.items()}
    base = rows["recomputed"]["ttft_s"]
    print(f"# {cpu_info().describe()}; {args.prompt_tokens}-token prompt; {args.dtype}; median of {args.rounds}")
    for k, row in rows.items():
        print(
            f"{k:15s} {row['ttft_s'] * 1e3:8.1f} ms  ({base / row['ttft_s']:.1f}x recompute; {row['hit_tokens']} hit)"
        )
    out = HERE / "results" / "kv_tiers.json"
    out.write_text(json.dumps({"cpu": cpu_info().describe(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
