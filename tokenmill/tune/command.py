"""`tokenmill tune`'s command: its flags, the candidates, and the run from search to report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.tune.processes import SERVER_START_S, measure_candidate, validate_candidate
from tokenmill.tune.report import plot_frontier, trial_json, write_report
from tokenmill.tune.search import choose, defaults_ladder, latest, searched_pick, successive_halving
from tokenmill.tune.slo import DEFAULTS, Slo, Trial, candidates_of


def _slo_flag(text: str) -> str:
    """``--slo``'s check: ``Slo.parse``'s (the text is kept: ``run`` parses it)."""
    from tokenmill.configuration.flag_types import BadValue

    try:
        Slo.parse(text)
    except ValueError as e:
        raise BadValue(str(e).removeprefix("--slo ")) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenmill.configuration.flag_types import (
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
        "rounds": [[trial_json(t) for t in trials] for trials in history],
        "validation": [trial_json(t) for t in validated.values()],
    }
    (out / "tune.json").write_text(json.dumps(result, indent=1))
    write_report(history, list(validated.values()), verdict)
    plot = plot_frontier(history, list(validated.values()), pick, out / "tune_frontier.png")
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
