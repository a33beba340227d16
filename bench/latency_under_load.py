"""Latency under load at the server's defaults: TPOT p99 against one request alone.

Issue 58 item 5: ``tokenmill bench serve`` with 64 distinct ~230-token prompts (64 output
tokens each, greedy, ``ignore_eos``) at a few request rates against ``tokenmill serve`` on the
bundled model; a chunked-prefill server should keep TPOT p99 within 3x of the TPOT one request
sees alone, at the loads it sustains, without losing throughput.

For each round and each setting (``--setting NAME=SERVE ARGS``, the defaults first), a fresh
server is started; it serves 8 requests one at a time (the unloaded TPOT), then one run of 64
prompts per rate. Every run's prompts are its own (``Note <rate>-<i>.`` ahead of a window of
text), so no run is served from another's prefix cache. Settings alternate within a round
(the machine is shared and noisy). Writes the JSON and prints a table of medians over rounds.

    python bench/latency_under_load.py --rates 1,2,4 --rounds 2 \\
        --setting "default=" --setting "budget 256=--max-num-batched-tokens 256" \
        --setting "before=--checkout=/tmp/before"   # a worktree of an older commit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_vs_offline import cpu_name, wait_up  # noqa: E402  (a sibling bench script: its server start-up check)

TEXT = [ROOT / "tests" / "data" / "heldout.txt", ROOT / "bench" / "prompt.txt"]
WORDS_PER_PROMPT = 170  # ~230 tokens of English with SmolLM2's tokenizer


def prompts(tag: str, n: int, max_tokens: int) -> list[dict]:
    words = " ".join(p.read_text() for p in TEXT).split()
    rows = []
    for i in range(n):
        start = (i * 53) % (len(words) - WORDS_PER_PROMPT)
        text = " ".join(words[start : start + WORDS_PER_PROMPT])
        rows.append({"prompt": f"Note {tag}-{i}. {text}\nSummary:", "max_tokens": max_tokens})
    return rows


def bench(base: str, rows: list[dict], outdir: Path, label: str, rate: str, concurrency: int | None) -> dict:
    data = outdir / f"{label}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", base, "--dataset-path", str(data)]
    cmd += ["--num-prompts", str(len(rows)), "--request-rate", rate, "--label", label, "--output-dir", str(outdir)]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = json.loads((outdir / f"{label}.json").read_text())["runs"][0]
    return {
        "rate": rate,
        "failed": run["failed"],
        "output_tok_s": run["output_token_throughput"],
        "req_s": run["request_throughput"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "ttft_p99_s": run["ttft_s"]["p99"],
        "tpot_p50_s": run["tpot_s"]["p50"],
        "tpot_p99_s": run["tpot_s"]["p99"],
        "itl_p99_s": run["itl_s"]["p99"],
    }


def measure(name: str, serve_args: list[str], rates: list[str], args, outdir: Path, rnd: int) -> dict:
    """One fresh server: alone, then each rate. ``--checkout=DIR`` first among the args: the
    server runs from that checkout (an older commit's tree: the "before")."""
    root = ROOT
    if serve_args and serve_args[0].startswith("--checkout="):
        root, serve_args = Path(serve_args[0].split("=", 1)[1]), serve_args[1:]
    log = open(outdir / f"serve_{rnd}_{len(name)}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", "--port", str(args.port), *serve_args],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_up(base, proc)
        alone = bench(base, prompts(f"alone{rnd}", 8, args.max_tokens), outdir, f"alone_{rnd}", "inf", 1)
        runs = []
        for rate in rates:
            rows = prompts(f"{rnd}-{rate}", args.num_prompts, args.max_tokens)
            run = bench(base, rows, outdir, f"load_{rnd}_{rate}", rate, None)
            run["tpot_p99_over_alone"] = run["tpot_p99_s"] / alone["tpot_p50_s"]
            runs.append(run)
            print(f"  {name} round {rnd} rate {rate}: {json.dumps(run)}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    return {"setting": name, "serve_args": serve_args, "round": rnd, "alone": alone, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", default=[], help="NAME=SERVE ARGS (default: the defaults only)")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--out", default="bench/results/latency_under_load.json")
    args = ap.parse_args()
    settings = [(s.split("=", 1)[0], s.split("=", 1)[1].split()) for s in args.setting] or [("default", [])]
    rates = args.rates.split(",")
    outdir = Path(tempfile.mkdtemp(prefix="latency_under_load_"))
    results = []
    for rnd in range(args.rounds):
        for name, serve_args in settings:
            results.append(measure(name, serve_args, rates, args, outdir, rnd))
    doc = {"cpu": cpu_name(), "cores": os.cpu_count(), "command": " ".join(sys.argv), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"{cpu_name()}, {os.cpu_count()} cores; medians of {args.rounds} round(s)")
    print(
        "| setting | rate (req/s) | TPOT alone (ms) | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | p99 / alone |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, _ in settings:
        mine = [r for r in results if r["setting"] == name]
        alone = statistics.median(r["alone"]["tpot_p50_s"] for r in mine)
        for rate in rates:
            runs = [run for r in mine for run in r["runs"] if run["rate"] == rate]

            def m(key: str, runs=runs) -> float:
                return statistics.median(run[key] for run in runs)

            print(
                f"| {name} | {rate} | {1e3 * alone:.1f} | {m('output_tok_s'):.1f} | "
                f"{m('ttft_p50_s'):.2f} / {m('ttft_p99_s'):.2f} | {1e3 * m('tpot_p50_s'):.0f} / "
                f"{1e3 * m('tpot_p99_s'):.0f} | {m('tpot_p99_over_alone'):.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
