"""Plain traffic under hostile load (issue 24, items 2 and 3), a same-run A/B of checkouts:

    python bench/hostile_load.py --checkouts /tmp/before . --rounds 2

For each checkout (in turn, ``--rounds`` times), a `tokenmill serve` of that checkout
(PYTHONPATH) on the default model, and two measurements:

1. event-loop stalls: ``/health`` polled every 50 ms, idle and then while four clients
   each POST a 2 MB prompt to ``/tokenize`` (the tokenising must not hold the loop);
2. compile storms: a plain streamed chat's time to first token, idle (8 in a row) and
   then while 16 requests with distinct 3,000-property JSON schemas compile (compiles
   must not queue plain requests, nor starve the steps).

Writes results/hostile_load.json and results/hostile_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from soak import free_port, log  # noqa: E402 - a sibling script


def start(checkout: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--kv-cache-memory", "512MiB"]
    proc = subprocess.Popen(cmd, env=env, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{checkout}: the server did not start")


async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t0 = time.perf_counter()
        await client.get("/health")
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    return out


async def ttft(client: httpx.AsyncClient, text: str) -> float:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def schema(tag: int, n: int = 3000) -> dict:
    props = {f"k{tag}_{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


async def measure(url: str, prompt_2mb: str) -> dict:
    res: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await ttft(client, "warm up")
        stop = asyncio.Event()
        poll = asyncio.create_task(poll_health(client, stop))
        await asyncio.sleep(2)
        stop.set()
        res["health_idle_s"] = await poll
        stop = asyncio.Event()
        poll = asyncio.create_task(poll_health(client, stop))
        await asyncio.sleep(0.2)
        tok = [client.post("/tokenize", json={"prompt": prompt_2mb}) for _ in range(4)]
        statuses = [r.status_code for r in await asyncio.gather(*tok)]
        stop.set()
        res["health_during_tokenize_s"] = await poll
        res["tokenize_statuses"] = statuses

        res["ttft_idle_s"] = [await ttft(client, f"Say hello ({i})") for i in range(8)]
        storm = [
            asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "Fill in the JSON."}],
                        "max_tokens": 16,
                        "guided_json": schema(i + int(time.time())),
                    },
                )
            )
            for i in range(16)
        ]
        during, t0 = [], time.perf_counter()
        while not all(s.done() for s in storm):
            during.append(await ttft(client, f"Say hello ({len(during)})"))
            await asyncio.sleep(0.2)
        res["storm_s"] = time.perf_counter() - t0
        res["storm_statuses"] = sorted(s.result().status_code for s in storm)
        res["ttft_during_storm_s"] = during
    return res


def summary(res: dict) -> dict:
    def p50(x):
        return round(statistics.median(x), 3) if x else None

    return {
        "health_idle_p50_s": p50(res["health_idle_s"]),
        "health_idle_max_s": round(max(res["health_idle_s"]), 3),
        "health_during_tokenize_p50_s": p50(res["health_during_tokenize_s"]),
        "health_during_tokenize_max_s": round(max(res["health_during_tokenize_s"]), 3),
        "ttft_idle_p50_s": p50(res["ttft_idle_s"]),
        "ttft_during_storm_p50_s": p50(res["ttft_during_storm_s"]),
        "ttft_during_storm_max_s": round(max(res["ttft_during_storm_s"]), 3) if res["ttft_during_storm_s"] else None,
        "storm_s": round(res["storm_s"], 1),
        "storm_statuses": res["storm_statuses"],
        "tokenize_statuses": res["tokenize_statuses"],
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = [f"{r['label']}\n(round {r['round']})" for r in runs]
    x = range(len(runs))
    a.bar([i - 0.2 for i in x], [r["summary"]["health_idle_max_s"] for r in runs], 0.4, label="idle")
    a.bar(
        [i + 0.2 for i in x],
        [r["summary"]["health_during_tokenize_max_s"] for r in runs],
        0.4,
        label="during 4 x 2 MB /tokenize",
    )
    a.set_xticks(list(x), names)
    a.set_ylabel("slowest /health (s)")
    a.set_title("Event-loop stalls")
    a.legend()
    b.bar([i - 0.27 for i in x], [r["summary"]["ttft_idle_p50_s"] for r in runs], 0.27, label="idle (p50)")
    b.bar(
        list(x),
        [r["summary"]["ttft_during_storm_p50_s"] for r in runs],
        0.27,
        label="during 16 big-schema compiles (p50)",
    )
    b.bar(
        [i + 0.27 for i in x],
        [r["summary"]["ttft_during_storm_max_s"] for r in runs],
        0.27,
        label="during them (max: the first, sent with the 16 bodies)",
    )
    b.set_xticks(list(x), names)
    b.set_ylabel("plain chat time to first token (s)")
    b.set_title("Compile storms")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", nargs="+", default=["."])
    ap.add_argument("--labels", nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    labels = args.labels or args.checkouts
    text = (HERE / "prompt.txt").read_text()
    prompt_2mb = (text * (2_000_000 // len(text) + 1))[:2_000_000]
    runs = []
    for rnd in range(args.rounds):
        for checkout, label in zip(args.checkouts, labels, strict=True):
            port = free_port()
            proc = start(Path(checkout), port)
            try:
                log(f"{label} (round {rnd + 1}): measuring")
                res = asyncio.run(measure(f"http://127.0.0.1:{port}", prompt_2mb))
            finally:
                proc.terminate()
                proc.wait(60)
            runs.append(
                {"label": label, "checkout": str(checkout), "round": rnd + 1, "summary": summary(res), "raw": res}
            )
            log(json.dumps(runs[-1]["summary"]))
    from step_overhead import cpu_info

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile_load.json").write_text(
        json.dumps({"cpu": cpu_info(), "command": " ".join(sys.argv), "runs": runs}, indent=1)
    )
    plot(runs, RESULTS / "hostile_load.png")
    print(json.dumps([{"label": r["label"], **r["summary"]} for r in runs], indent=1))


if __name__ == "__main__":
    main()
