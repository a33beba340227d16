"""Engine replicas on Ray Serve (issue 26): routing, Ray's overhead, disaggregation.

    python bench/replicas.py routing   [--chats 32 --turns 3 --concurrency 8] [--policies kv@128,kv --no-single]
    python bench/replicas.py overhead  [--requests 48]
    python bench/replicas.py disagg    [--decoders 6 --long-prompts 12]
    python bench/replicas.py autoscale

Every Ray run is on a local two-"node" cluster (``ray start --head`` plus a second
``ray start --address`` on loopback, one CPU each, token auth as Ray 2.6x sets it up),
the server joining it through RAY_ADDRESS, one engine replica per node (``routing
--local-ray``: a one-node Ray each server starts itself, for a machine shared with
other Ray users: the cluster's ``ray stop --force`` ends all of them).

routing: a private workload of several long system prompts shared by many multi-turn
chats (each turn's prompt is the system prompt, the chat so far and a new question;
the assistant's turns are the server's own answers, so every follow-up extends a
prefix some replica computed). Sessions run ``--concurrency`` at a time. Each replica's
KV cache holds about half the system prompts (``--kv-cache-memory``): routing decides
whether the pair's caches act as one cache of twice the size or as two copies. For one
replica (plain ``tokenmill serve``, both cores, the pair's total KV memory) and for two
replicas routed by ``kv``, ``pow2`` and ``round-robin`` (``--policies``; ``kv@128``: kv
routing at a fixed price of load, ``--route-load-cost 128``, instead of the one each
replica measures): prefix-hit rate (from the replicas' /metrics), TTFT p50/p99,
throughput, and each replica's price of load. Each system prompt is sent once, one at a
time, before the measured chats (a service that has been running; ``--cold``: not).

overhead: one replica behind Ray (``--ray``, two torch threads, and one) against plain
``tokenmill serve``: TTFT and throughput of the same streamed completions, rounds
alternating, and the CPU seconds every process used meanwhile.

disagg: decoders stream long answers while long prompts arrive; colocated (two
replicas, ``kv`` routing) against disaggregated (one prefill replica, one decode
replica): the decoders' inter-token latency p50/p99, token identity of the answers,
KV bytes moved per request and the transfer time.

Writes bench/results/replicas_<mode>.json (and a PNG each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))
from tokenmill.engine.stats import percentiles  # noqa: E402
from tokenmill.kernels.cpu import cpu_info  # noqa: E402

RAY_PORT = 6391
WORDS = (
    "cache block token prefill decode replica router latency memory batch request stream model layer "
    "attention kernel vector matrix server client queue schedule chunk prompt answer question system "
    "policy cluster node object store transfer hash prefix session turn window budget"
).split()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ----------------------------------------------------------------- a Ray cluster


def ray_env() -> dict:
    """The nodes' environment: the replicas (started by the nodes' raylets) import this
    checkout's tokenmill, as the server does."""
    return {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "PYTHONPATH": str(HERE.parent),
        "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),
    }  # Ray's 15 lets its processes preempt the engines


def ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


def start_cluster() -> str:
    """Two nodes on loopback, one CPU each; returns RAY_ADDRESS."""
    subprocess.run([ray_bin(), "stop", "--force"], env=ray_env(), capture_output=True)
    subprocess.run(
        [
            ray_bin(),
            "start",
            "--head",
            "--num-cpus",
            "1",
            "--port",
            str(RAY_PORT),
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        ],
        env=ray_env(),
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [ray_bin(), "start", "--address", f"127.0.0.1:{RAY_PORT}", "--num-cpus", "1"],
        env=ray_env(),
        check=True,
        capture_output=True,
    )
    return f"127.0.0.1:{RAY_PORT}"


def stop_cluster() -> None:
    subprocess.run([ray_bin(), "stop", "--force"], env=ray_env(), capture_output=True)


