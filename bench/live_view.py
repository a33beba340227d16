"""What watching costs: serving throughput with the live view open against without.

    python bench/live_view.py [--requests 32] [--concurrency 4] [--rounds 3] [--viewers 2]

Two `tokenmill serve` on the default model, alike but for one thing: on one, nobody
ever asks for the live view, so its engine never records a step; on the other,
``--viewers`` clients read ``/tokenmill/live/events`` (each event: the steps since the
last, the gauges, the block states) for the whole run, as open browser tabs would.
Each round sends the same ``--requests`` greedy streamed chats, ``--concurrency`` at a
time, to each server in turn (the idle one costs nothing), alternating which goes
first. Reported: generated tokens/s and TTFT p50 per server, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.kernels.cpu import cpu_info
from tokenmill.loadgen.server_process import free_port

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "Tell me about the history of {}.",
    "Write a short poem about {}.",
    "What should a visitor to {} see first?",
    "Explain in three sentences why {} matters.",
]
TOPICS = ["Paris", "the sea", "bread", "mountains", "trains", "bees", "rain", "the moon"]


def start(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t), tokens


async def watch(url: str, stop: asyncio.Event, seen: list[int]) -> None:
    """An open page: read every event of the live stream until told to stop."""
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async with client.stream("GET", "/tokenmill/live/events") as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    state = json.loads(line[6:])
                    seen[0] += sum(len(m["steps"]) for m in state["models"])
                if stop.is_set():
                    return


async def run(url: str, prompts: list[str], concurrency: int, max_tokens: int, viewers: int) -> dict:
    stop, seen = asyncio.Event(), [0]
    watchers = [asyncio.create_task(watch(url, stop, seen)) for _ in range(viewers)]
    await asyncio.sleep(1.0 if viewers else 0)  # the viewers are connected and tracing is on
    queue = list(prompts)
    results: list[tuple[float, int]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                results.append(await one(client, queue.pop(0), max_tokens))

        t = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t
    stop.set()
    await asyncio.wait_for(asyncio.gather(*watchers, return_exceptions=True), 5)
    return {
        "wall_s": wall,
        "output_tok_per_s": sum(n for _, n in results) / wall,
        "ttft_p50_ms": statistics.median(t for t, _ in results) * 1000,
        "steps_seen_by_viewers": seen[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--viewers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)].format(TOPICS[i % len(TOPICS)]) for i in range(args.requests)]
    ports = {"unwatched": free_port(), "watched": free_port()}
    servers = {name: start(port) for name, port in ports.items()}
    runs: dict[str, list[dict]] = {name: [] for name in ports}
    try:
        for port in ports.values():  # warm up both
            asyncio.run(run(f"http://127.0.0.1:{port}", prompts[:4], args.concurrency, 8, 0))
        for r in range(args.rounds):
            order = ("unwatched", "watched") if r % 2 == 0 else ("watched", "unwatched")
            for name in order:
                viewers = args.viewers if name == "watched" else 0
                res = asyncio.run(
                    run(f"http://127.0.0.1:{ports[name]}", prompts, args.concurrency, args.max_tokens, viewers)
                )
                runs[name].append(res)
                seen = f", the viewers saw {res['steps_seen_by_viewers']} steps" if viewers else ""
                print(
                    f"round {r + 1} {name:9s}: {res['output_tok_per_s']:.1f} tok/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms"
                    f"{seen}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    summary = {
        name: {f: statistics.median(x[f] for x in runs[name]) for f in ("output_tok_per_s", "ttft_p50_ms")}
        for name in runs
    }
    ratio = summary["watched"]["output_tok_per_s"] / summary["unwatched"]["output_tok_per_s"]
    result = {
        "cpu": cpu_info().describe(),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "viewers": args.viewers,
        "summary": summary,
        "watched_over_unwatched_tok_per_s": ratio,
        "runs": runs,
    }
    print(
        f"CPU: {result['cpu']}; {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, "
        f"{args.viewers} viewers"
    )
    for name, s in summary.items():
        print(f"{name:9s} {s['output_tok_per_s']:7.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:6.0f} ms (medians)")
    print(f"watched / unwatched: {ratio:.3f}x the generated tokens/s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "live_view.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
