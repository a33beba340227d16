"""`tokenmill plan --measure`: the engine's figures measured end to end, to set beside the
calibrated step model's predictions (plan/step_model.py). No torch: it drives an
``Engine`` (the core and the output processor in this process).

Separate from the probe that made the profile: other prompts, other contexts and batch
sizes, and timed by the tokens' own timestamps (as a client sees them, detokenisation and
output processing included), not by the steps' durations the probe fitted.

- ``measure_decode``: ``batch`` sequences decoding together at ``context`` tokens; the
  prompts share all but their last token (the prefix cache computes the long part once:
  the measurement is of decoding, not of prefill), and the rate is the tokens stamped
  after the last sequence's first token, over the time until the first one ends.
- ``measure_load``: requests of ``input_len`` random tokens and ``output_len`` output
  tokens arriving evenly at ``rate`` per second (``inf``: all at once);
  the output rate is taken between the 20th and the 80th percentile of the requests'
  ends, away from the start (the queue filling) and the tail (the last ones draining).
- ``measure_max_seqs``: how many sequences of ``context`` tokens the KV cache holds at
  once, with the step's limits lifted for the measurement (a 512-token budget admits a
  sequence or two per step while the first ones finish: it measured 5-8 where the cache
  holds 45-88).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace

WINDOW = (0.2, 0.8)  # the share of requests finished that bounds the steady window


def _drive(engine, arrivals: list[float], prompts: list[list[int]], params) -> list:
    """Add each prompt at its arrival (seconds from now) while stepping the engine; the
    finished outputs, in the order they ended."""
    done, i, t0 = [], 0, time.perf_counter()
    base = f"plan-measure-{random.randrange(1 << 30)}"
    while i < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            engine.add_request(f"{base}-{i}", prompts[i], params)
            i += 1
        if engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
        elif i < len(prompts):
            time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
    return done


def measure_decode(engine, batch: int, context: int, tokens: int = 64) -> float:
    """Decode tok/s of ``batch`` sequences at about ``context`` tokens (see the module doc)."""
    from tokenmill.sampling_params import SamplingParams

    rng = random.Random()
    prompt_len = max(2, context - tokens // 2)
    base = [rng.randrange(engine.core.vocab_size) for _ in range(prompt_len - 1)]
    prompts = [base + [rng.randrange(engine.core.vocab_size)] for _ in range(batch)]
    _drive(engine, [0.0], prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # computes the shared part
    outs = _drive(engine, [0.0] * batch, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    timings = [o.timings[0] for o in outs]
    start = max(t.first_token for t in timings)
    end = min(t.token_times[-1] for t in timings)
    n = sum(1 for t in timings for x in t.token_times if start < x <= end)
    return n / (end - start) if end > start else math.nan


def measure_max_seqs(engine, requests: int, context: int) -> int:
    """The most sequences that ran at once when ``requests`` prompts of ``context`` tokens
    (and one output token: a sequence that grew after admission would be preempted, not
    refused, and the count would be admission's) were sent together to this idle engine, its
    scheduler's sequence cap and token budget lifted meanwhile (the KV cache's capacity is
    what is measured, not the step's limits) and restored after."""
    from tokenmill.sampling_params import SamplingParams

    scheduler = engine.core.scheduler
    limits = scheduler.config
    vocab = engine.core.vocab_size
    prompts = [[(i * 7 + j) % vocab for j in range(context)] for i in range(requests)]
    scheduler.config = replace(
        limits,
        max_num_seqs=max(limits.max_num_seqs, requests),
        max_num_batched_tokens=max(limits.max_num_batched_tokens, requests * context),
    )
    try:
        engine.core.step_stats.clear()
        _drive(engine, [0.0] * requests, prompts, SamplingParams(max_tokens=1))
        return max(s.num_seqs for s in engine.core.step_stats)
    finally:
        scheduler.config = limits


@dataclass(frozen=True)
class LoadMeasurement:
    requests: int
    output_tok_s: float  # in the steady window
    tpot: float  # mean over requests
    ttft_p50: float
    joules_per_token: float  # the whole run's joules over its output tokens
    energy_source: str
    seconds: float


def measure_load(
    engine, requests: int, rate: float, input_len: int, output_len: int, watts_per_cpu: float | None = None
) -> LoadMeasurement:
    """``requests`` of ``input_len`` random tokens, evenly at ``rate`` (see the module doc)."""
    from tokenmill.host.energy import EnergyMeter
    from tokenmill.sampling_params import SamplingParams

    n = max(8, requests)
    arrivals = [i / rate if math.isfinite(rate) else 0.0 for i in range(n)]
    rng = random.Random()
    prompts = [[rng.randrange(engine.core.vocab_size) for _ in range(input_len)] for _ in range(n)]
    meter = EnergyMeter(watts_per_cpu)
    t0 = time.perf_counter()
    outs = _drive(engine, arrivals, prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    energy = meter.read()
    timings = [o.timings[0] for o in outs]
    ends = sorted(t.token_times[-1] for t in timings)
    lo, hi = ends[int(WINDOW[0] * (n - 1))], ends[int(WINDOW[1] * (n - 1))]
    in_window = sum(1 for t in timings for x in t.token_times if lo < x <= hi)
    tokens = sum(len(t.token_times) for t in timings)
    tpots = [t.tpot for t in timings if t.tpot is not None]
    ttfts = sorted(t.ttft for t in timings if t.ttft is not None)
    return LoadMeasurement(
        n,
        in_window / (hi - lo) if hi > lo else tokens / elapsed,
        sum(tpots) / len(tpots) if tpots else math.nan,
        ttfts[len(ttfts) // 2] if ttfts else math.nan,
        energy.joules / tokens if tokens else math.nan,
        energy.source,
        elapsed,
    )
