"""Soak test: a real `tokenmill serve` at saturation for a long while, abused.

    python bench/soak.py [--duration 600] [--concurrency 16] [--port 0]

For `--duration` seconds, `--concurrency` clients keep requests in flight against a
server this script starts (the default model, on 127.0.0.1 only): streamed and
non-streamed completions and chats, `n` from 1 to 4, some clients that hang up
mid-request (streamed or not), and some bad inputs that must get a 4xx. Every 5 s
it samples the server's RSS and its running / waiting / KV-usage gauges. At the end
it waits for the server to go idle and checks that nothing is left: no running
request, KV usage back to zero. Writes results/soak.json and results/soak.png (RSS
over time, p99 latency per minute, load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
RESULTS = HERE / "results"
BAD_BODIES = [
    b'{"prompt": "\\ud800", "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": "16"}',
    b'{"prompt": "hi", "top_k": 9223372036854775808, "top_p": 0.5}',
    b'{"prompt": "hi", "n": 1000000}',
    b'{"prompt": "hi", "logit_bias": {"1": 5}}',
    b'{"prompt": "hi", "max_tokens": 100000000}',
    b'{"messages": [], "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": ',
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"tokenmill:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


class Soak:
    def __init__(self, url: str, duration: float, seed: int) -> None:
        self.url, self.duration, self.rng = url, duration, random.Random(seed)
        self.t0 = time.perf_counter()
        self.done: list[dict] = []  # one row per request

    def body(self) -> tuple[str, dict]:
        r = self.rng
        n = r.choice([1, 1, 1, 2, 3, 4])
        common = {"max_tokens": r.randint(4, 48), "n": n, "temperature": r.choice([0, 0.8]), "seed": r.randint(0, 99),
                  "stream": r.random() < 0.6}  # fmt: skip
        if r.random() < 0.5:
            return "/v1/completions", {"prompt": f"Story {r.randint(0, 10**6)}: once upon a time", **common}
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Say something about {r.random()}"}], **common}

    async def one(self, client: httpx.AsyncClient) -> None:
        r, start = self.rng, time.perf_counter()
        row = {"t": start - self.t0, "kind": "ok"}
        try:
            if r.random() < 0.06:
                row["kind"] = "bad"
                resp = await client.post("/v1/completions", content=r.choice(BAD_BODIES),
                                         headers={"content-type": "application/json"})  # fmt: skip
                row["status"] = resp.status_code
                row["shape_ok"] = resp.status_code >= 400 and set(resp.json().get("error", {})) >= {"message", "type"}
            elif r.random() < 0.1:  # hang up after a moment, streamed or not
                row["kind"] = "disconnect"
                path, body = self.body()
                try:
                    await asyncio.wait_for(client.post(path, json=body), timeout=r.uniform(0.05, 1.5))
                except TimeoutError:
                    pass
                row["status"] = 0
            else:
                path, body = self.body()
                if body["stream"]:
                    async with client.stream("POST", path, json=body) as resp:
                        row["status"] = resp.status_code
                        lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
                    row["complete"] = bool(lines) and lines[-1] == "data: [DONE]"
                else:
                    resp = await client.post(path, json=body)
                    row["status"] = resp.status_code
                    row["complete"] = resp.status_code == 200 and len(resp.json()["choices"]) == body["n"]
        except Exception as e:  # noqa: BLE001 - a failed request is a result
            row["status"], row["error"] = -1, f"{type(e).__name__}: {e}"
        row["latency"] = time.perf_counter() - start
        self.done.append(row)

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while time.perf_counter() - self.t0 < self.duration:
            await self.one(client)


async def run(url: str, args: argparse.Namespace, pid: int) -> dict:
    soak = Soak(url, args.duration, args.seed)
    samples: list[dict] = []

    async def sampler() -> None:
        while True:
            g = await asyncio.to_thread(gauges, url)
            samples.append({"t": time.perf_counter() - soak.t0, "rss_mib": rss_mib(pid), **g})
            await asyncio.sleep(5)

    sampling = asyncio.create_task(sampler())
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        tasks = [asyncio.create_task(soak.client_loop(client)) for _ in range(args.concurrency)]
        last = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(10)
            elapsed = time.perf_counter() - soak.t0
            if elapsed - last >= 60:
                last = elapsed
                log(f"  {elapsed:.0f} s: {len(soak.done)} requests, RSS {samples[-1]['rss_mib']:.0f} MiB")
        await asyncio.gather(*tasks)
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:  # idle: nothing may be left behind
        g = gauges(url)
        if g.get("num_requests_running") == 0 and g.get("kv_cache_usage_perc") == 0:
            break
        await asyncio.sleep(0.5)
    sampling.cancel()
    final = gauges(url)
    return {"rows": soak.done, "samples": samples, "final": final, "final_rss_mib": rss_mib(pid)}


def summarise(res: dict, duration: float) -> dict:
    rows = res["rows"]
    ok = [r for r in rows if r["kind"] == "ok"]
    bad = [r for r in rows if r["kind"] == "bad"]
    per_minute = {}
    for m in range(int(duration // 60) + 1):
        lat = sorted(r["latency"] for r in ok if m * 60 <= r["t"] < (m + 1) * 60 and r.get("complete"))
        if lat:
            per_minute[m] = {"n": len(lat), "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}
    rss = [s["rss_mib"] for s in res["samples"]]
    return {
        "requests": len(rows),
        "completed_ok": sum(1 for r in ok if r.get("complete")),
        "incomplete_or_failed": sum(1 for r in ok if not r.get("complete")),
        "status_5xx_or_error": sum(1 for r in rows if r.get("status", 0) >= 500 or r.get("status") == -1),
        "bad_inputs": len(bad),
        "bad_inputs_4xx_in_openai_shape": sum(1 for r in bad if 400 <= r.get("status", 0) < 500 and r.get("shape_ok")),
        "disconnects": sum(1 for r in rows if r["kind"] == "disconnect"),
        "final_gauges": res["final"],
        "rss_mib_first_min": min(rss[: max(1, len(rss) // 10)]) if rss else None,
        "rss_mib_last": rss[-1] if rss else None,
        "rss_mib_max": max(rss) if rss else None,
        "latency_per_minute": per_minute,
    }


def plot(res: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    s = res["samples"]
    a.plot([x["t"] / 60 for x in s], [x["rss_mib"] for x in s])
    a.set_xlabel("minutes")
    a.set_ylabel("server RSS (MiB)")
    a.set_title("Memory over the soak")
    pm = summary["latency_per_minute"]
    b.plot(list(pm), [v["p99_s"] for v in pm.values()], marker="o", label="p99")
    b.plot(list(pm), [v["p50_s"] for v in pm.values()], marker="o", label="p50")
    b.set_xlabel("minute")
    b.set_ylabel("request latency (s)")
    b.set_title("Latency per minute (completed requests)")
    b.legend()
    c.plot([x["t"] / 60 for x in s], [x.get("num_requests_running", 0) for x in s], label="running")
    c.plot([x["t"] / 60 for x in s], [x.get("num_requests_waiting", 0) for x in s], label="waiting")
    c2 = c.twinx()
    c2.plot([x["t"] / 60 for x in s], [x.get("kv_cache_usage_perc", 0) for x in s], color="grey", alpha=0.6)
    c2.set_ylabel("KV usage (grey)")
    c.set_xlabel("minutes")
    c.set_title("Load")
    c.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--kv-cache-memory", "512MiB",
           "--max-queue", "256", "--served-model-name", "soak"]  # fmt: skip
    server_log = open(RESULTS / "soak_server.log", "w")  # noqa: SIM115 - closed below; a pipe could fill and stall it
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=server_log, text=True)
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        log(f"soak: {args.duration:.0f} s, {args.concurrency} clients against {url}")
        res = asyncio.run(run(url, args, server.pid))
    finally:
        server.terminate()
        code = server.wait(60)
        server_log.close()
    summary = summarise(res, args.duration)
    summary["server_exit_code"] = code
    summary["command"] = " ".join(sys.argv)
    RESULTS.mkdir(exist_ok=True)
    sys.path.insert(0, str(HERE))
    from step_overhead import cpu_info

    (RESULTS / "soak.json").write_text(json.dumps({"cpu": cpu_info(), "summary": summary, "samples": res["samples"]}, indent=1))
    plot(res, summary, RESULTS / "soak.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
