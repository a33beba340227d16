"""`tokenmill tune`: the server settings that meet a latency SLO at the lowest cost per token.

SLO first, tuning second. ``--slo ttft_p99=2s,tpot_p99=100ms`` names the limits (ttft, tpot,
itl or e2e at mean, p50, p90 or p99). A candidate is a set of `tokenmill serve` flags
(batch size, step token budget, KV dtype, speculation, quantisation); for each, a server is
started and `bench serve`'s load is sent at rising request rates until the SLO breaks. What a
candidate is worth is the highest rate at which it met the SLO (its goodput) and the cost of
a million output tokens there: ``--price-per-hour`` times the run's duration over its
tokens, so a candidate that sustains more traffic on the same machine costs less per token;
joules per token come from the server's /metrics (measured or estimated, as it says).

Successive halving instead of a grid: every candidate gets a short probe at each rate
(``--seconds`` of arrivals, so ``rate x seconds`` requests: a round measured by prompt count
ran for a second at a high rate and saw none of the queue that builds near capacity); the
better half is measured again for twice the seconds, from its best rate (down where the
longer run breaks it); and so on (``--rounds``, 2 by default: two rounds and the validation
fit 15 minutes on a 2-core machine). The defaults are measured in every round beside the
others. A run stops as soon as its SLO is certainly broken (``doomed``: enough requests
already over a limit), so that a rate too high costs seconds, not the whole drain of its
queue.

Short runs still flatter a rate near capacity, so what the report states comes from a last
**validation**: the pick and the defaults, each in a fresh server, for ``--validate-seconds``
at the rate the search found with each of ``--validate-sets`` prompt sets none of the search
saw (2: the worst decides), against the SLO tightened by ``--validation-margin`` (10%: a p99
over a minute's requests is one or two requests' luck, and which prompts arrive together is
another: at 1 req/s the default model's TTFT p99 was 1.7-1.8 s with one set and 2.2-2.4 s
with another); a rate that fails with any set is stepped down until one meets it with all.
A workload file's rows are dealt into the search's set and each validation set's, and no
server is sent a prompt twice: a run that needs more than its set's rows gets them again
varied (``loadgen.prompt_sets``), since a repeat is a prefix-cache hit the user's traffic
would not have (cycled, 64 rows made three quarters of a run's requests hits, and the
validated rate missed the SLO on the user's own prompts).
The search's pick must be cheaper than the defaults by ``--min-gain`` (5%) to be validated
at all: candidates that meet the SLO at the same rate cost the same (the rate sets the
cost), and their order is noise. The defaults are validated after the pick only as far as
beating it needs (``defaults_ladder``). The pick is named only if its validated cost beats
the defaults' validated cost; otherwise the defaults are (or, if neither validates, nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
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
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
VALIDATION_SEED = 7919  # added to --seed per validation set: its arrival times (its prompts: PromptSets)
SERVER_START_S = 30  # what starting a server and warming it takes, for the time budget's reserve
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
            limit = float(m.group(3)) * UNITS[m.group(4) or ""]
            if not limit > 0:  # no run could meet it
                raise ValueError(f"--slo {part!r}: a limit must be above 0")
            limits[f"{m.group(1)}_{m.group(2)}"] = limit
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

    def with_margin(self, margin: float) -> Slo:
        """Every limit ``margin`` tighter (0.1: 10% under it): a p99 of a minute's requests is
        one or two requests' luck, and a rate validated right at the limit fails the next run
        as often as it passes."""
        return Slo({k: v * (1 - margin) for k, v in self.limits.items()})

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
    """One candidate's measurements in one round (or its validation)."""

    candidate: str
    seconds: float  # of arrivals per rate
    runs: list[dict] = field(default_factory=list)  # bench serve summaries, rising rates
    best: dict | None = None  # the highest-rate run that met the SLO
    error: str | None = None
    pooled_cost: float | None = None  # a validated rate's runs together (``pooled_cost``)

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
        """$ per 1M output tokens at the SLO: the validated rate's prompt sets together, or
        in the search the cheapest run's (inf: none met the SLO)."""
        if self.pooled_cost is not None:
            return self.pooled_cost
        return _cost(self.cheapest) if self.cheapest else math.inf

    def key(self) -> tuple[float, float]:
        """Lower is better: cost at the SLO, then the higher goodput."""
        return (self.cost, -self.goodput_rate)


