"""A calibrated model of one engine step, and what it predicts for a load.

Why calibrated: on a CPU with a small model a decode step is not bound by reading the
weights (``tokenmill plan``'s bandwidth bound was 4-8x too fast at 135M): a fixed cost
per step (Python, kernel launches, sampling) and a cost per sequence (its logits over
the vocabulary, its attention) dominate, and only a measurement says how large they are
on this machine with this configuration. So a short probe times the real engine's steps
and fits

    decode step of B sequences holding K KV tokens in all:   t = a + b * B + c * K
    prefill chunk of n tokens after s already computed:      t = pa + p * n + q * n * (s + n / 2)

(``q``: attention, each new token reads the tokens before it). The fitted numbers, with
what they were measured on, are a *profile*: a JSON file that ``tokenmill plan`` reads
(``--profile FILE``; by default ``default_profile_path``: one file per model and
configuration under ``$XDG_CACHE_HOME/tokenmill/profiles``) and ``--calibrate`` writes.

From a profile, a load of ``rate`` requests/s of ``I`` prompt tokens and ``O`` output
tokens (``predict_load``): prefill work per request is ``p * I + q * I**2 / 2`` seconds
whatever the chunking (the chunks' sums telescope), riding in the decode steps; by
Little's law the sequences decoding at once are ``N = rate * O * tpot(N)`` with
``tpot(N) = decode_step(N) / (1 - rate * prefill_per_request)``, solved by bisection;
above the engine's capacity (``max_num_seqs`` or the KV cache full) the queue grows and
the output rate is capacity's. Energy: the probe's watts while busy (measured or
estimated, as the engine's meter is) times the busy share of each second. Not modelled:
idle power (a RAPL machine's package draws some when idle), preemption, speculation.

No torch here: the probe times the engine's own steps (as ``engine.load_price`` does), whole
(``Engine.step``: the output processing of each token is a cost per sequence too).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tokenmill.host.energy import dollars_per_million

PROFILE_VERSION = 1
PROBE_BATCHES = (1, 2, 4, 8, 16)
PROBE_CONTEXTS = (128, 1024)
PROBE_PROMPTS = (32, 128, 384, 1024)  # prefill lengths (chunked as the engine's budget says)
PROBE_STEPS = 10  # decode steps per (batch, context) and sweep
PROBE_SWEEPS = 2  # sweeps over the (batch, context) grid, the second in reverse: a point is the median of all its steps
REQUEST_ID = "tokenmill-step-probe"


def default_profile_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill" / "profiles"


def default_profile_path(fingerprint: dict) -> Path:
    """Where a configuration's profile lives unless ``--profile`` says: a readable name
    (model, weights, KV dtype, threads) that two different configurations never share."""
    parts = [fingerprint.get(k) for k in ("model", "dtype", "weights", "kv_cache_dtype", "kernels", "threads")]
    name = "_".join(str(p) for p in parts if p is not None)
    return default_profile_dir() / ("".join(ch if ch.isalnum() or ch in "-._" else "-" for ch in name) + ".json")


# ------------------------------------------------------------------------- fitting


def least_squares(rows: list[list[float]], ys: list[float], relative: bool = True) -> list[float]:
    """Coefficients x minimising sum(((row . x - y) / y)**2) (``relative``: each point's
    error as a share of it, so that 10 ms steps count as much as 200 ms ones), by the
    normal equations and Gauss-Jordan elimination with partial pivoting."""
    k = len(rows[0])
    if len(rows) < k:
        raise ValueError(f"{len(rows)} points cannot fit {k} coefficients")
    w = [1 / y**2 if relative else 1.0 for y in ys]
    m = [[sum(wi * r[i] * r[j] for wi, r in zip(w, rows, strict=True)) for j in range(k)] for i in range(k)]
    v = [sum(wi * r[i] * y for wi, r, y in zip(w, rows, ys, strict=True)) for i in range(k)]
    aug = [m[i] + [v[i]] for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(aug[r][col]))
        if abs(aug[piv][col]) < 1e-300:
            raise ValueError("the points do not determine the coefficients (a column is constant or repeated)")
        aug[col], aug[piv] = aug[piv], aug[col]
        for r in range(k):
            if r != col:
                f = aug[r][col] / aug[col][col]
                aug[r] = [x - f * y for x, y in zip(aug[r], aug[col], strict=True)]
    return [aug[i][k] / aug[i][i] for i in range(k)]


def fit_nonnegative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """``least_squares`` with no negative coefficient: a cost cannot be negative, and a
    noisy probe can make a small one come out so; such a column is dropped (its
    coefficient 0) and the rest refitted, until none is negative."""
    active = list(range(len(rows[0])))
    while True:
        sub = least_squares([[r[i] for i in active] for r in rows], ys)
        coef = [0.0] * len(rows[0])
        for i, x in zip(active, sub, strict=True):
            coef[i] = x
        negative = [i for i, x in zip(active, sub, strict=True) if x < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))
        if not active:
            return [0.0] * len(rows[0])


def rms_relative_error(rows: list[list[float]], ys: list[float], coef: list[float]) -> float:
    errs = [(sum(c * x for c, x in zip(coef, r, strict=True)) - y) / y for r, y in zip(rows, ys, strict=True)]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


@dataclass(frozen=True)
class DecodePoint:
    """The median duration of decode steps of ``batch`` sequences holding ``kv_tokens``."""

    batch: int
    kv_tokens: float
    seconds: float


@dataclass(frozen=True)
class PrefillPoint:
    """A prefill chunk of ``tokens`` after ``start`` already computed, one sequence alone."""

    tokens: int
    start: int
    seconds: float


def decode_features(pt: DecodePoint) -> list[float]:
    return [1.0, float(pt.batch), float(pt.kv_tokens)]


def prefill_features(pt: PrefillPoint) -> list[float]:
    return [1.0, float(pt.tokens), pt.tokens * (pt.start + pt.tokens / 2)]


# ----------------------------------------------------------------------- the model


@dataclass(frozen=True)
class StepModel:
    """Fitted seconds (see the module's docstring) and the power while busy."""

    a: float  # a decode step's fixed cost
    b: float  # per sequence in it
    c: float  # per KV token its sequences hold
    pa: float  # a prefill step's fixed cost, alone
    p: float  # per prompt token
    q: float  # per prompt token per token before it
    busy_watts: float  # joules per second while the engine steps (its meter's source: Profile.energy_source)
    busy_cpus: float  # CPU seconds per second while it steps (threads really kept busy)

    def decode_step(self, batch: float, context: float) -> float:
        return self.a + self.b * batch + self.c * batch * context

    def decode_tok_s(self, batch: int, context: float) -> float:
        return batch / self.decode_step(batch, context)

    def prefill_step(self, tokens: int, start: int = 0) -> float:
        return self.pa + self.p * tokens + self.q * tokens * (start + tokens / 2)

    def prefill_work(self, prompt_tokens: float) -> float:
        """Seconds a prompt adds to the steps it rides in (not the steps' fixed cost)."""
        return self.p * prompt_tokens + self.q * prompt_tokens**2 / 2

    @classmethod
    def fit(cls, decode: list[DecodePoint], prefill: list[PrefillPoint], busy_watts: float, busy_cpus: float):
        a, b, c = fit_nonnegative([decode_features(x) for x in decode], [x.seconds for x in decode])
        pa, p, q = fit_nonnegative([prefill_features(x) for x in prefill], [x.seconds for x in prefill])
        return cls(a, b, c, pa, p, q, busy_watts, busy_cpus)


@dataclass(frozen=True)
class Profile:
    """A StepModel and what it was measured on: the configuration (``fingerprint``: a
    profile read for another one is refused), the probe's points, and how well it fits."""

    model: StepModel
    fingerprint: dict
    energy_source: str  # measured (RAPL/NVML) or estimated
    decode_points: list[DecodePoint] = field(default_factory=list)
    prefill_points: list[PrefillPoint] = field(default_factory=list)
    created: str = ""
    probe_seconds: float = 0.0

    @classmethod
    def from_points(
        cls,
        decode: list[DecodePoint],
        prefill: list[PrefillPoint],
        fingerprint: dict,
        busy_watts: float,
        busy_cpus: float,
        energy_source: str,
        probe_seconds: float = 0.0,
    ) -> Profile:
        model = StepModel.fit(decode, prefill, busy_watts, busy_cpus)
        created = time.strftime("%Y-%m-%dT%H:%M:%S")
        return cls(model, fingerprint, energy_source, list(decode), list(prefill), created, probe_seconds)

    def fit_errors(self) -> tuple[float, float]:
        """RMS relative error of the decode and prefill fits on the probe's own points."""
        m = self.model
        dec = rms_relative_error(
            [decode_features(x) for x in self.decode_points], [x.seconds for x in self.decode_points], [m.a, m.b, m.c]
        )
        pre = rms_relative_error(
            [prefill_features(x) for x in self.prefill_points],
            [x.seconds for x in self.prefill_points],
            [m.pa, m.p, m.q],
        )
        return dec, pre

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "fingerprint": self.fingerprint,
            "created": self.created,
            "probe_seconds": self.probe_seconds,
            "energy_source": self.energy_source,
            "model": asdict(self.model),
            "decode_points": [asdict(x) for x in self.decode_points],
            "prefill_points": [asdict(x) for x in self.prefill_points],
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}: calibrate again")
        return cls(
            StepModel(**data["model"]),
            data["fingerprint"],
            data["energy_source"],
            [DecodePoint(**x) for x in data.get("decode_points", [])],
            [PrefillPoint(**x) for x in data.get("prefill_points", [])],
            data.get("created", ""),
            data.get("probe_seconds", 0.0),
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))

    def mismatch(self, fingerprint: dict) -> list[str]:
        """What differs between the configuration measured and ``fingerprint`` (empty: same)."""
        keys = sorted(set(self.fingerprint) | set(fingerprint))
        return [
            f"{k}: profile {self.fingerprint.get(k)!r}, now {fingerprint.get(k)!r}"
            for k in keys
            if self.fingerprint.get(k) != fingerprint.get(k)
        ]


