"""`tokenmill tune`: the server settings that meet a latency SLO at the lowest cost per token.

SLO first, tuning second. ``--slo ttft_p99=2s,tpot_p99=100ms`` names the limits (ttft, tpot,
itl or e2e at mean, p50, p90 or p99). A candidate is a set of `tokenmill serve` flags
(batch size, step token budget, KV dtype, speculation, quantisation); for each, a server is
started and `bench serve`'s load is sent at rising request rates until the SLO breaks. What a
candidate is worth is the highest rate at which it met the SLO (its goodput) and the cost of
a million output tokens there: ``--price-per-hour`` times the run's duration over its
tokens, so a candidate that sustains more traffic on the same machine costs less per token;
joules per token come from the server's /metrics (measured or estimated, as it says).

Successive halving instead of a grid: every candidate gets a short probe (``--prompts`` per
rate); the better half is measured again with twice the prompts, from one rate below its
best; and so on until one is left. The defaults are measured in every round beside the
others, so that the last round compares the pick and the defaults on equal runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.lifetime import EXIT_WITH_PARENT_ENV

DEFAULTS = "defaults"
# One change at a time from the defaults (max_num_seqs 64, max_num_batched_tokens 512, KV auto,
# no speculation): the knobs vLLM's auto-tune searches, and the ones this engine adds.
CANDIDATES: dict[str, tuple[str, ...]] = {
    DEFAULTS: (),
    "max-num-seqs 8": ("--max-num-seqs", "8"),
    "max-num-seqs 16": ("--max-num-seqs", "16"),
    "batched-tokens 256": ("--max-num-batched-tokens", "256"),
    "batched-tokens 1024": ("--max-num-batched-tokens", "1024"),
    "kv int8": ("--kv-cache-dtype", "int8"),
    "ngram speculation": ("--speculative", "ngram", "--num-speculative-tokens", "3"),
}
METRICS = ("ttft", "tpot", "itl", "e2e")
RUN_TIMEOUT_FACTOR = 3  # a run longer than 3x (its arrivals + the SLO's longest limit) has broken it
STATS = ("mean", "p50", "p90", "p99")
UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}


@dataclass(frozen=True)
class Slo:
    """Latency limits, in seconds: ``{"ttft_p99": 2.0, "tpot_p99": 0.1}``."""

    limits: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> Slo:
        limits = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(\w+)_(\w+)=([0-9.]+)(ms|s)?", part)
            if not m or m.group(1) not in METRICS or m.group(2) not in STATS:
                raise ValueError(
                    f"--slo {part!r}: expected METRIC_STAT=VALUE[ms|s], METRIC one of {', '.join(METRICS)}, "
                    f"STAT one of {', '.join(STATS)} (e.g. ttft_p99=2s,tpot_p99=100ms)"
                )
            limits[f"{m.group(1)}_{m.group(2)}"] = float(m.group(3)) * UNITS[m.group(4) or ""]
        if not limits:
            raise ValueError("--slo names no limit (e.g. ttft_p99=2s,tpot_p99=100ms)")
        return cls(limits)

    def violations(self, summary: dict) -> list[str]:
        """The limits a bench serve run's summary breaks (failed requests break them all)."""
        if summary["failed"] or not summary["completed"]:
            return [f"{summary['failed']} failed requests"]
        out = []
        for key, limit in self.limits.items():
            metric, stat = key.split("_")
            value = summary[f"{metric}_s"][stat]
            if value is not None and value > limit:
                out.append(f"{key} {value * 1000:.0f} ms > {limit * 1000:.0f} ms")
        return out

    def longest(self) -> float:
        """The longest a request may take within the SLO (ttft + 256 tokens at tpot, or e2e)."""
        lim = self.limits
        by_parts = max((v for k, v in lim.items() if k.startswith("ttft")), default=10.0) + 256 * max(
            (v for k, v in lim.items() if k.startswith(("tpot", "itl"))), default=0.1
        )
        return max([by_parts] + [v for k, v in lim.items() if k.startswith("e2e")])

    def __str__(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in self.limits.items())