Measure = Callable[[str, list[float], int, float], Trial]  # (candidate, rates, start index, seconds per rate)
RunAt = Callable[[str, float, int], dict]  # (candidate, rate, prompt set) -> a run's summary, with "slo_violations"


def requests_for(rate: float, seconds: float, minimum: int = 8) -> int:
    """A run of ``seconds`` of arrivals at ``rate``: rate x seconds requests (at least
    ``minimum``, so that a p99 is more than one request's luck)."""
    return max(minimum, round(rate * seconds))


def doomed(slo: Slo, n: int, finished: list, inflight: list[tuple[float, int]]) -> str | None:
    """Why a run of ``n`` requests has certainly broken the SLO already, or None.

    ``finished``: the results so far (``RequestResult``s: a failed one breaks every limit);
    ``inflight``: (seconds since sent, max_tokens) of the others. A percentile limit ``pQ``
    is broken once ``n - floor(Q * (n - 1))`` requests are over it (the interpolated pQ lies
    between the top ones). A request in flight for longer than ttft + (max_tokens - 1) x
    tpot has broken one of the two; longer than e2e, that one. Means can still recover: not
    judged early."""
    over: dict[str, int] = {}
    need: dict[str, int] = {}
    for key, limit in slo.limits.items():
        metric, stat = key.split("_")
        if stat not in QUANTILES or metric == "itl":
            continue
        need[key] = n - math.floor(QUANTILES[stat] * (n - 1))
        bad = 0
        for r in finished:
            value = getattr(r, metric, None) if r.ok else math.inf
            bad += value is not None and value > limit
        over[key] = bad
        if bad >= need[key]:
            return f"{key}: {bad} of {n} requests already over {limit * 1000:.0f} ms"
    e2e = next((k for k in need if k.startswith("e2e")), None)
    if e2e is not None:
        late = sum(1 for age, _ in inflight if age > slo.limits[e2e])
        if over[e2e] + late >= need[e2e]:
            return f"{e2e}: {over[e2e] + late} of {n} requests over {slo.limits[e2e] * 1000:.0f} ms"
    ttft = next((k for k in need if k.startswith("ttft")), None)
    tpot = next((k for k in need if k.startswith("tpot")), None)
    if ttft and tpot:
        bound = lambda tokens: slo.limits[ttft] + (tokens - 1) * slo.limits[tpot]  # noqa: E731
        late = sum(1 for age, tokens in inflight if age > bound(tokens))
        room = (need[ttft] - 1 - over[ttft]) + (need[tpot] - 1 - over[tpot])  # late ones that fit under both
        if late > room:
            return f"{ttft} or {tpot}: {late} requests in flight past ttft + tokens x tpot"
    return None


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


def pooled_cost(runs: list[dict]) -> float:
    """$ per 1M output tokens of several runs at one price taken as one: all their seconds
    over all their tokens. A run's cost is k x seconds / tokens, so its tokens are
    k x seconds / cost, and the pool's cost is sum(seconds) / sum(seconds / cost). (The
    prompt sets of a workload differ in output length: one set's $0.70 and another's $0.99
    at the same rate are one workload's $0.82.)"""
    tokens = sum(r["duration_s"] / _cost(r) for r in runs)  # in units of 1/k
    return sum(r["duration_s"] for r in runs) / tokens if tokens > 0 else math.inf


