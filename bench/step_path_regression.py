"""Before/after checks for the step-path rework, on the public API of both checkouts.

    python bench/step_path_regression.py --compare-with /path/to/old/checkout [--repeats 2]

Two workloads, each run in a fresh subprocess per checkout, the checkouts
interleaved (before, after, before, after, ...) so that the shared machine's drift
hits both alike:

- **mixed**: 32 requests of bench/throughput.py's mixed workload (prompts 16..1000
  tokens, outputs 16..256, greedy, ignore_eos), all at once: output tokens/s.
  Greedy outputs must be identical between the checkouts.
- **spec**: self-speculation (the first 6 layers draft k=8 tokens) with 32 requests
  of 48-token prompts and 160 output tokens in a KV pool that holds about half of
  them, so that the load stays far above the pause threshold (4 running) for most
  of the run: preemptions and output tokens/s. Before, every sampling sequence
  reserved k lookahead slots even while speculation was paused (half a block each
  at k=8); after, only the sequences that draft.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def preemptions(engine) -> int:
    """The engine's preemption count (on its core since the engine holds one; a public view
    after the rework; the scheduler's before)."""
    core = getattr(engine, "core", engine)
    n = getattr(core, "num_preemptions", None)
    return n if isinstance(n, int) else core.scheduler.num_preemptions


def run_mixed(num_requests: int) -> dict:
    sys.path.insert(0, str(HERE))
    from throughput import mixed_workload

    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory="2GiB", max_num_seqs=32, progress=False)
    reqs = mixed_workload(llm.tokenizer, num_requests)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tok_s": tokens / elapsed, "output_tokens": tokens, "outputs": digest([o.token_ids for o in outs])}


def run_spec() -> dict:
    sys.path.insert(0, str(HERE))
    from throughput import corpus_ids

    from tokenmill import LLM, SamplingParams

    llm = LLM(
        dtype="float32",
        kv_cache_memory="160MiB",
        max_num_seqs=32,
        progress=False,
        speculative="self",
        draft_layers=6,
        num_speculative_tokens=8,
    )
    ids = corpus_ids(llm.tokenizer)
    prompts = [ids[i * 37 % (len(ids) - 48) :][:48] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "output_tok_s": tokens / elapsed,
        "preemptions": preemptions(llm.engine),
        "num_blocks": llm.num_blocks,
        "outputs": digest([o.token_ids for o in outs]),
    }


def child(task: str, checkout: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--task", task, "--num-requests", str(args.num_requests)]
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare-with", required=False, help="the old checkout (before)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--tasks", nargs="+", choices=["mixed", "spec"], default=["mixed", "spec"])
    p.add_argument("--task", choices=["mixed", "spec"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.task:  # the subprocess side
        print(json.dumps(run_mixed(args.num_requests) if args.task == "mixed" else run_spec()))
        return
    checkouts = {"before": Path(args.compare_with), "after": HERE.parent}
    runs: dict[str, dict[str, list[dict]]] = {t: {c: [] for c in checkouts} for t in args.tasks}
    for rep in range(args.repeats):
        for task in runs:
            for name, path in checkouts.items():
                r = child(task, path, args)
                runs[task][name].append(r)
                log(f"repeat {rep + 1} {task} {name}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    summary = {}
    for task, by in runs.items():
        summary[task] = {
            c: {
                "output_tok_s_median": statistics.median(r["output_tok_s"] for r in rs),
                **({"preemptions": [r["preemptions"] for r in rs]} if task == "spec" else {}),
                "outputs": sorted({r["outputs"] for r in rs}),
            }
            for c, rs in by.items()
        }
        same = summary[task]["before"]["outputs"] == summary[task]["after"]["outputs"]
        summary[task]["greedy_outputs_identical"] = same
        ratio = summary[task]["after"]["output_tok_s_median"] / summary[task]["before"]["output_tok_s_median"]
        summary[task]["after_over_before"] = round(ratio, 3)
        log(f"{task}: after/before {ratio:.3f}, outputs identical: {same}")
    sys.path.insert(0, str(HERE))
    from step_overhead import cpu_info

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"step_path_regression_{'_'.join(args.tasks)}.json").write_text(
        json.dumps({"cpu": cpu_info(), "runs": runs, "summary": summary}, indent=1)
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
