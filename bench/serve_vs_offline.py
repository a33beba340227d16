"""Serving vs offline on the same requests: how much does the server cost?

For each concurrency C: the offline ``LLM.generate`` runs the workload with
``max_num_seqs=C`` (the scheduler never holds more than C sequences, as a client
that keeps C requests in flight), then ``tokenmill serve`` (same engine options)
takes the same requests from ``tokenmill bench serve --max-concurrency C``. Both
generate exactly ``max_tokens`` per request (greedy, ``ignore_eos``), so output
tokens/s compare directly; the ratio serve/offline is the figure, measured in one
run on one machine. TTFT and ITL p99 come from the streaming client.

    python bench/serve_vs_offline.py --num-prompts 64 --concurrency 16,64 --out bench/results/serve_vs_offline.json
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

from tokenmill.benchmark.serve import synthetic  # noqa: E402


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
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(reqs), capture_output=True, text=True, cwd=ROOT,
                       check=True)  # fmt: skip
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
    log = open(outdir / f"serve_c{concurrency}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--served-model-name",
                             "smollm2", "--max-num-seqs", str(concurrency), *extra],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_up(base, proc)
        label = f"serve_vs_offline_c{concurrency}"
        subprocess.run([sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", base, "--dataset-path",
                        str(dataset), "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--label", label,
                        "--output-dir", str(outdir)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        run = json.loads((outdir / f"{label}.json").read_text())["runs"][0]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--serve-args", default="", help="extra flags for tokenmill serve (e.g. --engine-core thread)")
    ap.add_argument("--label", default="", help="names this run in the output (e.g. before / after)")
    ap.add_argument("--out", default="bench/results/serve_vs_offline.json")
    args = ap.parse_args()
    reqs = synthetic("mixed", args.num_prompts, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="serve_vs_offline_"))
    dataset = tmp / "mixed.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        off = offline(reqs, c)
        srv = served(dataset, args.num_prompts, c, args.port, args.serve_args.split(), tmp)
        row = {"concurrency": c, "offline_tok_s": off["output_token_throughput"],
               "serve_tok_s": srv["output_token_throughput"], "completed": srv["completed"], "failed": srv["failed"],
               "ttft_p50_s": srv["ttft_s"]["p50"], "ttft_p99_s": srv["ttft_s"]["p99"],
               "itl_p50_s": srv["itl_s"]["p50"], "itl_p99_s": srv["itl_s"]["p99"]}  # fmt: skip
        row["serve_over_offline"] = row["serve_tok_s"] / row["offline_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"label": args.label, "cpu": cpu_name(), "cores": os.cpu_count(), "num_prompts": args.num_prompts,
              "serve_args": args.serve_args, "rows": rows, "command": " ".join(sys.argv)}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"| C | offline tok/s | serve tok/s | serve/offline | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |  [{args.label}, {cpu_name()}]")
    for r in rows:
        print(f"| {r['concurrency']} | {r['offline_tok_s']:.1f} | {r['serve_tok_s']:.1f} | {r['serve_over_offline']:.2f} | "
              f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['itl_p50_s'] * 1000:.0f} / {r['itl_p99_s'] * 1000:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