# ------------------------------------------------------------------ predicting a load


@dataclass(frozen=True)
class LoadPrediction:
    rate: float  # offered, req/s (inf: as many as it takes)
    capacity_rate: float  # the most req/s it sustains (max_seqs decoding, prefill riding along)
    stable: bool  # rate below capacity: no queue builds
    output_tok_s: float
    concurrency: float  # sequences decoding at once, on average
    tpot: float  # seconds per output token after the first
    busy: float  # share of each second the engine steps
    joules_per_token: float
    dollars_per_million: float | None  # output tokens, at the price per hour given


def predict_load(
    m: StepModel,
    rate: float,
    input_len: int,
    output_len: int,
    max_seqs: int,
    price_per_hour: float | None = None,
    watts: float | None = None,
) -> LoadPrediction:
    """Steady state of ``rate`` requests/s (see the module's docstring); ``watts`` while
    busy overrides the profile's (``--watts-per-cpu`` x its busy CPUs)."""
    ctx = input_len + output_len / 2  # a decoding sequence's mean context
    work = m.prefill_work(input_len)
    max_seqs = max(1, max_seqs)
    # at capacity max_seqs decode, and each second holds X prefills and X * O / max_seqs steps
    capacity = 1 / (work + output_len * m.decode_step(max_seqs, ctx) / max_seqs)
    stable = rate < capacity
    if stable:
        free = 1 - rate * work  # the share of each second not spent on prompts

        def excess(n: float) -> float:  # Little's law: n - rate * O * tpot(n), tpot of a batch of at least one
            return n - rate * output_len * m.decode_step(max(n, 1.0), ctx) / free

        lo, hi = 0.0, float(max_seqs)
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if excess(mid) >= 0 else (mid, hi)
        n = hi
        tpot = m.decode_step(max(n, 1.0), ctx) / free
        out = rate * output_len
        busy = min(1.0, rate * work + out / max(n, 1.0) * m.decode_step(max(n, 1.0), ctx))
    else:
        n = float(max_seqs)
        tpot = m.decode_step(n, ctx) * (1 + capacity * work / (1 - capacity * work))
        out = capacity * output_len
        busy = 1.0
    w = m.busy_watts if watts is None else watts
    dollars = None if price_per_hour is None else dollars_per_million(price_per_hour, 1.0, out)  # one second's tokens
    return LoadPrediction(rate, capacity, stable, out, n, tpot, busy, w * busy / out if out > 0 else math.inf, dollars)


