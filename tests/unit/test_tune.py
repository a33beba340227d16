"""`tokenmill tune`'s arithmetic and search: the SLO as written, which runs break it (and
when a run has certainly broken it already), successive halving over candidates measured
by a function of the test's, and the validation that decides what the report states (the
search is what is tested here; the servers it starts are measured in bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from tokenmill.loadgen.serve import RequestResult
from tokenmill.tune.search import (
    choose,
    climb,
    defaults_ladder,
    latest,
    pooled_cost,
    searched_pick,
    successive_halving,
    validate,
)
from tokenmill.tune.slo import DEFAULTS, Slo, Trial, doomed, requests_for

pytestmark = pytest.mark.unit


def summary(failed=0, completed=8, ttft_p99=0.5, tpot_p99=0.05, rate=1.0, cost=1.0, broken=()) -> dict:
    pct = lambda p99: {"mean": p99 / 2, "p50": p99 / 2, "p90": p99 * 0.9, "p99": p99}  # noqa: E731
    return {
        "failed": failed,
        "completed": completed,
        "request_rate": rate,
        "duration_s": 60.0,
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

    def measure(name: str, rates: list[float], start: int, seconds: float) -> Trial:
        calls.append((name, rates[start], seconds))
        t = Trial(name, seconds)

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
    assert [t.seconds for t in history[-1]] == [24, 24]  # a round's seconds per rate double
    # each round starts at the candidate's last best (a longer run that breaks it steps down)
    assert ("c", 8, 24) in calls and (DEFAULTS, 2, 12) in calls
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


def test_halving_starts_the_first_round_where_told_and_stops_when_nothing_was_measured():
    capacity = {DEFAULTS: 2, "a": 4, "b": 1}
    calls: list = []
    measure = fake_measure(capacity, dict.fromkeys(capacity, 4.0), calls)
    successive_halving(list(capacity), [0.5, 1, 2, 4, 8], 5, measure, 1, log=lambda m: None, first=2)
    assert [c for c in calls if c[0] == "b"] == [("b", 2, 5)]  # from the middle rate; b climbs down from there
    rounds = []

    def out_of_time(name, rates, start, seconds):
        if seconds > 5:
            return Trial(name, seconds, error="not measured: over the time budget")
        return measure(name, rates, start, seconds)

    history = successive_halving(list(capacity), [0.5, 1, 2, 4, 8], 5, out_of_time, 3, log=rounds.append)
    assert len(history) == 1 and len(rounds) == 2  # round 2 was left unmeasured: the search ends at round 1
    assert latest(history)["a"].goodput_rate == 4


def test_a_round_is_measured_by_its_seconds():
    assert requests_for(2.0, 30) == 60 and requests_for(0.5, 8) == 8 and requests_for(0.25, 8, minimum=1) == 2


def result(ttft=0.5, e2e=2.0, tokens=16, ok=True) -> RequestResult:
    return RequestResult(ok=ok, ttft=ttft, e2e=e2e, output_tokens=tokens) if ok else RequestResult(ok=False)


def test_a_run_is_doomed_once_enough_requests_are_over_a_percentile_limit():
    slo = Slo.parse("ttft_p99=2s,tpot_p99=100ms")
    # p99 of 40 lies between the two highest: two over the limit break it, one does not
    assert doomed(slo, 40, [result(ttft=3.0)] + [result()] * 5, []) is None
    assert (
        doomed(slo, 40, [result(ttft=3.0), result(ttft=2.5)], []) == "ttft_p99: 2 of 40 requests already over 2000 ms"
    )
    assert doomed(slo, 200, [result(ttft=3.0)] * 2, []) is None  # 200: three must be over
    assert doomed(slo, 40, [result(ok=False), result(ok=False)], []).startswith("ttft_p99")  # failures break all
    # tpot of a finished request: (e2e - ttft) / (tokens - 1)
    assert doomed(slo, 40, [result(ttft=0.1, e2e=3.1, tokens=16)] * 2, []).startswith("tpot_p99")
    # in flight past ttft + (tokens - 1) x tpot (2 + 15 x 0.1 = 3.5 s): broke one of the two, but which is
    # unknown: one more than both limits can still absorb (1 + 1) dooms the run
    assert doomed(slo, 40, [], [(3.6, 16), (3.6, 16)]) is None
    assert doomed(slo, 40, [], [(3.6, 16), (3.6, 16), (3.6, 16)]).startswith("ttft_p99 or tpot_p99")
    assert doomed(slo, 40, [], [(3.4, 16)] * 10) is None  # not yet past the bound
    assert doomed(slo, 40, [result(ttft=3.0)], [(3.6, 16)] * 2).startswith("ttft_p99 or")
    # a mean can recover: never judged early; an e2e limit counts requests in flight past it
    assert doomed(Slo.parse("ttft_mean=1s"), 10, [result(ttft=9.0)] * 9, []) is None
    assert doomed(Slo.parse("e2e_p90=5s"), 10, [], [(6.0, 16)] * 2).startswith("e2e_p90: 2 of 10")


def test_validation_steps_down_until_a_rate_meets_the_slo():
    ran = []

    def run_at(name, rate, prompt_set):
        ran.append(rate)
        return summary(rate=rate, cost=8.0 / rate, broken=["ttft"] if rate > 1 else [])

    t = validate("x", 4, [0.5, 1, 2, 4, 8], run_at, 60, log=lambda m: None)
    assert ran == [4, 2, 1] and t.goodput_rate == 1 and t.cost == pytest.approx(8.0)
    ran.clear()
    t = validate("y", 2, [0.5, 1, 2], lambda n, r, k: summary(rate=r, broken=["tpot"]), 60, log=lambda m: None)
    assert t.best is None and len(t.runs) == 3 and t.cost == float("inf")
    ran.clear()
    t = validate("z", 4, [0.5, 1, 2, 4, 8], run_at, 60, log=lambda m: None, time_left=lambda: len(ran) < 2)
    assert ran == [4, 2] and t.best is None and "over the time budget" in t.error  # no time for a third run


def test_validation_needs_every_prompt_set_to_meet_the_slo():
    """A rate that one prompt set meets and another breaks is no validated rate: the next
    lower one is tried with every set, and the cost stated is never read from the broken
    rate's passing run."""
    ran = []

    def run_at(name, rate, prompt_set):
        ran.append((rate, prompt_set))
        broken = ["ttft_p99"] if rate == 2 and prompt_set == 1 else []
        return summary(rate=rate, cost=1.0 / rate + 0.01 * prompt_set, broken=broken)

    t = validate("x", 2, [0.5, 1, 2], run_at, 60, sets=2, log=lambda m: None)
    assert ran == [(2, 0), (2, 1), (1, 0), (1, 1)]
    assert t.goodput_rate == 1 and t.best is t.runs[2]
    assert t.cost == pytest.approx(2 / (1 / 1.0 + 1 / 1.01))  # both sets' seconds over both sets' tokens
    assert all(r["slo_violations"] for r in t.runs[:2])  # set 0 met 2 req/s, but the rate is broken
    ran.clear()
    validate("y", 2, [0.5, 1, 2], lambda n, r, k: run_at(n, r * 4, k), 60, sets=3, log=lambda m: None)
    assert ran == [(8, 0), (8, 1), (8, 2)]  # every set met the first rate: no step down


