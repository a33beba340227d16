"""bfloat16 batches: upcast to float32 from 128 rows (the old CPU-flag rule) against the
choice kernels/gemm_choice.py measures on this machine, on throughput.py's batched
``mixed`` workload (issue 58).

    .venv/bin/python bench/peers/gguf_to_hf.py /tmp/smollm2-hf     # the HF folder, once
    .venv/bin/python bench/gemm_choice_ab.py /tmp/smollm2-hf [--rounds 2] [--num-requests 64]

Each setting runs in a fresh process (the choice is read once, at load), alternating
A B A B so that a slow patch of a shared machine falls on both; prefix caching off, as
the issue's measurement. Prints the probe's timings, each run's output tok/s and the
ratio of medians; writes results/gemm_choice_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SETTINGS = {"upcast from 128 rows (old rule)": "128", "measured choice": ""}

CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r})
from throughput import mixed_workload
from tokenmill import LLM, SamplingParams
llm = LLM(model={model!r}, dtype="bfloat16", kv_cache_memory="2GiB", max_num_seqs=64,
          enable_prefix_caching=False, progress=False)
reqs = mixed_workload(llm.tokenizer, {n})
llm.generate(reqs[0][0][:32], SamplingParams(max_tokens=4))
params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
start = time.perf_counter()
outs = llm.generate([p for p, _ in reqs], params)
elapsed = time.perf_counter() - start
tokens = sum(len(o.token_ids) for o in outs)
print(json.dumps({{"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
                  "prompt_tokens": sum(len(p) for p, _ in reqs)}}))
"""


def run(model: str, n: int, forced: str) -> dict:
    env = dict(os.environ)
    env.pop("TOKENMILL_UPCAST_ROWS", None)
    if forced:
        env["TOKENMILL_UPCAST_ROWS"] = forced
    code = CHILD.format(here=str(HERE), model=model, n=n)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Hugging Face folder (bench/peers/gguf_to_hf.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from tokenmill.kernels.cpu import cpu_info
    from tokenmill.kernels.gemm_choice import cache_file, machine_key, upcast_rows

    chosen = upcast_rows()
    probe = json.loads(cache_file().read_text()).get(machine_key(), {})
    print(f"CPU: {cpu_info().describe()}\nmeasured choice: upcast from {chosen} rows; probe ms {probe.get('ms')}")
    runs: dict[str, list[dict]] = {k: [] for k in SETTINGS}
    for r in range(args.rounds):
        for name, forced in SETTINGS.items():
            res = run(args.model, args.num_requests, forced)
            runs[name].append(res)
            print(
                f"round {r + 1}: {name}: {res['output_tok_s']:.1f} output tok/s ({res['elapsed_s']:.1f} s)", flush=True
            )
    med = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in runs.items()}
    names = list(SETTINGS)
    ratio = med[names[1]] / med[names[0]]
    print(f"median output tok/s: {med}; measured / old = {ratio:.2f}x")
    out = {
        "cpu": cpu_info().as_dict(),
        "command": " ".join(sys.argv),
        "chosen_upcast_rows": chosen,
        "probe": probe,
        "runs": runs,
        "median_output_tok_s": med,
        "ratio": ratio,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "gemm_choice_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