@dataclass
class Trial:
    """One candidate's measurements in one round."""

    candidate: str
    prompts: int
    runs: list[dict] = field(default_factory=list)  # bench serve summaries, rising rates
    best: dict | None = None  # the highest-rate run that met the SLO
    error: str | None = None

    @property
    def goodput_rate(self) -> float:
        return self.best["request_rate"] if self.best else 0.0

    @property
    def cheapest(self) -> dict | None:
        """The run that met the SLO at the lowest $ per 1M output tokens (short runs are noisy:
        the highest rate is not always the cheapest measured)."""
        met = [r for r in self.runs if not r["slo_violations"] and _cost(r) < math.inf]
        return min(met, key=_cost) if met else None

    @property
    def cost(self) -> float:
        """$ per 1M output tokens at the SLO, the cheapest run's (inf: none met the SLO)."""
        return _cost(self.cheapest) if self.cheapest else math.inf

    def key(self) -> tuple[float, float]:
        """Lower is better: cost at the SLO, then the higher goodput."""
        return (self.cost, -self.goodput_rate)


Measure = Callable[[str, list[float], int, int], Trial]  # (candidate, rates, start index, prompts per rate)


def climb(rates: list[float], start: int, meets: Callable[[float], bool]) -> None:
    """Run ``meets`` at ``rates[start]`` and upward until the SLO breaks; if it breaks at
    the first, downward until a rate meets it (a round starts one below the last best,
    and a longer run may find even that too fast)."""
    if meets(rates[start]):
        for rate in rates[start + 1 :]:
            if not meets(rate):
                return
    else:
        for rate in reversed(rates[:start]):
            if meets(rate):
                return


def _cost(run: dict) -> float:
    return ((run.get("cost") or {}).get("dollars_per_million_output_tokens")) or math.inf


def successive_halving(
    candidates: list[str], rates: list[float], prompts: int, measure: Measure, rounds: int = 3, log=print
) -> list[list[Trial]]:
    """Round r measures the survivors with ``prompts * 2**r`` prompts per rate, each from one
    rate below its last best; the better half (by cost at the SLO, then goodput) goes on.
    The defaults are measured every round but take no survivor's place."""
    history: list[list[Trial]] = []
    alive = list(candidates)
    start = {c: 0 for c in candidates}  # index into rates
    for r in range(rounds):
        n = prompts * 2**r
        log(f"round {r + 1}: {len(alive)} candidates, {n} prompts per rate")
        trials = [measure(c, rates, start[c], n) for c in alive]
        history.append(trials)
        others = sorted((t for t in trials if t.candidate != DEFAULTS), key=Trial.key)
        if len(others) <= 1:
            break
        keep = others[: max(1, math.ceil(len(others) / 2))]
        alive = [t.candidate for t in keep] + ([DEFAULTS] if DEFAULTS in alive else [])
        for t in trials:
            if t.best:
                start[t.candidate] = max(0, rates.index(t.best["request_rate"]) - 1)
    return history


