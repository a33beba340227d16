"""`tokenmill bench serve`: load-test any OpenAI-compatible server.

Sends a workload at one or more request rates (Poisson arrivals) or at a fixed
concurrency, streams every response, and reports request and token throughput,
TTFT, TPOT, inter-token latency and end-to-end latency (mean, p50, p90, p99) and
goodput under SLOs, as JSON and PNG plots. It speaks plain OpenAI (/v1/completions
with text prompts), so it measures vLLM or llama.cpp's server exactly as it measures
ours. ``--trace`` also asks a tokenmill server for its per-request timings and draws
a Gantt chart of each request's queued, prefill and decode phases.

    tokenmill bench serve --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2,inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.engine.stats import percentiles
from tokenmill.loadgen.energy_probe import EnergyProbe, run_energy

WORDS = (
    "the mill river water stone wheel grain flour miller village valley bridge road market town farm field "
    "harvest season winter summer morning evening light shadow engine power steam iron wood rope gear shaft "
    "people family house door window garden tree forest hill mountain cloud rain wind storm story history "
    "year century change work trade price money coin letter book page word question answer reason idea plan "
    "and of to in on with from for by at as that which when while because although after before under over "
    "slowly quickly often never always again still already perhaps almost nearly together alone quiet loud"
).split()


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
    return " ".join(out) + "."


def synthetic(name: str, n: int, seed: int) -> list[dict]:
    """mixed: prompts of ~16..900 tokens (log-uniform words), 16..128 output tokens;
    shared-prefix: one ~700-token system text before each short question, 32 tokens."""
    rng = random.Random(seed)
    if name == "mixed":
        return [
            {
                "prompt": _text(rng, int(math.exp(rng.uniform(math.log(12), math.log(700))))),
                "max_tokens": rng.randint(16, 128),
            }
            for _ in range(n)
        ]
    if name == "shared-prefix":
        system = _text(random.Random(seed + 1), 520)
        return [{"prompt": f"{system}\n\nQuestion {i}: {_text(rng, 12)}\nAnswer:", "max_tokens": 32} for i in range(n)]
    raise ValueError(f"unknown dataset {name!r}")


def load_jsonl(path: str) -> list[dict]:
    """One ``{prompt, max_tokens}`` per line (max_tokens 64 where absent); a line that is
    not one is a ValueError naming the file and the line, not a KeyError from deep inside."""
    reqs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                r = json.loads(line)
                reqs.append({"prompt": r["prompt"], "max_tokens": int(r.get("max_tokens", 64))})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{path}:{n}: expected a JSON object with a prompt ({type(e).__name__}: {e})"
                ) from None
    return reqs


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str | None = None
    timings: dict | None = None  # the server's own, with --trace (tokenmill only)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client, url: str, model: str, req: dict, headers: dict, trace: bool) -> RequestResult:
    body = {
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if trace:
        body["return_timings"] = True
    res = RequestResult(ok=False, start=time.perf_counter())
    last = res.start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"])
                    return res
                if trace and isinstance(data.get("timings"), list) and data["timings"]:
                    res.timings = data["timings"][0]  # ours, asked for; other servers send their own shapes
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                if any(c.get("text") for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.ttft is not None
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    base_url: str,
    model: str,
    reqs: list[dict],
    rate: float,
    concurrency: int | None,
    api_key: str | None,
    trace: bool,
    seed: int,
) -> tuple[list[RequestResult], float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    done = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def one(req: dict) -> RequestResult:
            nonlocal done
            if sem is None:
                r = await send(client, url, model, req, headers, trace)
            else:
                async with sem:
                    r = await send(client, url, model, req, headers, trace)
            done += 1
            print(f"\r  {done}/{len(reqs)} requests done", end="", file=sys.stderr, flush=True)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    print(file=sys.stderr)
    return list(results), elapsed


def summarise(results: list[RequestResult], elapsed: float, rate: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        "goodput_req_s": len(good) / elapsed,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def _fmt(p: dict, scale: float = 1000) -> str:
    return "  ".join(f"{k} {v * scale:.0f}" for k, v in p.items() if v is not None) or "-"


def report(s: dict) -> None:
    print(
        f"rate {s['request_rate']} req/s: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f} s | "
        f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
        f"goodput {s['goodput_req_s']:.2f} req/s",
        file=sys.stderr,
    )
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        print(f"    {key[:-2]:5s} ms: {_fmt(s[key])}", file=sys.stderr)
    e, c = s.get("energy"), s.get("cost")
    if e:
        per_token = e["joules_per_output_token"]
        print(
            f"    energy ({e['source']}, {e['how']}): {e['joules']:.1f} J, {e['watts']} W, "
            + (f"{per_token:.3f} J per output token" if per_token is not None else "no output tokens"),
            file=sys.stderr,
        )
    if c and c["dollars_per_million_output_tokens"] is not None:
        print(
            f"    cost at ${c['price_per_hour']}/h: ${c['dollars_per_million_output_tokens']:.2f} per 1M output "
            f"tokens, ${c['dollars_per_million_tokens']:.2f} per 1M tokens (input + output)",
            file=sys.stderr,
        )


def plot(runs: list[dict], raw: dict[str, list[RequestResult]], out: Path, label: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    files = []
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for rate, results in raw.items():
        ok = [r for r in results if r.ok]
        series = {
            "TTFT": [r.ttft for r in ok],
            "TPOT": [r.tpot for r in ok if r.tpot is not None],
            "ITL": [x for r in ok for x in r.itl],
            "E2E": [r.e2e for r in ok],
        }
        for ax, (name, xs) in zip(axes, series.items(), strict=True):
            xs = sorted(xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{rate} req/s")
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("seconds")
    axes[0].set_ylabel("fraction of requests")
    axes[-1].legend(fontsize=7)
    fig.suptitle(label)
    fig.tight_layout()
    path = out / f"{label}_latency_cdf.png"
    fig.savefig(path, dpi=110)
    files.append(str(path))
    path = _plot_energy(plt, runs, out, label)
    if path:
        files.append(path)
    finite = [r for r in runs if r["request_rate"] != "inf"]
    if len(finite) > 1:
        fig, ax1 = plt.subplots(figsize=(6.5, 4))
        rates = [r["request_rate"] for r in finite]
        ax1.plot(rates, [r["output_token_throughput"] for r in finite], "o-", color="C0")
        ax1.set_xlabel("request rate (req/s)")
        ax1.set_ylabel("output tokens/s", color="C0")
        ax2 = ax1.twinx()
        ax2.plot(rates, [r["ttft_s"]["p99"] for r in finite], "s--", color="C3")
        ax2.set_ylabel("p99 TTFT (s)", color="C3")
        ax1.set_title(label)
        fig.tight_layout()
        path = out / f"{label}_rate_sweep.png"
        fig.savefig(path, dpi=110)
        files.append(str(path))
    return files


def _plot_energy(plt, runs: list[dict], out: Path, label: str) -> str | None:
    """Joules per output token (and $ per 1M output tokens with a price) at each rate."""
    per_token = [r["energy"]["joules_per_output_token"] for r in runs if r.get("energy")]
    if not per_token or any(x is None for x in per_token):
        return None
    names = [str(r["request_rate"]) for r in runs]
    costs = [(r.get("cost") or {}).get("dollars_per_million_output_tokens") for r in runs]
    fig, axes = plt.subplots(1, 2 if all(c is not None for c in costs) else 1, figsize=(10, 3.8), squeeze=False)
    source = runs[0]["energy"]["source"]
    axes[0][0].bar(names, per_token, color="C2")
    axes[0][0].set_title(f"energy per output token ({source})")
    axes[0][0].set_xlabel("request rate (req/s)")
    axes[0][0].set_ylabel("J / token")
    if axes.shape[1] == 2:
        axes[0][1].bar(names, costs, color="C1")
        axes[0][1].set_title(f"cost at ${runs[0]['cost']['price_per_hour']}/h")
        axes[0][1].set_xlabel("request rate (req/s)")
        axes[0][1].set_ylabel("$ per 1M output tokens")
    fig.suptitle(label)
    fig.tight_layout()
    path = out / f"{label}_energy_cost.png"
    fig.savefig(path, dpi=110)
    return str(path)


def plot_trace(results: list[RequestResult], path: Path, title: str) -> bool:
    rows = [r.timings for r in results if r.timings and r.timings.get("finished")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows.sort(key=lambda t: t["arrival"])
    t0 = rows[0]["arrival"]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.12 * len(rows) + 1)))
    for i, t in enumerate(rows):
        sched = t["first_scheduled"] or t["finished"]
        first = t["first_token"] or t["finished"]
        ax.barh(i, sched - t["arrival"], left=t["arrival"] - t0, color="#cccccc", height=0.8)
        ax.barh(i, first - sched, left=sched - t0, color="#e4572e", height=0.8)
        ax.barh(i, t["finished"] - first, left=first - t0, color="#29335c", height=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first arrival (server clock)")
    ax.set_ylabel("request (by arrival)")
    ax.set_title(title)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="#cccccc", label="queued"),
            Patch(color="#e4572e", label="prefill"),
            Patch(color="#29335c", label="decode"),
        ],
        loc="lower right",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.configuration.flag_types import (
        NON_NEGATIVE_FLOAT,
        POSITIVE_FLOAT,
        POSITIVE_INT,
        NumberList,
        existing_file,
    )

    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--dataset", choices=["mixed", "shared-prefix"], default="mixed")
    p.add_argument(
        "--dataset-path", type=existing_file, default=None, help="JSONL of {prompt, max_tokens} (overrides --dataset)"
    )
    p.add_argument("--num-prompts", type=POSITIVE_INT, default=64)
    p.add_argument(
        "--request-rate",
        type=NumberList(POSITIVE_FLOAT, allow_inf=True),
        default="inf",
        help="req/s, comma-separated for a sweep; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=POSITIVE_INT, default=None, help="at most this many requests in flight")
    p.add_argument("--slo-ttft", type=POSITIVE_FLOAT, default=2.0, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-tpot", type=POSITIVE_FLOAT, default=0.25, help="goodput SLO on TPOT, seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="Gantt chart of request lifetimes (tokenmill servers)")
    p.add_argument("--label", default="bench_serve", help="file name stem of the outputs")
    p.add_argument("--output-dir", default=".", help="where the JSON and PNGs go")
    p.add_argument(
        "--price-per-hour",
        type=NON_NEGATIVE_FLOAT,
        default=None,
        help="the server machine's $ per hour: reports $ per 1M tokens",
    )
    p.add_argument(
        "--watts-per-cpu",
        type=POSITIVE_FLOAT,
        default=None,
        help="a server that exports no energy: estimate this machine's as W per busy CPU (default: RAPL, else 3 W)",
    )


def _model_id(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def warm_up(base_url: str, model: str, api_key: str | None) -> None:
    """One short request first, so that no measured request pays for a cold server."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": "Hello", "max_tokens": 2}
    httpx.post(base_url.rstrip("/") + "/v1/completions", json=body, headers=headers, timeout=300)


