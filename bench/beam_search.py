"""Beam search (width 4) against greedy on the real model: time per output token at
batch 1 and 8, and what the beams share through the prefix cache.

    .venv/bin/python bench/beam_search.py [--width 4] [--tokens 32] [--repeats 3]

Each round of a beam search is one engine batch of one-token requests (one per live
beam); a beam's prompt and the blocks it has in common with the others are found in
the prefix cache, so each round computes only the tokens past the last full block.
"Shared" below counts those cached tokens (and blocks); "computed" the tokens the
model ran. Greedy is `LLM.generate` of the same prompts, same length, ignore_eos.
Writes results/beam_search.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
    "My favourite food is",
    "In 1492, Columbus",
    "The best way to learn a language is",
    "Water boils at",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from tokenmill import LLM, BeamSearchParams, SamplingParams

    llm = LLM(progress=False)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4))  # warm up
    rows = []
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        greedy_s, beam_s, shared, computed, looked_up = [], [], [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
            greedy_s.append(time.perf_counter() - t0)
            before = llm.prefix_cache_stats
            q0, h0 = before.queries, before.hits
            llm.engine.core.step_stats.clear()
            t0 = time.perf_counter()
            llm.beam_search(prompts, BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True))
            beam_s.append(time.perf_counter() - t0)
            after = llm.prefix_cache_stats
            looked_up.append(after.queries - q0)
            shared.append(after.hits - h0)
            computed.append(sum(s.num_prefill_tokens + s.num_decode_tokens for s in llm.engine.core.step_stats))
        g, b = statistics.median(greedy_s), statistics.median(beam_s)
        rows.append(
            {
                "batch": batch,
                "greedy_ms_per_token": 1000 * g / args.tokens,
                "beam_ms_per_token": 1000 * b / args.tokens,
                "beam_over_greedy": b / g,
                "prompt_tokens_requested": looked_up[-1],
                "tokens_shared_from_cache": shared[-1],
                "blocks_shared": shared[-1] // llm.engine.core.block_size,
                "tokens_computed": computed[-1],
                "share_rate": shared[-1] / looked_up[-1] if looked_up[-1] else None,
            }
        )
        print(json.dumps(rows[-1]))
    sys.path.insert(0, str(HERE))
    from step_overhead import cpu_info

    out = {
        "command": " ".join(sys.argv),
        "cpu": cpu_info(),
        "dtype": str(llm.dtype) if hasattr(llm, "dtype") else None,
        "width": args.width,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    (HERE / "results" / "beam_search.json").write_text(json.dumps(out, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