def successive_halving(
    candidates: list[str],
    rates: list[float],
    seconds: float,
    measure: Measure,
    rounds: int = 3,
    log=print,
    first: int = 0,
) -> list[list[Trial]]:
    """Round r measures the survivors for ``seconds * 2**r`` seconds per rate, the first
    round from ``rates[first]``, later ones from each one's last best (``climb`` steps down
    where the longer run breaks it); the
    better half (by cost at the SLO, then goodput) goes on. The defaults are measured every
    round but take no survivor's place. A round whose trials were all left unmeasured (the
    time budget) ends the search."""
    history: list[list[Trial]] = []
    alive = list(candidates)
    start = {c: first for c in candidates}  # index into rates
    for r in range(rounds):
        n = seconds * 2**r
        log(f"round {r + 1}: {len(alive)} candidates, {n:g} s per rate")
        trials = [measure(c, rates, start[c], n) for c in alive]
        if all(t.error and not t.runs for t in trials):
            break
        history.append(trials)
        others = sorted((t for t in trials if t.candidate != DEFAULTS), key=Trial.key)
        if len(others) <= 1:
            break
        keep = others[: max(1, math.ceil(len(others) / 2))]
        alive = [t.candidate for t in keep] + ([DEFAULTS] if DEFAULTS in alive else [])
        for t in trials:
            if t.best:
                start[t.candidate] = rates.index(t.best["request_rate"])
    return history


def latest(history: list[list[Trial]]) -> dict[str, Trial]:
    """Each candidate's last measured trial (a later round left unmeasured does not hide it)."""
    out: dict[str, Trial] = {}
    for trials in history:
        for t in trials:
            if t.runs or t.candidate not in out:
                out[t.candidate] = t
    return out


def validate(
    name: str,
    rate: float,
    rates: list[float],
    run_at: RunAt,
    seconds: float,
    sets: int = 1,
    log=print,
    time_left=lambda: True,
    floor: float = 0.0,
) -> Trial:
    """``name`` at ``rate`` for a long run with each of ``sets`` prompt sets; if any breaks
    the SLO, the next lower rate (none under ``floor``), and so on until one meets it with
    every set (the trial's best, its cost the sets' pooled), none is left or ``time_left()``
    says no more (the trial then says so in ``error``). The runs of a rate that one set
    broke, or that time cut short, are all marked so, and no cost is read from them."""
    t = Trial(name, seconds)
    for i, r in enumerate([rate] + sorted((x for x in rates if floor <= x < rate), reverse=True)):
        at_rate = []
        for k in range(sets):
            if (i or k) and not time_left():
                t.error = f"validation stopped at {r:g} req/s: over the time budget"
                for s in at_rate:
                    s["slo_violations"] = s["slo_violations"] or [f"not run with every prompt set at {r:g} req/s"]
                log(f"  validation: {name}: {t.error}")
                return t
            summary = run_at(name, r, k)
            at_rate.append(summary)
            t.runs.append(summary)
            if summary["slo_violations"]:
                break
        broken = [s for s in at_rate if s["slo_violations"]]
        if not broken:
            t.best = min(at_rate, key=_cost)
            t.pooled_cost = pooled_cost(at_rate)
            return t
        for s in at_rate:
            s["slo_violations"] = s["slo_violations"] or [
                f"met with this prompt set, broken with another at {r:g} req/s"
            ]
        log(f"  validation: {name} broke the SLO at {r:g} req/s")
    return t


def searched_pick(final: list[Trial], defaults: Trial | None, min_gain: float, log=print) -> Trial | None:
    """The search's cheapest candidate, unless it is not ``min_gain`` cheaper than the
    defaults (which then go on to the validation in its place)."""
    best = min(final, key=Trial.key) if final else None
    if best is None or defaults is None or not defaults.best or best is defaults:
        return best
    if best.cost > defaults.cost * (1 - min_gain):
        log(
            f"search: {best.candidate} (${best.cost:.3f}) is not {min_gain:.0%} cheaper than the defaults "
            f"(${defaults.cost:.3f}): the defaults go on"
        )
        return defaults
    return best


