"""The servers `tokenmill tune` starts (one `tokenmill serve` per candidate, ended with it) and the
load it sends them (`bench serve`'s), run by run."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time

from tokenmill.loadgen.server_process import ServerProcess
from tokenmill.tune.search import climb, validate
from tokenmill.tune.slo import RUN_TIMEOUT_FACTOR, Slo, Trial, candidates_of, doomed, requests_for

VALIDATION_SEED = 7919  # added to --seed per validation set: its arrival times (its prompts: PromptSets)


SERVER_START_S = 30  # what starting a server and warming it takes, for the time budget's reserve


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
