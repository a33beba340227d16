"""One GGUF file's decode and prefill on two (or more) checkouts, alternating, and llama.cpp's.

    python bench/checkout_ab.py FILE --checkout before=/tmp/before --checkout after=. \\
        [--dtypes bfloat16,float32] [--rounds 2] [--llama-bench /work/peers/llama.cpp-native/bin/llama-bench]

Each (checkout, dtype) runs in a fresh process with that checkout first on ``sys.path`` (so an
older commit's worktree measures its own code, with its own kernel build): 128 greedy tokens
after a short prompt (best of 3) and a 512-token prefill (best of 2), tok/s. Then
``llama-bench -p 512 -n 128 -t 2 -r 2`` on the same file, once a round. Rounds alternate every
side: the machine is shared and noisy, so read ratios within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MEASURE = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], progress=False, enable_prefix_caching=False)
llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
decode = 0.0
for _ in range(3):
    t = time.perf_counter(); llm.generate(["The history of the city"], p); decode = max(decode, 128 / (time.perf_counter() - t))
prompt = [1000 + (j * 7) % 20000 for j in range(512)]
prefill = 0.0
for _ in range(2):
    t = time.perf_counter(); llm.generate([prompt], SamplingParams(max_tokens=1)); prefill = max(prefill, 512 / (time.perf_counter() - t))
print(json.dumps({"decode": decode, "prefill": prefill}))
"""


def ours(root: str, path: str, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, path, dtype], cwd=root, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama(binary: str, path: str) -> dict:
    out = subprocess.run(
        [binary, "-m", path, "-p", "512", "-n", "128", "-t", "2", "-r", "2", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--checkout", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-bench", default=None)
    args = ap.parse_args()
    results = []
    for rnd in range(args.rounds):
        for name, root in (c.split("=", 1) for c in args.checkout):
            for dtype in args.dtypes.split(","):
                r = {"round": rnd, "side": name, "dtype": dtype, **ours(os.path.abspath(root), args.file, dtype)}
                print(json.dumps(r), flush=True)
                results.append(r)
        if args.llama_bench:
            r = {"round": rnd, "side": "llama.cpp", **llama(args.llama_bench, args.file)}
            print(json.dumps(r), flush=True)
            results.append(r)
    print("| round | side | dtype | decode tok/s | prefill tok/s |\n|---|---|---|---:|---:|")
    for r in results:
        print(f"| {r['round'] + 1} | {r['side']} | {r.get('dtype', '')} | {r['decode']:.1f} | {r['prefill']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