def defaults_ladder(searched: float, pick: Trial, rates: list[float]) -> tuple[float, float]:
    """Where the defaults' validation starts and stops once the pick has validated: the
    question left is only whether they beat it. Start at the lowest rate the pick broke
    in validation (or at their searched rate, if lower): the search rated both alike, and
    a rate the pick broke on these prompts is one the defaults would need minutes to be
    refused at. Stop at the pick's validated rate: below it the defaults cannot win."""
    broke = [r["request_rate"] for r in pick.runs if r["request_rate"] > pick.goodput_rate]
    start = min([searched, *broke]) if broke else searched
    return start, min(pick.goodput_rate, start)


def choose(pick: Trial | None, defaults: Trial | None) -> tuple[Trial | None, str]:
    """What the report states, from the validation runs: the searched pick only where it
    met the SLO and its validated cost beats the defaults' validated cost."""
    if pick is not None and pick.best and (defaults is None or pick.key() < defaults.key()):
        if defaults is None:
            return pick, f"pick: {pick.candidate}, validated at {pick.goodput_rate:g} req/s"
        tried = ", ".join(f"{r:g}" for r in sorted({r["request_rate"] for r in defaults.runs}, reverse=True))
        versus = (
            f"the defaults' ${defaults.cost:.3f} at {defaults.goodput_rate:g} req/s"
            if defaults.best
            else f"the defaults meeting the SLO at no rate tried ({tried or 'none'} req/s"
            + (f"; {defaults.error})" if defaults.error else ")")
        )
        return pick, (
            f"pick: {pick.candidate}, validated: ${pick.cost:.3f} per 1M output tokens at "
            f"{pick.goodput_rate:g} req/s, against {versus}"
        )
    if defaults is not None and defaults.best:
        why = "" if pick is None or pick is defaults else f" ({pick.candidate} validated no cheaper)"
        return defaults, (
            f"pick: the defaults are already best here{why}: validated ${defaults.cost:.3f} per 1M output tokens "
            f"at {defaults.goodput_rate:g} req/s"
        )
    return None, "no candidate met the SLO in validation at any rate tried: lower --rates, or relax the SLO"


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


