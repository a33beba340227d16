"""`tokenmill tune`'s search: rates climbed until the SLO breaks, successive halving of the candidates,
the validation of the pick and the defaults, and the choice between them."""

from __future__ import annotations

import math
from collections.abc import Callable

from tokenmill.tune.slo import DEFAULTS, Measure, RunAt, Trial, run_cost


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


def pooled_cost(runs: list[dict]) -> float:
    """$ per 1M output tokens of several runs at one price taken as one: all their seconds
    over all their tokens. A run's cost is k x seconds / tokens, so its tokens are
    k x seconds / cost, and the pool's cost is sum(seconds) / sum(seconds / cost). (The
    prompt sets of a workload differ in output length: one set's $0.70 and another's $0.99
    at the same rate are one workload's $0.82.)"""
    tokens = sum(r["duration_s"] / run_cost(r) for r in runs)  # in units of 1/k
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
            t.best = min(at_rate, key=run_cost)
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