class Server:
    def __init__(self, flags: list[str], ray_address: str | None, port: int = 8190) -> None:
        self.url = f"http://127.0.0.1:{port}"
        env = ray_env()
        if ray_address:
            env["RAY_ADDRESS"] = ray_address
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--served-model-name", "m", *flags]
        self.log_path = RESULTS / "replicas_server.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log_path.open("w"))
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.start_s = time.perf_counter() - start
        log(f"  server {' '.join(flags) or '(plain)'} up in {self.start_s:.1f} s")

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, summed over replicas per metric name."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("tokenmill:"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def per_replica(self, name: str) -> dict[str, float]:
        """replica -> value of a metric labelled by replica (the last pool's, if several)."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and 'replica="' in line:
                out[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ requests


async def stream_chat(
    client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, ignore_eos: bool = False
) -> dict:
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
    }
    start = time.perf_counter()
    first, parts, gaps, last = None, [], [], start
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(str(data["error"]))
            delta = data["choices"][0]["delta"].get("content") if data.get("choices") else None
            if delta:
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    gaps.append(now - last)
                last = now
                parts.append(delta)
    return {
        "ttft": first,
        "text": "".join(parts),
        "e2e": time.perf_counter() - start,
        "gaps": gaps,
        "chunks": len(parts),
    }


def chat_workload(seed: int, systems: int, chats: int, turns: int, system_words: int) -> list[tuple[str, list[str]]]:
    """(system prompt, the user's questions) per chat: a few long system prompts, each
    shared by many chats."""
    rng = random.Random(seed)
    prompts = [f"You are assistant {i}. Rules: " + text(rng, system_words) for i in range(systems)]
    return [
        (prompts[c % systems], [f"Question {t} of chat {c}: " + text(rng, 40) for t in range(turns)])
        for c in range(chats)
    ]


async def run_chats(url: str, workload, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def session(system: str, questions: list[str]) -> None:
            async with sem:
                messages = [{"role": "system", "content": system}]
                for q in questions:
                    messages.append({"role": "user", "content": q})
                    r = await stream_chat(client, url, messages, max_tokens)
                    results.append(r)
                    messages.append({"role": "assistant", "content": r["text"]})
                    print(f"\r  {len(results)} turns done", end="", file=sys.stderr, flush=True)

        start = time.perf_counter()
        await asyncio.gather(*(session(s, qs) for s, qs in workload))
        elapsed = time.perf_counter() - start
    print(file=sys.stderr)
    return results, elapsed


# ------------------------------------------------------------------ routing


def routing(args: argparse.Namespace) -> dict:
    workload = chat_workload(0, args.systems, args.chats, args.turns, args.system_words)
    warm = chat_workload(1, 1, 2, 1, 50)
    if not args.cold:  # the service has been running: each system prompt was seen once before
        warm += [(system, ["Hello."]) for system in dict.fromkeys(s for s, _ in workload)]
    kv = ["--kv-cache-memory", args.kv_cache_memory]
    modes = {"one replica": (["--kv-cache-memory", args.single_kv_cache_memory], None)} if args.single else {}
    disk_dirs = []
    for policy in filter(None, args.policies.split(",")):
        routing_name, _, load_cost = policy.partition("@")  # kv@128: a fixed price of load
        routing_name, disk, _ = routing_name.partition("+disk")  # kv+disk: the replicas share a disk tier
        fixed = ["--route-load-cost", load_cost] if load_cost else []
        if disk:
            disk_dirs.append(tempfile.mkdtemp(prefix="kv_disk_"))
            fixed += ["--kv-disk-cache", disk_dirs[-1]]
        modes[f"2 replicas, {policy}"] = (
            ["--data-parallel-size", "2", "--routing", routing_name, *fixed, *kv],
            "cluster",
        )
    address = None if args.local_ray else start_cluster()  # None: each server starts its own
    runs = {}
    try:
        for name, (flags, ray) in modes.items():
            log(f"{name}")
            server = Server(flags, address if ray else None)
            try:
                asyncio.run(run_chats(server.url, warm, 1, 8))
                before = server.metrics()
                start_costs = server.per_replica("tokenmill:router_load_cost_tokens")  # before the answers' mean
                results, elapsed = asyncio.run(run_chats(server.url, workload, args.concurrency, args.max_tokens))
                time.sleep(1.0)  # the replicas' last reports
                after = server.metrics()
                load_costs = server.per_replica("tokenmill:router_load_cost_tokens")
            finally:
                server.stop()
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            hits, queries = (
                d.get("tokenmill:prefix_cache_hits_total", 0),
                d.get("tokenmill:prefix_cache_queries_total", 0),
            )
            runs[name] = {
                "flags": flags,
                "turns": len(results),
                "elapsed_s": elapsed,
                "prefix_hit_rate": hits / queries if queries else 0.0,
                "prompt_tokens": queries,
                "requests_per_s": len(results) / elapsed,
                "output_tokens_per_s": sum(r["chunks"] for r in results) / elapsed,
                "ttft_s": percentiles([r["ttft"] for r in results if r["ttft"] is not None]),
                "router_decisions": {k: v for k, v in d.items() if k.startswith("tokenmill:router_decisions")},
                "predicted_hit_blocks": d.get("tokenmill:router_predicted_hit_blocks_total"),
                "realised_hit_tokens": d.get("tokenmill:router_realised_hit_tokens_total"),
                "server_start_s": server.start_s,
                "load_cost_tokens_before": start_costs,
                "load_cost_tokens": load_costs,
            }
            r = runs[name]
            log(
                f"  hit rate {r['prefix_hit_rate']:.3f}  TTFT p50 {r['ttft_s']['p50'] * 1000:.0f} ms  "
                f"p99 {r['ttft_s']['p99'] * 1000:.0f} ms  {r['requests_per_s']:.2f} req/s  "
                f"load price {start_costs or '-'} -> {load_costs or '-'}"
            )
    finally:
        if not args.local_ray:
            stop_cluster()
        for d in disk_dirs:
            shutil.rmtree(d, ignore_errors=True)
    return {
        "workload": {
            "cold": args.cold,
            "systems": args.systems,
            "system_words": args.system_words,
            "chats": args.chats,
            "policies": args.policies,
            "local_ray": args.local_ray,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "kv_cache_memory": args.kv_cache_memory,
            "single_kv_cache_memory": args.single_kv_cache_memory,
        },
        "runs": runs,
    }


def plot_routing(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["runs"])
    runs = [result["runs"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["prefix_hit_rate"] for r in runs], color="tab:blue")
    axes[0].set_title("prefix-cache hit rate")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_s"]["p50"] * 1000 for r in runs], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_s"]["p99"] * 1000 for r in runs], 0.4, label="p99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("time to first token (ms)")
    axes[1].legend()
    axes[2].bar(names, [r["requests_per_s"] for r in runs], color="tab:green")
    axes[2].set_title("turns per second")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"multi-turn chats sharing system prompts, routed over replicas ({result['cpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ overhead


async def run_completions(url: str, n: int, concurrency: int, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    prompts = [text(rng, 120) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    results = []
    async with httpx.AsyncClient(timeout=None) as client:

        async def one(p: str) -> None:
            async with sem:
                results.append(await stream_chat(client, url, [{"role": "user", "content": p}], 64))

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return results, time.perf_counter() - start


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) every process has used, by a short name: where the
    cores went during a measurement (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = _process_name(cmd)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _process_name(cmd: str) -> str:
    if "spawn_main" in cmd:
        return "engine core (spawned)"
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]
    for key, name in (
        ("tokenmill serve", "tokenmill serve (front / API)"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs_server"),
        ("replicas.py", "benchmark client"),
    ):
        if key in cmd:
            return name
    return "other"


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    used = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}
    return dict(sorted(((k, v) for k, v in used.items() if v >= 0.05), key=lambda kv: -kv[1]))


def overhead(args: argparse.Namespace) -> dict:
    modes = {
        "plain tokenmill serve": ([], None),
        "one replica on Ray Serve": (["--ray", "--replica-threads", "2", "--replica-cpus", "1"], "cluster"),
        "one replica on Ray Serve, 1 thread": (["--ray", "--replica-threads", "1", "--replica-cpus", "1"], "cluster"),
    }
    address = start_cluster()
    runs = {}
    try:
        for rnd in range(args.rounds):
            for name, (flags, ray) in modes.items():
                server = Server(flags, address if ray else None)
                try:
                    asyncio.run(run_completions(server.url, 16, args.concurrency, 99))  # warm: every batch shape
                    before = cpu_seconds()
                    results, elapsed = asyncio.run(run_completions(server.url, args.requests, args.concurrency, rnd))
                    cpu = cpu_used(before, cpu_seconds())
                finally:
                    server.stop()
                run = runs.setdefault(name, {"ttft": [], "tok_s": [], "start_s": [], "cpu_s": []})
                run["cpu_s"].append({"elapsed_s": round(elapsed, 2), **cpu})
                run["ttft"] += [r["ttft"] for r in results]
                run["tok_s"].append(sum(r["chunks"] for r in results) / elapsed)
                run["start_s"].append(server.start_s)
                log(
                    f"  {name}: {run['tok_s'][-1]:.1f} tok/s, TTFT p50 "
                    f"{percentiles([r['ttft'] for r in results])['p50'] * 1000:.0f} ms"
                )
    finally:
        stop_cluster()
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "runs": {
            n: {
                "ttft_s": percentiles(r["ttft"]),
                "output_tokens_per_s": r["tok_s"],
                "mean_output_tokens_per_s": sum(r["tok_s"]) / len(r["tok_s"]),
                "server_start_s": r["start_s"],
                "cpu_seconds_by_process": r["cpu_s"],
            }
            for n, r in runs.items()
        },
    }


# ------------------------------------------------------------------ disaggregation


def disagg(args: argparse.Namespace) -> dict:
    rng = random.Random(7)
    decoders = [f"Decoder {i}: write a long story about " + text(rng, 12) for i in range(args.decoders)]
    longs = [f"Long prompt {i}: " + text(rng, args.long_words) + " Summarise." for i in range(args.long_prompts)]
    modes = {
        "colocated (2 replicas, kv)": ["--data-parallel-size", "2"],
        "disaggregated (1 prefill + 1 decode)": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    }
    address = start_cluster()
    runs, texts = {}, {}
    try:
        for name, flags in modes.items():
            # float32: batch-invariant, so that the two modes' greedy answers can be compared token for token
            server = Server([*flags, "--kv-cache-memory", "512MiB", "--dtype", "float32"], address)
            try:
                asyncio.run(run_completions(server.url, 2, 2, 98))
                before = server.metrics()
                dec, lng = asyncio.run(_interference(server.url, decoders, longs, args))
                time.sleep(1.0)
                after = server.metrics()
            finally:
                server.stop()
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            moved = d.get("tokenmill:kv_transfer_requests_total", 0.0)
            runs[name] = {
                "decoder_itl_s": percentiles([g for r in dec for g in r["gaps"]]),
                "decoder_tokens_per_s": sum(r["chunks"] for r in dec) / max(r["e2e"] for r in dec),
                "long_prompt_ttft_s": percentiles([r["ttft"] for r in lng]),
                "kv_transfer": None
                if not moved
                else {
                    "requests": moved,
                    "bytes_per_request": d["tokenmill:kv_transfer_bytes_total"] / moved,
                    "blocks_per_request": d["tokenmill:kv_transfer_blocks_total"] / moved,
                    "prefill_s_per_request": d["tokenmill:kv_transfer_prefill_seconds_total"] / moved,
                    "import_s_per_request": d["tokenmill:kv_transfer_import_seconds_total"] / moved,
                    "fallbacks": d.get("tokenmill:kv_transfer_fallbacks_total", 0.0),
                },
            }
            texts[name] = [r["text"] for r in dec + lng]
            itl = runs[name]["decoder_itl_s"]
            log(f"  {name}: decoder ITL p50 {itl['p50'] * 1000:.0f} ms, p99 {itl['p99'] * 1000:.0f} ms")
    finally:
        stop_cluster()
    a, b = texts.values()
    return {
        "decoders": args.decoders,
        "decode_tokens": args.decode_tokens,
        "long_prompts": args.long_prompts,
        "long_prompt_words": args.long_words,
        "runs": runs,
        "identical_answers": a == b,
        "answers_differing": sum(x != y for x, y in zip(a, b, strict=True)),
    }


async def _interference(url: str, decoders: list[str], longs: list[str], args) -> tuple[list[dict], list[dict]]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        dec = [
            asyncio.create_task(stream_chat(client, url, [{"role": "user", "content": p}], args.decode_tokens, True))
            for p in decoders
        ]
        await asyncio.sleep(2.0)  # the decoders are decoding
        lng = []
        for p in longs:
            lng.append(asyncio.create_task(stream_chat(client, url, [{"role": "user", "content": p}], 4)))
            await asyncio.sleep(args.long_interval)
        return list(await asyncio.gather(*dec)), list(await asyncio.gather(*lng))


def plot_disagg(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["runs"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, n in enumerate(names):
        itl = result["runs"][n]["decoder_itl_s"]
        ax.bar([i - 0.2, i + 0.2], [itl["p50"] * 1000, itl["p99"] * 1000], 0.35, color=["tab:blue", "tab:red"])
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("decoders' inter-token latency (ms): p50 blue, p99 red")
    ax.set_title(f"long prompts arriving while {result['decoders']} streams decode ({result['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ autoscaling


def autoscale(args: argparse.Namespace) -> dict:
    """One replica, --max-replicas 2, --target-ongoing-requests 2: eight long streams
    start at once; the time until the second replica reports (it appears in /metrics),
    Ray Serve's autoscaler at its defaults (metrics pushed every 10 s, a 30 s look-back)
    and our upscale delay of 2 s. Scaling down (after 60 s idle) is not waited for."""
    address = start_cluster()
    try:
        server = Server(
            [
                "--data-parallel-size",
                "1",
                "--max-replicas",
                "2",
                "--target-ongoing-requests",
                "2",
                "--replica-threads",
                "1",
            ],
            address,
        )
        try:
            rng = random.Random(3)
            prompts = [f"Stream {i}: write about " + text(rng, 10) for i in range(8)]

            def replicas() -> list[str]:
                names = set()
                for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
                    if line.startswith("tokenmill:num_requests_running{") and 'replica="' in line:
                        names.add(line.split('replica="', 1)[1].split('"', 1)[0])
                return sorted(names)

            async def load() -> dict:
                async with httpx.AsyncClient(timeout=None) as client:
                    start = time.perf_counter()
                    tasks = [
                        asyncio.create_task(
                            stream_chat(client, server.url, [{"role": "user", "content": p}], 4000, True)
                        )
                        for p in prompts
                    ]
                    seen, timeline = None, []
                    while not all(t.done() for t in tasks):
                        now = time.perf_counter() - start
                        names = await asyncio.to_thread(replicas)
                        timeline.append((round(now, 1), len(names)))
                        if seen is None and len(names) >= 2:
                            seen = now
                        if (seen is not None and now > seen + 5) or now > 240:
                            break
                        await asyncio.sleep(0.5)
                    for t in tasks:  # the load has done its part: leaving the streams aborts them
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    return {
                        "second_replica_after_s": seen,
                        "timeline": timeline,
                        "load_duration_s": time.perf_counter() - start,
                    }

            result = asyncio.run(load())
        finally:
            server.stop()
    finally:
        stop_cluster()
    log(f"  second replica serving after {result['second_replica_after_s']} s")
    return {"streams": 8, "max_tokens": 4000, **result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("routing", "overhead", "disagg", "autoscale"))
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--system-words", type=int, default=700)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-cache-memory", default="96MiB", help="per replica")
    p.add_argument("--cold", action="store_true", help="no system prompt seen before the measured chats")
    p.add_argument("--single-kv-cache-memory", default="192MiB", help="the one replica's: the pair's total")
    p.add_argument(
        "--policies",
        default="kv,pow2,round-robin",
        help="routing: the two-replica runs, in order (kv@N: kv routing with --route-load-cost N; kv+disk: "
        "the replicas share a prefix-cache disk tier, --kv-disk-cache, in a fresh directory)",
    )
    p.add_argument(
        "--single",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="routing: also run one plain replica (the reference)",
    )
    p.add_argument("--out", default=None, help="results/<out>.json (default: replicas_<mode>)")
    p.add_argument(
        "--local-ray",
        action="store_true",
        help="routing: each server starts (and stops) a local Ray of "
        "its own, one node, instead of the two-node cluster (whose start and stop end every Ray process "
        "of the machine)",
    )
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decoders", type=int, default=6)
    p.add_argument("--decode-tokens", type=int, default=400)
    p.add_argument("--long-prompts", type=int, default=12)
    p.add_argument("--long-words", type=int, default=900)
    p.add_argument("--long-interval", type=float, default=0.75)
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    cpu = cpu_info()
    modes = {"routing": routing, "overhead": overhead, "disagg": disagg, "autoscale": autoscale}
    result = {"run": modes[args.mode](args)}
    result = {
        "cpu": f"{cpu.model}, {cpu.cores} cores, {cpu.capability}",
        "command": " ".join(sys.argv),
        **result["run"],
    }
    suffix = "_cold" if args.mode == "routing" and args.cold else ""
    name = args.out or f"replicas_{args.mode}{suffix}"
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=1))
    if args.mode == "routing":
        plot_routing(result, RESULTS / f"{name}.png")
    elif args.mode == "disagg":
        plot_disagg(result, RESULTS / "replicas_disagg.png")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
