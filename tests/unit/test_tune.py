"""`tokenmill tune`'s arithmetic and search: the SLO as written, which runs break it, and
successive halving over candidates measured by a function of the test's (the search is
what is tested here; the servers it starts are measured in bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from tokenmill.tune import DEFAULTS, Slo, Trial, climb, successive_halving

pytestmark = pytest.mark.unit


def summary(failed=0, completed=8, ttft_p99=0.5, tpot_p99=0.05, rate=1.0, cost=1.0, broken=()) -> dict:
    pct = lambda p99: {"mean": p99 / 2, "p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}  # noqa: E731
    return {
        "failed": failed,
        "completed": completed,
        "request_rate": rate,
        "ttft_s": pct(ttft_p99),
        "tpot_s": pct(tpot_p99),
        "itl_s": pct(tpot_p99),
        "e2e_s": pct(3.0),
        "cost": {"dollars_per_million_output_tokens": cost},
        "slo_violations": list(broken),
    }


def test_slo_parses_units_and_names_what_is_broken():
    slo = Slo.parse("ttft_p99=2s, tpot_p99=100ms,e2e_mean=1.5")
    assert slo.limits == {"ttft_p99": 2.0, "tpot_p99": 0.1, "e2e_mean": 1.5}
    assert slo.violations(summary()) == []  # e2e mean 1.5 s: at the limit, not over it
    assert slo.violations(summary(ttft_p99=2.5, tpot_p99=0.2)) == [
        "ttft_p99 2500 ms > 2000 ms",
        "tpot_p99 200 ms > 100 ms",
    ]
    assert slo.violations(summary(failed=1)) == ["1 failed requests"]
    for bad in ("ttft=2s", "latency_p99=2s", "ttft_p95=2s", "ttft_p99=fast", ""):
        with pytest.raises(ValueError, match="--slo"):
            Slo.parse(bad)


def fake_measure(capacity: dict[str, float], cost_at: dict[str, float], calls: list):
    """A candidate meets the SLO at every rate up to its capacity; its cost there is fixed."""

    def measure(name: str, rates: list[float], start: int, prompts: int) -> Trial:
        calls.append((name, rates[start], prompts))
        t = Trial(name, prompts)

        def meets(r: float) -> bool:
            s = summary(rate=r, cost=cost_at[name] / r, broken=["too fast"] if r > capacity[name] else [])
            t.runs.append(s)
            if not s["slo_violations"] and (t.best is None or r > t.best["request_rate"]):
                t.best = s
            return not s["slo_violations"]

        climb(rates, start, meets)
        return t

    return measure


def test_halving_keeps_the_cheapest_half_and_always_measures_the_defaults():
    capacity = {DEFAULTS: 2, "a": 4, "b": 1, "c": 8, "d": 0.1}
    cost_at = {DEFAULTS: 4.0, "a": 4.0, "b": 4.0, "c": 4.0, "d": 4.0}
    calls: list = []
    history = successive_halving(
        list(capacity), [0.5, 1, 2, 4, 8], 6, fake_measure(capacity, cost_at, calls), 3, log=lambda m: None
    )
    assert [{t.candidate for t in r} for r in history] == [
        {DEFAULTS, "a", "b", "c", "d"},
        {DEFAULTS, "a", "c"},  # the cheaper half of a..d (c: $0.50, a: $1, b: $4, d: none), and the defaults
        {DEFAULTS, "c"},
    ]
    assert [t.prompts for t in history[-1]] == [24, 24]  # prompts double each round
    # each round starts one rate below the candidate's last best: c's best was 8 -> from 4
    assert ("c", 4, 24) in calls and (DEFAULTS, 1, 12) in calls
    best = min(history[-1], key=Trial.key)
    assert best.candidate == "c" and best.goodput_rate == 8 and best.cost == pytest.approx(0.5)


def test_a_candidate_that_never_meets_the_slo_ranks_last():
    never = Trial("x", 4)
    never.runs.append(summary(failed=3, broken=["3 failed requests"]))
    met = Trial("y", 4)
    met.runs.append(summary(rate=0.5, cost=9.0))
    met.best = met.runs[0]
    assert sorted([never, met], key=Trial.key)[0] is met and never.cost == float("inf")


def test_the_cost_is_the_cheapest_run_that_met_the_slo():
    """Short runs are noisy: the highest rate meeting the SLO is the goodput, but the cost is
    the cheapest run that met it; a run that broke the SLO never counts, however cheap."""
    t = Trial("x", 4)
    t.runs += [summary(rate=1, cost=0.7), summary(rate=2, cost=1.1), summary(rate=4, cost=0.2, broken=["ttft"])]
    t.best = t.runs[1]
    assert t.goodput_rate == 2 and t.cost == pytest.approx(0.7)


def test_slo_longest_bounds_a_run():
    assert Slo.parse("ttft_p99=2s,tpot_p99=100ms").longest() == pytest.approx(2 + 25.6)
    assert Slo.parse("e2e_p99=40s,ttft_p50=1s").longest() == pytest.approx(40)


def test_climb_goes_up_until_the_slo_breaks_and_down_when_it_breaks_at_once():
    tried = []

    def meets_up_to(cap):
        def meets(rate):
            tried.append(rate)
            return rate <= cap

        return meets

    rates = [0.5, 1, 2, 4, 8]
    climb(rates, 1, meets_up_to(4))
    assert tried == [1, 2, 4, 8]
    tried.clear()
    climb(rates, 3, meets_up_to(1))  # a longer run finds the last best too fast: down to the first that meets
    assert tried == [4, 2, 1]
    tried.clear()
    climb(rates, 2, meets_up_to(0.1))
    assert tried == [2, 1, 0.5]
