"""Serving vs offline on the same requests: how much does the server cost?

For each concurrency C and each round: the offline ``LLM.generate`` runs the
workload with ``max_num_seqs=C`` (the scheduler never holds more than C sequences, as
a client that keeps C requests in flight), then ``tokenmill serve`` (same engine
options) takes the same requests from ``tokenmill bench serve --max-concurrency C``,
once per ``--modes`` entry (``process``: the engine core in its own process;
``thread``: the engine loop on a thread of the API process, the shape before the
split). Everything generates exactly ``max_tokens`` per request (greedy,
``ignore_eos``), so output tokens/s compare directly. Rounds alternate the runs (the
machine is shared and noisy); the table gives medians, and serve/offline ratios
within a round. TTFT and ITL come from the streaming client.

    python bench/serve_vs_offline.py --num-prompts 64 --concurrency 16,64 --rounds 3 --out bench/results/serve_vs_offline.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenmill.loadgen.serve import synthetic  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def offline(reqs: list[dict], concurrency: int) -> dict:
    """Output tokens/s of LLM.generate on the workload, in a fresh process (so that its
    memory and threads do not linger into the server's run)."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tokenmill import LLM, SamplingParams
reqs = json.loads(sys.stdin.read())
llm = LLM(max_num_seqs={concurrency}, progress=False)
warm = llm.generate(["warm up"], SamplingParams(max_tokens=8, temperature=0))
ps = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in reqs]
t0 = time.perf_counter()
outs = llm.generate([r["prompt"] for r in reqs], ps)
dt = time.perf_counter() - t0
print(json.dumps({{"duration_s": dt, "output_tokens": sum(len(o.token_ids) for o in outs)}}))
"""
    p = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(reqs), capture_output=True, text=True, cwd=ROOT, check=True
    )
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["output_token_throughput"] = r["output_tokens"] / r["duration_s"]
    return r


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def served(dataset: Path, n: int, concurrency: int, port: int, extra: list[str], outdir: Path) -> dict:
    log = open(outdir / f"serve_c{concurrency}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill",
            "serve",
            "--port",
            str(port),
            "--served-model-name",
            "smollm2",
            "--max-num-seqs",
            str(concurrency),
            *extra,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_up(base, proc)
        label = f"serve_vs_offline_c{concurrency}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenmill",
                "bench",
                "serve",
                "--base-url",
                base,
                "--dataset-path",
                str(dataset),
                "--num-prompts",
                str(n),
                "--max-concurrency",
                str(concurrency),
                "--label",
                label,
                "--output-dir",
                str(outdir),
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        run = json.loads((outdir / f"{label}.json").read_text())["runs"][0]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    return run


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default="process,thread", help="engine-core modes of the server to measure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--label", default="", help="names this run in the output")
    ap.add_argument("--out", default="bench/results/serve_vs_offline.json")
    args = ap.parse_args()
    reqs = synthetic("mixed", args.num_prompts, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="serve_vs_offline_"))
    dataset = tmp / "mixed.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    modes = args.modes.split(",")
    rounds = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        for r in range(args.rounds):
            row = {"concurrency": c, "round": r, "offline_tok_s": offline(reqs, c)["output_token_throughput"]}
            for mode in modes:
                srv = served(dataset, args.num_prompts, c, args.port, ["--engine-core", mode], tmp)
                row[mode] = {
                    "tok_s": srv["output_token_throughput"],
                    "failed": srv["failed"],
                    "ttft_p50_s": srv["ttft_s"]["p50"],
                    "ttft_p99_s": srv["ttft_s"]["p99"],
                    "itl_p50_s": srv["itl_s"]["p50"],
                    "itl_p99_s": srv["itl_s"]["p99"],
                    "over_offline": srv["output_token_throughput"] / row["offline_tok_s"],
                }
            rounds.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "label": args.label,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "num_prompts": args.num_prompts,
        "rounds": rounds,
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{cpu_name()}, {os.cpu_count()} cores, {args.num_prompts} mixed requests, medians of {args.rounds} rounds")
    print("| C | server | offline tok/s | serve tok/s | serve/offline | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for c in dict.fromkeys(r["concurrency"] for r in rounds):
        rs = [r for r in rounds if r["concurrency"] == c]
        for mode in modes:

            def m(key: str, rs=rs, mode=mode) -> float:
                return median([r[mode][key] for r in rs])

            print(
                f"| {c} | {mode} | {median([r['offline_tok_s'] for r in rs]):.1f} | {m('tok_s'):.1f} | "
                f"{m('over_offline'):.2f} | {m('ttft_p50_s'):.2f} / {m('ttft_p99_s'):.2f} | "
                f"{m('itl_p50_s') * 1000:.0f} / {m('itl_p99_s') * 1000:.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