def workload(args: argparse.Namespace, rate: float) -> list[dict]:
    """The requests of one run. Synthetic prompts are drawn afresh for each rate (same
    distribution, a seed derived from --seed and the rate): a server's prefix cache
    would otherwise serve every run after the first from the prompts of the one
    before. Two servers measured at the same rate get the same prompts."""
    if args.dataset_path:
        return load_jsonl(args.dataset_path)[: args.num_prompts]
    return synthetic(args.dataset, args.num_prompts, args.seed + (round(rate * 1000) if math.isfinite(rate) else 10**9))


def run(args: argparse.Namespace) -> int:
    model = args.model or _model_id(args.base_url, args.api_key)
    warm_up(args.base_url, model, args.api_key)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in str(args.request_rate).split(",")]
    runs, raw = [], {}
    probe = EnergyProbe(args.base_url, args.api_key, args.watts_per_cpu)
    for rate in rates:
        reqs = workload(args, rate)
        print(
            f"{len(reqs)} requests at {rate} req/s"
            + (f", concurrency {args.max_concurrency}" if args.max_concurrency else ""),
            file=sys.stderr,
        )
        before = probe.read()
        results, elapsed = asyncio.run(
            run_load(args.base_url, model, reqs, rate, args.max_concurrency, args.api_key, args.trace, args.seed)
        )
        summary = summarise(results, elapsed, rate, args.slo_ttft, args.slo_tpot)
        prompt_tokens = sum(r.prompt_tokens for r in results if r.ok)
        summary.update(run_energy(before, probe.read(), summary, prompt_tokens, args.price_per_hour))
        report(summary)
        runs.append(summary)
        raw[str(summary["request_rate"])] = results
        if args.trace and plot_trace(
            results,
            out / f"{args.label}_trace_{summary['request_rate']}.png",
            f"{args.label}: {summary['request_rate']} req/s",
        ):
            summary["trace_png"] = str(out / f"{args.label}_trace_{summary['request_rate']}.png")
    result = {
        "base_url": args.base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "dataset": args.dataset_path or args.dataset,
        "max_concurrency": args.max_concurrency,
        "runs": runs,
        "requests": {rate: [asdict(r) for r in rs] for rate, rs in raw.items()},
    }
    result["plots"] = plot(runs, raw, out, args.label)
    path = out / f"{args.label}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"runs": runs, "plots": result["plots"], "json": str(path)}, indent=1))
    return 0 if all(r["failed"] == 0 for r in runs) else 1
