"""The exact response cache on an FAQ-like workload: throughput, TTFT p50/p99 and hit rate,
with the cache against without, on one `tokenmill serve`.

    python bench/response_cache.py [--requests 160] [--concurrency 4] [--rounds 2]

The workload: ``--requests`` greedy chat requests, each one of the 40 questions of
``bench/faq_questions.json`` drawn with Zipf-like popularity (a few questions asked
often, most rarely; seeded, the same draw every round), streamed, ``--concurrency`` at
a time (``--no-stream``: whole answers; TTFT is then the latency). Each round runs it twice, without the cache (every request ``cache: false``)
and with it, starting cold: each round's cached run uses an API key (a tenant) of its
own, so no answer of an earlier round is found. Rounds alternate which goes first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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


def workload(n: int, seed: int = 0) -> list[str]:
    questions = json.loads(Path(__file__).with_name("faq_questions.json").read_text())
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(questions))]
    return random.Random(seed).choices(questions, weights, k=n)


async def one(client: httpx.AsyncClient, key: str, question: str, cached: bool, max_tokens: int, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "cache": cached,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t = time.perf_counter()
    ttft, tokens, status = None, 0, None
    if not stream:  # the first token comes with the whole answer
        r = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        e2e = time.perf_counter() - t
        return {
            "ttft": e2e,
            "tokens": r.json()["usage"]["completion_tokens"],
            "cache": r.headers.get("x-tokenmill-cache"),
            "e2e": e2e,
        }
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as r:
        status = r.headers.get("x-tokenmill-cache")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t,
        "tokens": tokens,
        "cache": status,
        "e2e": time.perf_counter() - t,
    }


async def run(
    url: str, key: str, questions: list[str], cached: bool, concurrency: int, max_tokens: int, stream: bool = True
) -> dict:
    queue = list(enumerate(questions))
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def worker() -> None:
            while queue:
                _, q = queue.pop(0)
                results.append(await one(client, key, q, cached, max_tokens, stream))

        t = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000,
        "hit_rate": sum(r["cache"] == "hit" for r in results) / len(results),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--no-stream", action="store_true", help="whole answers (TTFT = latency; twins in flight wait)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    keys = [f"tenant-{i}" for i in range(args.rounds + 1)]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "serve",
        "--port",
        str(port),
        "--response-cache",
        "exact",
        *[a for k in keys for a in ("--api-key", k)],
    ]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        questions = workload(args.requests)
        asyncio.run(run(url, keys[-1], questions[:8], False, args.concurrency, args.max_tokens))  # warm up
        runs: dict[str, list[dict]] = {"off": [], "exact": []}
        for r in range(args.rounds):
            order = ("off", "exact") if r % 2 == 0 else ("exact", "off")
            for mode in order:
                res = asyncio.run(
                    run(url, keys[r], questions, mode == "exact", args.concurrency, args.max_tokens, not args.no_stream)
                )
                runs[mode].append(res)
                print(
                    f"round {r + 1} {mode:5s}: {res['requests_per_s']:.2f} req/s, {res['output_tok_per_s']:.0f} tok/s, "
                    f"TTFT p50 {res['ttft_p50_ms']:.0f} ms p99 {res['ttft_p99_ms']:.0f} ms, hits {res['hit_rate']:.0%}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    def mean(mode: str, field: str) -> float:
        return statistics.fmean(x[field] for x in runs[mode])

    distinct = len(set(questions))
    summary = {
        mode: {
            f: mean(mode, f) for f in ("requests_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "hit_rate")
        }
        for mode in runs
    }
    result = {
        "cpu": cpu_info().describe(),
        "stream": not args.no_stream,
        "requests": args.requests,
        "distinct_questions": distinct,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "runs": runs,
    }
    print(
        f"CPU: {result['cpu']}; {args.requests} requests, {distinct} distinct questions, concurrency {args.concurrency}"
    )
    print(f"{'':7s} {'req/s':>7s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'hits':>5s}")
    for mode, s in summary.items():
        print(
            f"{mode:7s} {s['requests_per_s']:7.2f} {s['output_tok_per_s']:7.0f} {s['ttft_p50_ms']:7.0f}ms "
            f"{s['ttft_p99_ms']:7.0f}ms {s['hit_rate']:5.0%}"
        )
    print(
        f"with the cache: {summary['exact']['requests_per_s'] / summary['off']['requests_per_s']:.2f}x the requests/s"
    )
    RESULTS.mkdir(exist_ok=True)
    out = args.out or ("response_cache_whole" if args.no_stream else "response_cache")
    (RESULTS / f"{out}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
