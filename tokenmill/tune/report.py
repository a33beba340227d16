"""What `tokenmill tune` writes: each trial as JSON, the report, and the plot of goodput against cost."""

from __future__ import annotations

import math
from pathlib import Path

from tokenmill.tune.search import latest
from tokenmill.tune.slo import Trial


def trial_json(t: Trial) -> dict:
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


def write_report(history: list[list[Trial]], validated: list[Trial], verdict: str) -> None:
    print(
        f"\n{'candidate':22s} {'round':>5s} {'s/rate':>6s} {'goodput':>8s} {'at req/s':>8s} {'out tok/s':>9s} "
        f"{'$/1M out':>9s} {'J/token':>9s}"
    )
    stages = [(str(r + 1), trials) for r, trials in enumerate(history)] + [("val", validated)]
    for stage, trials in stages:
        for t in sorted(trials, key=Trial.key):
            j = trial_json(t)
            cost = j["dollars_per_million_output_tokens"]
            jt = j["joules_per_output_token"]
            print(
                f"{t.candidate:22s} {stage:>5s} {t.seconds:6g} {t.goodput_rate:8g} {j['cheapest_at_req_s'] or 0:8g} "
                f"{j['output_tok_s'] or 0:9.1f} "
                f"{'-' if cost is None else f'{cost:.3f}':>9s} "
                f"{'-' if jt is None else f'{jt:.3f}':>9s}" + (f"  ({j['energy_source']})" if jt else "")
            )
    print(verdict)


def plot_frontier(history: list[list[Trial]], validated: list[Trial], pick: Trial | None, path: Path) -> str | None:
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