class ServerProcess:
    """`tokenmill serve` with a candidate's flags, on a free port, stopped on exit (and when
    this process ends: it is started as our child, the server ends with its parent)."""

    def __init__(self, flags: list[str], timeout: float = 300) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port), *flags]
        self.log = open(os.devnull, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, EXIT_WITH_PARENT_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.PIPE, text=True, env=env)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not answer /health in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def measure_candidate(
    args: argparse.Namespace, slo: Slo, name: str, rates: list[float], start: int, prompts: int
) -> Trial:
    """Start the candidate's server and find the highest rate that meets the SLO (``climb``)."""
    from tokenmill.loadgen.energy_probe import EnergyProbe, run_energy
    from tokenmill.loadgen.serve import run_load, summarise, synthetic, warm_up

    trial = Trial(name, prompts)
    t0 = time.monotonic()
    try:
        server = ServerProcess([*args.serve_flags, *candidates_of(args)[name]])
    except RuntimeError as e:
        trial.error = str(e)
        print(f"  {name}: {e}", file=sys.stderr)
        return trial
    model = "tune"

    def meets(rate: float) -> bool:
        reqs = _workload(args, prompts, rate, synthetic)
        before = probe.read()
        limit = RUN_TIMEOUT_FACTOR * (prompts / rate + slo.longest())
        try:
            load = run_load(server.url, model, reqs, rate, None, None, False, args.seed)
            results, elapsed = asyncio.run(asyncio.wait_for(load, limit))
        except TimeoutError:  # the requests are dropped: the server aborts what it still runs
            trial.runs.append({"request_rate": rate, "slo_violations": [f"the run took over {limit:.0f} s"]})
            print(f"  {name}: {rate:g} req/s took over {limit:.0f} s: SLO broken", file=sys.stderr)
            return False
        summary = summarise(
            results, elapsed, rate, slo.limits.get("ttft_p99", math.inf), slo.limits.get("tpot_p99", math.inf)
        )
        tokens = sum(r.prompt_tokens for r in results if r.ok)
        summary.update(run_energy(before, probe.read(), summary, tokens, args.price_per_hour))
        broken = slo.violations(summary)
        summary["slo_violations"] = broken
        trial.runs.append(summary)
        cost = (summary.get("cost") or {}).get("dollars_per_million_output_tokens")
        print(
            f"  {name}: {rate:g} req/s -> {summary['output_token_throughput']:.0f} out tok/s, "
            f"ttft p99 {summary['ttft_s']['p99'] or 0:.2f} s, tpot p99 {(summary['tpot_s']['p99'] or 0) * 1000:.0f} ms"
            + (f", ${cost:.2f}/1M out" if cost else "")
            + (f"  SLO broken: {'; '.join(broken)}" if broken else "  meets the SLO"),
            file=sys.stderr,
        )
        if not broken and (trial.best is None or rate > trial.best["request_rate"]):
            trial.best = summary
        return not broken

    try:
        warm_up(server.url, model, None)
        probe = EnergyProbe(server.url, None)
        climb(rates, start, meets)
    finally:
        server.stop()
    print(f"  {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return trial


def candidates_of(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The candidates to try: ``--candidate NAME=FLAGS`` replaces the built-in set (the
    defaults are always among them)."""
    if not args.candidate:
        return CANDIDATES
    out: dict[str, tuple[str, ...]] = {DEFAULTS: ()}
    for spec in args.candidate:
        name, _, flags = spec.partition("=")
        if not name or not flags:
            raise ValueError(f"--candidate {spec!r}: expected NAME=FLAGS (e.g. 'seqs 8=--max-num-seqs 8')")
        out[name] = tuple(flags.split())
    return out


def _workload(args: argparse.Namespace, n: int, rate: float, synthetic) -> list[dict]:
    if args.workload in ("mixed", "shared-prefix"):
        return synthetic(args.workload, n, args.seed + round(rate * 1000))
    from tokenmill.loadgen.serve import load_jsonl

    reqs = load_jsonl(args.workload)
    if not reqs:
        raise ValueError(f"--workload {args.workload}: no requests")
    return [reqs[i % len(reqs)] for i in range(n)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo", required=True, help="latency limits, e.g. ttft_p99=2s,tpot_p99=100ms")
    p.add_argument(
        "--workload",
        default="mixed",
        help="mixed or shared-prefix (bench serve's synthetic sets), or a JSONL of {prompt, max_tokens}",
    )
    p.add_argument("--price-per-hour", type=float, required=True, help="the machine's $ per hour")
    p.add_argument("--rates", default="0.25,0.5,1,2,4,8", help="request rates to climb, req/s (default %(default)s)")
    p.add_argument("--prompts", type=int, default=12, help="prompts per rate in the first round (doubled each round)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of halving at most (default 3)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=14.0,
        help="minutes: candidates not started by then are left unmeasured (default %(default)s)",
    )
    p.add_argument(
        "--candidate",
        action="append",
        default=[],
        help="NAME=SERVE_FLAGS, repeatable: try these instead of the built-in set (the defaults are always tried)",
    )
    p.add_argument(
        "--serve-args", default="", help="flags every candidate's `tokenmill serve` gets, e.g. '--model PATH'"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=".", help="where tune.json and tune_frontier.png go")


def run(args: argparse.Namespace) -> int:
    try:
        slo = Slo.parse(args.slo)
        rates = sorted(float(r) for r in args.rates.split(","))
        candidates = list(candidates_of(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.serve_flags = [*args.serve_args.split(), "--served-model-name", "tune"]
    t0 = time.monotonic()
    print(f"SLO {slo}; {len(candidates)} candidates; rates {rates} req/s; ${args.price_per_hour}/h", file=sys.stderr)
    budget = args.time_budget * 60

    def measure(c: str, r: list[float], start: int, n: int) -> Trial:
        if time.monotonic() - t0 > budget:
            print(f"  {c}: not measured, over --time-budget {args.time_budget:g} min", file=sys.stderr)
            return Trial(c, n, error="not measured: over the time budget")
        return measure_candidate(args, slo, c, r, start, n)

    history = successive_halving(
        candidates, rates, args.prompts, measure, args.rounds, log=lambda m: print(m, file=sys.stderr)
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = history[-1]
    ranked = sorted(final, key=Trial.key)
    pick = ranked[0]
    defaults = next((t for t in final if t.candidate == DEFAULTS), None)
    result = {
        "slo": slo.limits,
        "price_per_hour": args.price_per_hour,
        "workload": args.workload,
        "minutes": (time.monotonic() - t0) / 60,
        "pick": pick.candidate,
        "pick_flags": list(candidates_of(args)[pick.candidate]),
        "rounds": [[_trial_json(t) for t in trials] for trials in history],
    }
    (out / "tune.json").write_text(json.dumps(result, indent=1))
    _report(history, pick, defaults, args)
    plot = _plot(history, pick, out / "tune_frontier.png")
    print(
        json.dumps(
            {
                "pick": pick.candidate,
                "flags": result["pick_flags"],
                "minutes": round(result["minutes"], 1),
                "plot": plot,
                "json": str(out / "tune.json"),
            }
        )
    )
    return 0 if pick.best else 1


def _trial_json(t: Trial) -> dict:
    """A trial's figures: goodput (the highest rate meeting the SLO), and the cheapest run
    meeting it: its rate, throughput, cost and energy."""
    run = t.cheapest or {}
    return {
        "candidate": t.candidate,
        "prompts": t.prompts,
        "error": t.error,
        "goodput_req_s": t.goodput_rate,
        "cheapest_at_req_s": run.get("request_rate"),
        "output_tok_s": run.get("output_token_throughput"),
        "dollars_per_million_output_tokens": None if math.isinf(t.cost) else t.cost,
        "joules_per_output_token": (run.get("energy") or {}).get("joules_per_output_token"),
        "energy_source": (run.get("energy") or {}).get("source"),
        "runs": t.runs,
    }


def _report(history: list[list[Trial]], pick: Trial, defaults: Trial | None, args: argparse.Namespace) -> None:
    print(
        f"\n{'candidate':22s} {'round':>5s} {'prompts':>7s} {'goodput':>8s} {'at req/s':>8s} {'out tok/s':>9s} "
        f"{'$/1M out':>9s} {'J/token':>9s}"
    )
    for r, trials in enumerate(history):
        for t in sorted(trials, key=Trial.key):
            j = _trial_json(t)
            cost = j["dollars_per_million_output_tokens"]
            jt = j["joules_per_output_token"]
            print(
                f"{t.candidate:22s} {r + 1:5d} {t.prompts:7d} {t.goodput_rate:8g} {j['cheapest_at_req_s'] or 0:8g} "
                f"{j['output_tok_s'] or 0:9.1f} "
                f"{'-' if cost is None else f'{cost:.2f}':>9s} "
                f"{'-' if jt is None else f'{jt:.3f}':>9s}" + (f"  ({j['energy_source']})" if jt else "")
            )
    if pick.best is None:
        print("no candidate met the SLO at any rate tried: lower --rates, or relax the SLO")
    elif defaults is not None and pick.candidate != DEFAULTS and pick.key() < defaults.key():
        print(
            f"pick: {pick.candidate} ({' '.join(candidates_of(args)[pick.candidate])}): ${pick.cost:.2f} per 1M output "
            f"tokens at {pick.goodput_rate:g} req/s, against the defaults' "
            + (
                f"${defaults.cost:.2f} at {defaults.goodput_rate:g} req/s"
                if defaults.best
                else "no rate meeting the SLO"
            )
        )
    else:
        print("pick: the defaults are already best here")


def _plot(history: list[list[Trial]], pick: Trial, path: Path) -> str | None:
    """Each candidate's last measurement: goodput (req/s at the SLO) against $ per 1M tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    last: dict[str, Trial] = {}
    for trials in history:
        for t in trials:
            last[t.candidate] = t
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in last.values():
        if not t.best:
            continue
        ax.scatter(t.cost, t.goodput_rate, s=60 if t is pick else 30, color="C3" if t is pick else "C0")
        label = f"{t.candidate} (n={t.prompts})"
        ax.annotate(label, (t.cost, t.goodput_rate), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("$ per 1M output tokens at the SLO (lower is better)")
    ax.set_ylabel("goodput: highest request rate meeting the SLO (req/s)")
    ax.set_title("tokenmill tune: goodput against cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)