def test_pooled_cost_is_all_the_seconds_over_all_the_tokens():
    """At $0.1/h: 61 s for 1,755 tokens and 59 s for 2,355 tokens cost $0.965 and $0.696 per
    1M; together 120 s for 4,110 tokens, $0.811."""
    runs = [dict(summary(cost=0.1 * s / 3600 / n * 1e6), duration_s=s) for s, n in ((61, 1755), (59, 2355))]
    assert pooled_cost(runs) == pytest.approx(0.1 * 120 / 3600 / 4110 * 1e6)
    assert pooled_cost(runs[:1]) == pytest.approx(runs[0]["cost"]["dollars_per_million_output_tokens"])
    assert pooled_cost([summary(cost=None)]) == float("inf")  # no output tokens: no price per token


def test_a_rate_cut_short_by_the_time_budget_is_not_validated():
    """One prompt set met the rate, then time ran out before the other: no validated rate,
    and no cost read from the run that met it (it would have beaten every validated one)."""
    t = validate("x", 1, [0.5, 1], lambda n, r, k: summary(rate=r, cost=0.1), 60, sets=2, log=lambda m: None,
                 time_left=lambda: False)  # fmt: skip
    assert t.best is None and t.cost == float("inf") and "over the time budget" in t.error
    assert len(t.runs) == 1 and t.runs[0]["slo_violations"] == ["not run with every prompt set at 1 req/s"]


