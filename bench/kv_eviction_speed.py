"""What KV eviction buys and costs in speed (issue 62): one long request's prefill and decode
with full KV, StreamingLLM and SnapKV at the same window, alternating, in one run.

    .venv/bin/python bench/kv_eviction_speed.py [--model FILE.gguf] [--prompt 4096] [--new 256] [--ratio 8]

The prompt is this repository's README (its first ``--prompt`` tokens); each setting generates
``--new`` tokens greedily (ignore_eos). Reported: time to the first token (the prompt's read:
StreamingLLM reads it a stride at a time, SnapKV scores and compacts it at its end), decode
tokens per second after it, and the KV blocks the request held at its end. Writes
bench/results/kv_eviction_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(llm, ids: list[int], new: int, ev: dict | None) -> tuple[float, float, int]:
    """(seconds to the first token, decode tokens/s, blocks held at the end) of one request."""
    from tokenmill import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, kv_eviction=ev)
    engine.add_request("r", ids, params)
    start, first, held = time.perf_counter(), None, 0
    while engine.has_unfinished():
        outs = engine.step()
        for req in engine.core.scheduler.running:
            held = len(req.block_ids)
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, (new - 1) / (end - first), held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--ratio", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from tokenmill import LLM

    llm = LLM(
        args.model,
        max_model_len=args.prompt + args.new + 16,
        kv_cache_memory="1GiB",
        enable_prefix_caching=False,  # each round reads its prompt (evicting requests never hit)
        progress=False,
    )
    text = (ROOT / "README.md").read_text() + "\n\n" + (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    ids = llm.tokenizer.encode(text)[: args.prompt]
    window = args.prompt // args.ratio
    settings = {
        "full KV": None,
        f"StreamingLLM {args.ratio}x": {"window": window, "sinks": 4},
        f"SnapKV {args.ratio}x": {"policy": "snapkv", "window": window},
    }
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in settings}
    run(llm, ids[:256], 8, None)  # warm-up
    for _ in range(args.rounds):
        for label, ev in settings.items():
            runs[label].append(run(llm, ids, args.new, ev))
            print(label, runs[label][-1], flush=True)
    print(f"\n{args.prompt}-token prompt, {args.new} new tokens; {llm.model_path.name}; {cpu_name()}\n")
    print("| setting | time to first token (s) | decode tok/s | vs full KV | KV blocks held at the end |")
    print("|---|---|---|---|---|")
    full = statistics.median(r[1] for r in runs["full KV"])
    rows = {}
    for label, rs in runs.items():
        ttft, tps = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        rows[label] = {"ttft_s": ttft, "decode_tok_s": tps, "blocks": rs[-1][2], "runs": rs}
        print(f"| {label} | {ttft:.2f} | {tps:.1f} | {tps / full:.2f}x | {rs[-1][2]} |")
    out = ROOT / "bench" / "results" / "kv_eviction_speed.json"
    out.write_text(json.dumps({"cpu": cpu_name(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
