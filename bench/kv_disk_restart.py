"""The prefix cache's disk tier over a restart (issue 62): an agent-like workload, several
conversations of many turns that share a long system prompt, run on `tokenmill serve
--kv-disk-cache DIR`; then each conversation's last turn asked again of a restarted server on
the same directory, and of one without the tier. Time to first token of those last turns
(streamed, one request at a time), the prefix-cache hit rate of each phase (/metrics) and the
disk used:

    .venv/bin/python bench/kv_disk_restart.py [--conversations 8] [--turns 10] [--model PATH]

Writes results/kv_disk_restart.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tokenmill.kernels.cpu import cpu_info  # noqa: E402
from tokenmill.loadgen.server_process import ServerProcess  # noqa: E402

TOPICS = ["tides", "lighthouses", "ledgers", "ropes", "sails", "maps", "storms", "anchors", "gulls", "harbours"]


def system_prompt() -> str:
    text = (HERE / "prompt.txt").read_text()
    return "You are the harbour archive's assistant. Reference notes follow.\n" + (text * 4)[:5000]


def ttft(http: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Seconds to the first streamed token, and the whole answer."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, first, parts = time.perf_counter(), None, []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                first = first or time.perf_counter()
                parts.append(delta[0]["delta"]["content"])
    return (first or time.perf_counter()) - start, "".join(parts)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def hit_rate(url: str, before: tuple[float, float]) -> float:
    q = metric(url, "tokenmill:prefix_cache_queries_total") - before[0]
    h = metric(url, "tokenmill:prefix_cache_hits_total") - before[1]
    return h / q if q else 0.0


def counters(url: str) -> tuple[float, float]:
    return metric(url, "tokenmill:prefix_cache_queries_total"), metric(url, "tokenmill:prefix_cache_hits_total")


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {
        "p50": statistics.median(s),
        "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
        "mean": statistics.mean(s),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    args = ap.parse_args()
    flags = ["--served-model-name", "m", "--kv-cache-memory", "1GiB", *(["--model", args.model] if args.model else [])]
    tier = Path(tempfile.mkdtemp(prefix="kv_disk_"))
    system = system_prompt()
    chats = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    finals: list[list[dict]] = []
    warm: list[float] = []
    try:
        with (
            ServerProcess([*flags, "--kv-disk-cache", str(tier)]) as server,
            httpx.Client(base_url=server.url, timeout=600) as http,
        ):
            before = counters(server.url)
            for t in range(args.turns):
                for c, chat in enumerate(chats):
                    topic = TOPICS[(c + t) % len(TOPICS)]
                    chat.append({"role": "user", "content": f"Turn {t}: what do the notes say about {topic}? ({c})"})
                    seconds, answer = ttft(http, chat, args.max_tokens)
                    if t == args.turns - 1:
                        warm.append(seconds)
                        finals.append(list(chat))
                    chat.append({"role": "assistant", "content": answer})
            warm_hits = hit_rate(server.url, before)
        disk_bytes = sum(f.stat().st_size for f in tier.rglob("*.kv"))
        phases = {}
        for name, extra in (("restart, disk tier", ["--kv-disk-cache", str(tier)]), ("restart, no tier", [])):
            with ServerProcess([*flags, *extra]) as server, httpx.Client(base_url=server.url, timeout=600) as http:
                before = counters(server.url)
                times = [ttft(http, chat, args.max_tokens)[0] for chat in finals]
                phases[name] = {"ttft": summary(times), "hit_rate": hit_rate(server.url, before)}
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    result = {
        "cpu": cpu_info().describe(),
        "conversations": args.conversations,
        "turns": args.turns,
        "disk_bytes": disk_bytes,
        "warm": {"ttft": summary(warm), "hit_rate": warm_hits},
        **phases,
    }
    print(
        f"CPU: {result['cpu']}; {args.conversations} conversations x {args.turns} turns; disk tier {disk_bytes / 2**20:.1f} MiB"
    )
    print("| phase | TTFT p50 (s) | TTFT p99 (s) | prefix-cache hit rate |")
    print("|---|---:|---:|---:|")
    for name in ("warm", "restart, disk tier", "restart, no tier"):
        r = result[name]
        print(f"| {name} | {r['ttft']['p50']:.3f} | {r['ttft']['p99']:.3f} | {r['hit_rate']:.2f} |")
    out = HERE / "results" / "kv_disk_restart.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
