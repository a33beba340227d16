"""What a prompt chunk costs the decodes it shares a step with.

    python bench/mixed_step_cost.py [--decodes 28] [--prompts 1,8,31,64,230] [--dtype bfloat16] [--model PATH]

Starts ``--decodes`` greedy requests (200-token prompts) and lets them reach their decodes;
then, for each prompt length P, the median time of steps of those decodes alone and of steps
that also compute a new P-token prompt (one sampled token, temperature 1: a request that
samples beside greedy ones). The public API only (``LLM``, ``engine.add_request``,
``engine.step``), so the same script times an older checkout (run it from that tree).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decodes", type=int, default=28)
    ap.add_argument("--prompts", default="1,8,31,64,230")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    llm = (
        LLM(model=args.model, dtype=args.dtype, progress=False) if args.model else LLM(dtype=args.dtype, progress=False)
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", [1000 + (i * 37 + j) % 20000 for j in range(200)], params)
    started: set[str] = set()
    while len(started) < args.decodes:
        started.update(o.request_id for o in engine.step())

    def alone() -> float:
        times = []
        for _ in range(args.repeats * 2):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    print(f"{args.decodes} decodes alone: {alone():.1f} ms a step")
    print("| prompt tokens | step with it (ms) | decodes alone (ms) |")
    print("|---:|---:|---:|")
    k = 0
    for p in (int(x) for x in args.prompts.split(",")):
        mixed = []
        for _ in range(args.repeats):
            k += 1
            engine.add_request(f"p{k}", [2000 + (k * 13 + j) % 20000 for j in range(p)], SamplingParams(max_tokens=1))
            t = time.perf_counter()
            engine.step()
            mixed.append(time.perf_counter() - t)  # (its one token ends the prompt's request in that step)
        print(f"| {p} | {1e3 * statistics.median(mixed):.1f} | {alone():.1f} |")


if __name__ == "__main__":
    main()