# ---------------------------------------------------------------------- the probe


def probe(
    engine,
    batches=PROBE_BATCHES,
    contexts=PROBE_CONTEXTS,
    prompts=PROBE_PROMPTS,
    steps=PROBE_STEPS,
    watts_per_cpu: float | None = None,
    sweeps=PROBE_SWEEPS,
) -> ProbeResult:
    """Time decode steps at each batch and context, and prefills of each prompt length,
    on this idle ``Engine``. Batches beyond ``max_num_seqs`` and contexts beyond what the KV
    cache holds for the largest batch are left out or shrunk. The probe's steps and
    prefix-cache lookups are taken back out of the core's counters."""
    from tokenmill.engine.core.load_price import unrecorded
    from tokenmill.host.energy import EnergyMeter, process_tree_cpu_seconds
    from tokenmill.sampling_params import SamplingParams

    core = engine.core
    if core.has_unfinished():
        raise RuntimeError("the step probe runs on an idle engine")
    batches = [b for b in batches if b <= core.config.scheduler.max_num_seqs] or [1]
    limit = core.max_model_len - steps - 2
    num_blocks = core.block_pool.num_blocks
    fitted = []
    for ctx in contexts:
        ctx = min(ctx, limit)
        while ctx > 16 and max(batches) * core.kv.blocks_for(ctx + steps + 2) + 2 > num_blocks:
            ctx //= 2
        if ctx not in fitted:
            fitted.append(ctx)
    rng = random.Random()  # prompts no cache holds
    ids = 0

    def run(prompt: list[int], params: SamplingParams) -> list:
        """The request's steps' stats, each with the whole ``Engine.step``'s wall time as
        its duration (output processing and detokenisation included: a user's tokens pay
        for them too)."""
        nonlocal ids
        ids += 1
        out = []
        engine.add_request(f"{REQUEST_ID}-{ids}", prompt, params)
        while engine.has_unfinished():
            before = len(core.step_stats)
            t = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t
            out += [replace(s, duration=took) for s in list(core.step_stats)[before:]]
        return out

    decode: list[DecodePoint] = []
    prefill: list[PrefillPoint] = []
    busy = 0.0
    t0 = time.perf_counter()
    with unrecorded(core):
        run([rng.randrange(core.vocab_size) for _ in range(64)], SamplingParams(max_tokens=4, n=2, ignore_eos=True))
        meter = EnergyMeter(watts_per_cpu)  # after the warm-up: its first calls are no step's cost
        cpu0 = process_tree_cpu_seconds()
        # Sweeps in alternating order, each point the median of all its sweeps' steps: one
        # sweep's points were taken seconds apart, and a shared machine's slow patch bent the
        # fit (the 16-sequence decode predicted 18-23% fast, once).
        grid = [(ctx, b) for ctx in fitted for b in batches]
        steps_at: dict[tuple[int, int], list] = {}
        prompts_at = {ctx: [rng.randrange(core.vocab_size) for _ in range(ctx)] for ctx in fitted}
        for sweep in range(sweeps):
            for ctx, b in grid if sweep % 2 == 0 else grid[::-1]:
                # the same prompt: after the first, the prefix cache spares its prefill
                stats = run(prompts_at[ctx], SamplingParams(max_tokens=steps + 1, n=b, ignore_eos=True, seed=0))
                busy += sum(s.duration for s in stats)
                steps_at.setdefault((ctx, b), []).extend(
                    s for s in stats if not s.num_prefill_tokens and s.num_seqs == b
                )
        for (_, b), dec in steps_at.items():
            if dec:
                kv = statistics.median(s.kv_tokens_held for s in dec)
                decode.append(DecodePoint(b, kv, statistics.median(s.duration for s in dec)))
        for n in prompts:
            n = min(n, limit)
            best: dict[tuple[int, int], float] = {}
            for _ in range(2):  # the faster of two: the first of a shape pays first calls
                stats = run([rng.randrange(core.vocab_size) for _ in range(n)], SamplingParams(max_tokens=1))
                busy += sum(s.duration for s in stats)
                start = 0
                for s in stats:
                    if s.num_prefill_tokens and s.num_seqs == 1:
                        key = (s.num_prefill_tokens, start)
                        best[key] = min(best.get(key, math.inf), s.duration)
                        start += s.num_prefill_tokens
            prefill += [PrefillPoint(k[0], k[1], t) for k, t in best.items()]
        energy = meter.read()
        cpu = process_tree_cpu_seconds() - cpu0
    return ProbeResult(decode, prefill, busy, cpu, energy.joules, energy.source, time.perf_counter() - t0)


@dataclass(frozen=True)
class ProbeResult:
    decode: list[DecodePoint]
    prefill: list[PrefillPoint]
    busy_seconds: float  # the timed steps' durations, summed
    cpu_seconds: float  # this process tree's, over the same time
    joules: float
    energy_source: str
    seconds: float  # the whole probe, warm-up included

    def profile(self, fingerprint: dict) -> Profile:
        return Profile.from_points(
            self.decode,
            self.prefill,
            fingerprint,
            busy_watts=self.joules / self.busy_seconds,
            busy_cpus=self.cpu_seconds / self.busy_seconds,
            energy_source=self.energy_source,
            probe_seconds=self.seconds,
        )
