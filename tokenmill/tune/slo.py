"""The SLO as written (``--slo ttft_p99=2s,...``), a trial of a candidate at a rate, and when a run has
certainly broken its SLO (``doomed``): the arithmetic `tokenmill tune` decides by."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULTS = "defaults"


METRICS = ("ttft", "tpot", "itl", "e2e")


RUN_TIMEOUT_FACTOR = 3  # a run longer than 3x (its arrivals + the SLO's longest limit) has broken it


STATS = ("mean", "p50", "p90", "p99")


QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


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
        met = [r for r in self.runs if not r["slo_violations"] and run_cost(r) < math.inf]
        return min(met, key=run_cost) if met else None

    @property
    def cost(self) -> float:
        """$ per 1M output tokens at the SLO: the validated rate's prompt sets together, or
        in the search the cheapest run's (inf: none met the SLO)."""
        if self.pooled_cost is not None:
            return self.pooled_cost
        return run_cost(self.cheapest) if self.cheapest else math.inf

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


def run_cost(run: dict) -> float:
    return ((run.get("cost") or {}).get("dollars_per_million_output_tokens")) or math.inf


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