def test_the_defaults_are_validated_only_as_far_as_beating_the_pick_needs():
    """After the pick validated at 0.5 req/s, having broken 2, 1.5 and 1: the defaults (searched
    at 2, as the pick was) start at 1 and stop at 0.5, not below."""
    pick = Trial("a", 60)
    pick.runs = [summary(rate=r, broken=["ttft"]) for r in (2, 1.5, 1)] + [summary(rate=0.5)]
    pick.best = pick.runs[-1]
    rates = [0.25, 0.5, 1, 1.5, 2, 3]
    assert defaults_ladder(2, pick, rates) == (1, 0.5)
    assert defaults_ladder(0.5, pick, rates) == (0.5, 0.5)
    ran = []
    t = validate(DEFAULTS, 1, rates, lambda n, r, k: ran.append(r) or summary(rate=r, broken=["ttft"]), 60,
                 log=lambda m: None, floor=0.5)  # fmt: skip
    assert ran == [1, 0.5] and t.best is None
    chosen, verdict = choose(pick, t)
    assert chosen is pick and "no rate tried (1, 0.5 req/s)" in verdict
    direct = Trial("b", 60)  # validated at its searched rate: the defaults from theirs, down to it
    direct.runs = [summary(rate=2)]
    direct.best = direct.runs[0]
    assert defaults_ladder(3, direct, rates) == (3, 2)


def test_the_search_keeps_the_defaults_unless_a_candidate_is_clearly_cheaper():
    """Candidates meeting the SLO at the same rate cost the same up to noise (0.256 against
    0.261): the defaults go on to the validation; one at a higher rate, 25% cheaper, does."""
    defaults, close, clear = validated(DEFAULTS, 2, 0.261), validated("a", 2, 0.256), validated("b", 2.5, 0.196)
    assert searched_pick([defaults, close], defaults, 0.05, log=lambda m: None) is defaults
    assert searched_pick([defaults, close, clear], defaults, 0.05, log=lambda m: None) is clear
    assert searched_pick([close], None, 0.05) is close  # no defaults measured: nothing to keep
    assert searched_pick([defaults, close], validated(DEFAULTS, 2, None), 0.05) is close  # defaults never met it
    assert searched_pick([], None, 0.05) is None


def validated(name, rate, cost):
    t = Trial(name, 60)
    t.runs.append(summary(rate=rate, cost=cost, broken=[] if cost else ["ttft"]))
    t.best = t.runs[0] if cost else None
    return t


def test_the_report_states_the_pick_only_if_its_validation_beats_the_defaults():
    pick, defaults = validated("a", 4, 0.2), validated(DEFAULTS, 2, 0.4)
    chosen, verdict = choose(pick, defaults)
    assert chosen is pick and verdict.startswith("pick: a, validated: $0.200") and "defaults' $0.400 at 2" in verdict
    # the search's pick validated dearer (or equal): the defaults, and why
    chosen, verdict = choose(validated("a", 2, 0.4), defaults)
    assert chosen is defaults and "already best" in verdict and "(a validated no cheaper)" in verdict
    # the pick failed its validation at every rate: the defaults, if they met it
    chosen, _ = choose(validated("a", 4, None), defaults)
    assert chosen is defaults
    # the defaults failed theirs: the pick, if it met it
    chosen, verdict = choose(pick, validated(DEFAULTS, 2, None))
    assert chosen is pick and "meeting the SLO at no rate tried" in verdict
    chosen, verdict = choose(validated("a", 4, None), validated(DEFAULTS, 2, None))
    assert chosen is None and verdict.startswith("no candidate met the SLO")
    # the search picked the defaults themselves
    chosen, verdict = choose(defaults, defaults)
    assert chosen is defaults and "already best" in verdict and "no cheaper" not in verdict


def test_validation_margin_tightens_every_limit():
    slo = Slo.parse("ttft_p99=2s,tpot_p99=100ms")
    tight = slo.with_margin(0.1)
    assert tight.limits == pytest.approx({"ttft_p99": 1.8, "tpot_p99": 0.09})
    summary = {"failed": 0, "completed": 60, "ttft_s": {"p99": 1.9}, "tpot_s": {"p99": 0.05}}
    assert slo.violations(summary) == [] and tight.violations(summary) == ["ttft_p99 1900 ms > 1800 ms"]