async def load_until_broken(
    url: str, model: str, reqs: list[dict], rate: float, slo: Slo, seed: int, limit: float, every: float = 0.5
) -> tuple[list, float, str | None]:
    """bench serve's load (Poisson arrivals at ``rate``, each request streamed by its
    ``send``), stopped as soon as ``doomed`` says the SLO is broken or after ``limit``
    seconds: (the finished results, seconds, why it stopped early or None). Stopping
    closes the streams: the server aborts what it still runs."""
    import httpx

    from tokenmill.loadgen.serve import send

    rng = random.Random(seed)
    started: list[tuple[asyncio.Task, float, int]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def arrivals() -> None:
            for req in reqs:
                task = asyncio.create_task(send(client, url + "/v1/completions", model, req, {}, False))
                started.append((task, time.perf_counter(), req["max_tokens"]))
                await asyncio.sleep(rng.expovariate(rate))

        t0 = time.perf_counter()
        feeder = asyncio.create_task(arrivals())
        why = None
        while not (feeder.done() and all(t.done() for t, _, _ in started)):
            await asyncio.sleep(every)
            now = time.perf_counter()
            finished = [t.result() for t, _, _ in started if t.done()]
            why = doomed(slo, len(reqs), finished, [(now - s, m) for t, s, m in started if not t.done()])
            if why is None and now - t0 > limit:
                why = f"the run took over {limit:.0f} s"
            if why:
                break
        elapsed = time.perf_counter() - t0
        if why:
            feeder.cancel()
            for t, _, _ in started:
                t.cancel()
            await asyncio.gather(feeder, *(t for t, _, _ in started), return_exceptions=True)
        results = [t.result() for t, _, _ in started if t.done() and not t.cancelled()]
    return results, elapsed, why


class Session:
    """One candidate's server, warmed, and its runs at a rate: each a summary with its
    energy, cost and the SLO's verdict (``slo_violations``)."""

    def __init__(self, args: argparse.Namespace, slo: Slo, name: str) -> None:
        from tokenmill.loadgen.energy_probe import EnergyProbe
        from tokenmill.loadgen.serve import warm_up

        self.args, self.slo, self.name = args, slo, name
        # set 0 the search's, 1.. the validation's; a server of its own: no prompt sent twice
        self.prompts = args.prompt_sets.for_server()
        self.server = ServerProcess([*args.serve_flags, *candidates_of(args)[name]])
        try:
            warm_up(self.server.url, "tune", None)
            self.probe = EnergyProbe(self.server.url, None)
        except BaseException:
            self.server.stop()
            raise

    def run(self, rate: float, seconds: float, prompt_set: int = 0) -> dict:
        """A run at ``rate`` with the next prompts of ``prompt_set`` (0: the search's)."""
        from tokenmill.loadgen.energy_probe import run_energy
        from tokenmill.loadgen.serve import summarise

        args, slo = self.args, self.slo
        reqs, varied = self.prompts.take(requests_for(rate, seconds, args.prompts), rate, prompt_set)
        limit = RUN_TIMEOUT_FACTOR * (len(reqs) / rate + slo.longest())
        before = self.probe.read()
        seed = args.seed + VALIDATION_SEED * prompt_set
        results, elapsed, why = asyncio.run(load_until_broken(self.server.url, "tune", reqs, rate, slo, seed, limit))
        n = f"{len(reqs)}" + (f", {varied} varied" if varied else "")
        if why:
            print(f"  {self.name}: {rate:g} req/s ({n} requests) stopped after {elapsed:.0f} s: {why}", file=sys.stderr)
            return {
                "request_rate": rate,
                "requests": len(reqs),
                "varied_prompts": varied,
                "duration_s": elapsed,
                "slo_violations": [why],
            }
        summary = summarise(
            results, elapsed, rate, slo.limits.get("ttft_p99", math.inf), slo.limits.get("tpot_p99", math.inf)
        )
        tokens = sum(r.prompt_tokens for r in results if r.ok)
        summary.update(run_energy(before, self.probe.read(), summary, tokens, args.price_per_hour))
        summary["requests"] = len(reqs)
        summary["varied_prompts"] = varied
        summary["slo_violations"] = slo.violations(summary)
        cost = (summary.get("cost") or {}).get("dollars_per_million_output_tokens")
        broken = summary["slo_violations"]
        print(
            f"  {self.name}: {rate:g} req/s x {n} in {elapsed:.0f} s -> "
            f"{summary['output_token_throughput']:.0f} out tok/s, ttft p99 {summary['ttft_s']['p99'] or 0:.2f} s, "
            f"tpot p99 {(summary['tpot_s']['p99'] or 0) * 1000:.0f} ms"
            + (f", ${cost:.3f}/1M out" if cost else "")
            + (f"  SLO broken: {'; '.join(broken)}" if broken else "  meets the SLO"),
            file=sys.stderr,
        )
        return summary

    def stop(self) -> None:
        self.server.stop()


def measure_candidate(
    args: argparse.Namespace, slo: Slo, name: str, rates: list[float], start: int, seconds: float
) -> Trial:
    """Start the candidate's server and find the highest rate that meets the SLO (``climb``)."""
    trial = Trial(name, seconds)
    t0 = time.monotonic()
    try:
        session = Session(args, slo, name)
    except RuntimeError as e:
        trial.error = str(e)
        print(f"  {name}: {e}", file=sys.stderr)
        return trial

    def meets(rate: float) -> bool:
        summary = session.run(rate, seconds)
        trial.runs.append(summary)
        if not summary["slo_violations"] and (trial.best is None or rate > trial.best["request_rate"]):
            trial.best = summary
        return not summary["slo_violations"]

    try:
        climb(rates, start, meets)
    finally:
        session.stop()
    print(f"  {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return trial


def validate_candidate(
    args: argparse.Namespace,
    slo: Slo,
    name: str,
    rate: float,
    rates: list[float],
    time_left=lambda: True,
    floor: float = 0.0,
) -> Trial:
    """``validate`` in a fresh server of the candidate's, with prompt sets the search never saw
    (set k + 1 for the validation's k-th: set 0 is the search's)."""
    t0 = time.monotonic()
    try:
        session = Session(args, slo.with_margin(args.validation_margin), name)
    except RuntimeError as e:
        print(f"  {name}: {e}", file=sys.stderr)
        return Trial(name, args.validate_seconds, error=str(e))
    try:
        trial = validate(
            name,
            rate,
            rates,
            lambda _, r, k: session.run(r, args.validate_seconds, k + 1),
            args.validate_seconds,
            sets=args.validate_sets,
            log=lambda m: print(m, file=sys.stderr),
            time_left=time_left,
            floor=floor,
        )
    finally:
        session.stop()
    print(f"  {name}: validated in {time.monotonic() - t0:.0f} s", file=sys.stderr)
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


def _slo_flag(text: str) -> str:
    """``--slo``'s check: ``Slo.parse``'s (the text is kept: ``run`` parses it)."""
    from tokenmill.flag_types import BadValue

    try:
        Slo.parse(text)
    except ValueError as e:
        raise BadValue(str(e).removeprefix("--slo ")) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.flag_types import (
        NON_NEGATIVE_FLOAT,
        POSITIVE_FLOAT,
        POSITIVE_INT,
        NameOrFile,
        Number,
        NumberList,
    )

    share = Number(float, 0, 1, open_high=True)  # a fraction of a cost or a limit: [0, 1)
    p.add_argument("--slo", type=_slo_flag, required=True, help="latency limits, e.g. ttft_p99=2s,tpot_p99=100ms")
    p.add_argument(
        "--workload",
        type=NameOrFile(("mixed", "shared-prefix")),
        default="mixed",
        help="mixed or shared-prefix (bench serve's synthetic sets), or a JSONL of {prompt, max_tokens}",
    )
    p.add_argument("--price-per-hour", type=NON_NEGATIVE_FLOAT, required=True, help="the machine's $ per hour")
    p.add_argument(
        "--rates",
        type=NumberList(POSITIVE_FLOAT),
        default="0.5,1,1.5,2,3,4,6",
        help="request rates to climb, req/s (default %(default)s)",
    )
    p.add_argument(
        "--start-rate",
        type=POSITIVE_FLOAT,
        default=None,
        help="the first round's first rate, climbed up or down from (default: the middle of --rates)",
    )
    p.add_argument(
        "--seconds",
        type=POSITIVE_FLOAT,
        default=10,
        help="seconds of arrivals per rate in the first round (doubled each round)",
    )
    p.add_argument("--prompts", type=POSITIVE_INT, default=8, help="requests per run at least (default %(default)s)")
    p.add_argument("--rounds", type=POSITIVE_INT, default=2, help="rounds of halving at most (default %(default)s)")
    p.add_argument(
        "--validate-seconds",
        type=POSITIVE_FLOAT,
        default=60,
        help="seconds of arrivals of the final validation of the pick and the defaults (default %(default)s)",
    )
    p.add_argument(
        "--validate-sets",
        type=POSITIVE_INT,
        default=2,
        help="prompt sets the validation runs at a rate, none of them the search's; a rate must meet the SLO "
        "with every one (default %(default)s)",
    )
    p.add_argument(
        "--min-gain",
        type=share,
        default=0.05,
        help="how much cheaper than the defaults the search's pick must be to be validated against them "
        "(default %(default)s: 5%%; closer is the search's noise)",
    )
    p.add_argument(
        "--validation-margin",
        type=share,
        default=0.1,
        help="the validation holds every SLO limit this much tighter (default %(default)s: 10%% under it), so that "
        "what it reports meets the SLO in the next run too",
    )
    p.add_argument(
        "--time-budget",
        type=POSITIVE_FLOAT,
        default=14.0,
        help="minutes in all: the search leaves unmeasured what it cannot start in this less the validation's "
        "reserve (default %(default)s)",
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
        first = (len(rates) - 1) // 2 if args.start_rate is None else rates.index(args.start_rate)
    except ValueError as e:
        msg = "--start-rate must be one of --rates" if "not in list" in str(e) else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    from tokenmill.loadgen.prompt_sets import PromptSets

    try:  # read once here, so that a bad file is said before any server starts
        args.prompt_sets = PromptSets(args.workload, 1 + args.validate_sets, args.seed)
    except ValueError as e:
        print(f"error: --workload {e}", file=sys.stderr)
        return 2
    print(f"workload {args.prompt_sets.describe()}", file=sys.stderr)
    args.serve_flags = [*args.serve_args.split(), "--served-model-name", "tune"]
    t0 = time.monotonic()
    print(f"SLO {slo}; {len(candidates)} candidates; rates {rates} req/s; ${args.price_per_hour}/h", file=sys.stderr)
    # the validation's reserve: two servers, each a long run and a step down's drain
    reserve = 2 * (SERVER_START_S + args.validate_sets * (args.validate_seconds + slo.longest()))
    search_budget = args.time_budget * 60 - reserve
    step_down_by = args.time_budget * 60 - (args.validate_seconds + slo.longest())  # a step down must end in time

    def measure(c: str, r: list[float], start: int, n: float) -> Trial:
        if time.monotonic() - t0 > search_budget:
            print(
                f"  {c}: not measured, over --time-budget {args.time_budget:g} min less the validation", file=sys.stderr
            )
            return Trial(c, n, error="not measured: over the time budget")
        return measure_candidate(args, slo, c, r, start, n)

    history = successive_halving(
        candidates, rates, args.seconds, measure, args.rounds, log=lambda m: print(m, file=sys.stderr), first=first
    )
    searched = latest(history)
    final = [searched[c] for c in candidates if c in searched]
    defaults = searched.get(DEFAULTS)
    best = searched_pick(final, defaults, args.min_gain, log=lambda m: print(m, file=sys.stderr))
    searched_minutes = (time.monotonic() - t0) / 60
    print(
        f"validation: {args.validate_seconds:g} s at the searched rate with each of {args.validate_sets} prompt "
        "sets of its own (none of the search's)",
        file=sys.stderr,
    )
    validated: dict[str, Trial] = {}
    for t in (best, defaults):
        if t is None or not t.best or t.candidate in validated:
            continue
        start, floor = t.goodput_rate, 0.0
        pick = validated.get(best.candidate) if best is not None else None
        if pick is not None and pick.best:  # the defaults after the pick: only whether they beat it
            start, floor = defaults_ladder(t.goodput_rate, pick, rates)
        validated[t.candidate] = validate_candidate(
            args,
            slo,
            t.candidate,
            start,
            rates,
            time_left=lambda: time.monotonic() - t0 < step_down_by,
            floor=floor,
        )
    pick, verdict = choose(validated.get(best.candidate) if best is not None else None, validated.get(DEFAULTS))
    if not validated:
        verdict = "no candidate met the SLO in the search at any rate tried: lower --rates, or relax the SLO"
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "slo": slo.limits,
        "price_per_hour": args.price_per_hour,
        "workload": args.workload,
        "minutes": (time.monotonic() - t0) / 60,
        "search_minutes": searched_minutes,
        "searched_pick": best.candidate if best else None,
        "pick": pick.candidate if pick else None,
        "pick_flags": list(candidates_of(args)[pick.candidate]) if pick else None,
        "pick_rate": pick.goodput_rate if pick else None,
        "verdict": verdict,
        "rounds": [[_trial_json(t) for t in trials] for trials in history],
        "validation": [_trial_json(t) for t in validated.values()],
    }
    (out / "tune.json").write_text(json.dumps(result, indent=1))
    _report(history, list(validated.values()), verdict)
    plot = _plot(history, list(validated.values()), pick, out / "tune_frontier.png")
    print(
        json.dumps(
            {
                "pick": result["pick"],
                "flags": result["pick_flags"],
                "rate": result["pick_rate"],
                "minutes": round(result["minutes"], 1),
                "plot": plot,
                "json": str(out / "tune.json"),
            }
        )
    )
    return 0 if pick is not None else 1


def _trial_json(t: Trial) -> dict:
    """A trial's figures: goodput (the highest rate meeting the SLO), and the cheapest run
    meeting it: its rate, throughput, cost and energy."""
    run = t.cheapest or {}
    return {
        "candidate": t.candidate,
        "seconds": t.seconds,
        "requests": [r.get("requests") for r in t.runs],
        "error": t.error,
        "goodput_req_s": t.goodput_rate,
        "cheapest_at_req_s": run.get("request_rate"),
        "output_tok_s": run.get("output_token_throughput"),
        "dollars_per_million_output_tokens": None if math.isinf(t.cost) else t.cost,
        "joules_per_output_token": (run.get("energy") or {}).get("joules_per_output_token"),
        "energy_source": (run.get("energy") or {}).get("source"),
        "runs": t.runs,
    }


def _report(history: list[list[Trial]], validated: list[Trial], verdict: str) -> None:
    print(
        f"\n{'candidate':22s} {'round':>5s} {'s/rate':>6s} {'goodput':>8s} {'at req/s':>8s} {'out tok/s':>9s} "
        f"{'$/1M out':>9s} {'J/token':>9s}"
    )
    stages = [(str(r + 1), trials) for r, trials in enumerate(history)] + [("val", validated)]
    for stage, trials in stages:
        for t in sorted(trials, key=Trial.key):
            j = _trial_json(t)
            cost = j["dollars_per_million_output_tokens"]
            jt = j["joules_per_output_token"]
            print(
                f"{t.candidate:22s} {stage:>5s} {t.seconds:6g} {t.goodput_rate:8g} {j['cheapest_at_req_s'] or 0:8g} "
                f"{j['output_tok_s'] or 0:9.1f} "
                f"{'-' if cost is None else f'{cost:.3f}':>9s} "
                f"{'-' if jt is None else f'{jt:.3f}':>9s}" + (f"  ({j['energy_source']})" if jt else "")
            )
    print(verdict)


def _plot(history: list[list[Trial]], validated: list[Trial], pick: Trial | None, path: Path) -> str | None:
    """Each candidate's last search measurement (blue) and the validation's (red ring: the
    pick): goodput (req/s at the SLO) against $ per 1M output tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in latest(history).values():
        if t.best:
            ax.scatter(t.cost, t.goodput_rate, s=30, color="C0")
            label = f"{t.candidate} ({t.seconds:g} s/rate)"
            ax.annotate(label, (t.cost, t.goodput_rate), fontsize=7, xytext=(4, 3), textcoords="offset points")
    for t in validated:
        if t.best:
            ax.scatter(t.cost, t.goodput_rate, s=60 if t is pick else 30, color="C3", marker="o" if t is pick else "x")
            label = f"{t.candidate}, validated ({t.seconds:g} s)"
            ax.annotate(label, (t.cost, t.goodput_rate), fontsize=7, xytext=(4, -9), textcoords="offset points")
    ax.set_xlabel("$ per 1M output tokens at the SLO (lower is better)")
    ax.set_ylabel("goodput: highest request rate meeting the SLO (req/s)")
    ax.set_title("tokenmill tune: goodput against cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)
