"""`tokenmill plan`: what a configuration can serve, from the inference arithmetic.

Decode is bound by memory traffic: every step reads all the weights once (shared by
the batch) plus each sequence's K/V. So, with bandwidth BW, weights W read per step,
KV bytes per token k and context C:

    single-stream decode   <= BW / (W + k * C)                  tokens/s
    batch of B             <= B * BW / (W + B * k * C)          tokens/s
    sequences that fit      = floor(KV budget / (k * C)), in whole blocks

Energy and cost follow from the decode rate: with every compute thread busy at P watts
each (``--watts-per-cpu``, tokenmill/host/energy.py's default otherwise) a token costs
``threads * P / rate`` joules, and at ``--price-per-hour`` dollars the machine's hour buys
``3600 * rate`` tokens.

The bound is a bound: on a CPU with a small model the steps' fixed and per-sequence costs
dominate and real decoding runs at a fraction of it. What predicts is a *profile*, a step
model calibrated on this machine with this configuration (tokenmill/plan/step_model.py):
``--calibrate`` probes the engine for some seconds and writes it (``--profile FILE``, or
the default path printed), later plans read it. From it: single-stream decode tok/s, decode
tok/s of ``--concurrency`` sequences, and for a load (``--rate``, ``--input-len``,
``--output-len``) the output tok/s, time per output token, J per token and $ per 1M tokens.

``--measure`` runs the engine with the same configuration, apart from the probe
(tokenmill/plan/load_measure.py), and prints the measured figures beside the predicted ones
with their ratio (joules from RAPL where readable, else the estimate).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from tokenmill.configuration.flag_types import NON_NEGATIVE_FLOAT, POSITIVE_FLOAT, POSITIVE_INT


def measure_bandwidth(size_mib: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (bytes read + bytes written), best of a few copies."""
    import torch  # here, not at the top: the CLI's parser imports this module

    src = torch.ones(size_mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


@dataclass
class Plan:
    weight_bytes: int  # held in memory
    weight_bytes_per_step: int  # read by one decode step
    kv_bytes_per_token: int
    kv_budget_bytes: int
    context_len: int
    block_size: int
    bandwidth: float  # bytes/s

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def max_seqs(self) -> int:
        return self.num_blocks // self.blocks_per_seq

    def decode_bound(self, batch: int = 1, context: int | None = None) -> float:
        """Tokens/s a batch of `batch` sequences at `context` tokens can at best decode."""
        ctx = self.context_len if context is None else context
        return batch * self.bandwidth / (self.weight_bytes_per_step + batch * self.kv_bytes_per_token * ctx)


def make_plan(llm, kv_budget: int, context_len: int, bandwidth: float) -> Plan:
    from tokenmill.quant.weights import weight_bytes

    model = llm.model
    total = weight_bytes(model)
    embed = sum(t.numel() * t.element_size() for t in model.embed_tokens.state_dict().values())
    per_step = total - embed  # a step reads only a few embedding rows...
    if model.head_reads_embedding:
        per_step += embed  # ...unless the tied LM head reads it all
    block_size = llm.args.cache.block_size
    return Plan(
        total, per_step, llm.parts.kv_bytes_per_block // block_size, kv_budget, context_len, block_size, bandwidth
    )


def fingerprint(llm) -> dict:
    """What a step profile depends on: a profile made for another is not this one's."""
    from tokenmill.kernels.cpu import cpu_info

    return {
        "model": llm.model_path.name,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "weights": llm.quantization,
        "kv_cache_dtype": llm.kv_cache_dtype,
        "kernels": llm.parts.model.ops.name,
        "device": str(llm.device),
        "threads": _threads(llm),
        "cpu": cpu_info().model,
    }


def load_profile(args: argparse.Namespace, llm):
    """The profile for this configuration: probed now (``--calibrate``, or ``--measure``
    with none saved) and written, or read from ``--profile`` / the default path; None
    where there is none, or where the file is another configuration's (refused, and left
    as it is unless ``--calibrate`` says to replace it)."""
    from pathlib import Path

    from tokenmill.plan.step_model import Profile, default_profile_path, probe

    fp = fingerprint(llm)
    path = Path(args.profile) if args.profile else default_profile_path(fp)
    if not args.calibrate and path.exists():
        profile = Profile.load(path)
        if not profile.mismatch(fp):
            return profile, path, "read"
        print(f"  profile {path} is another configuration's: {'; '.join(profile.mismatch(fp))}", file=sys.stderr)
        return None, path, "mismatch"  # not overwritten: `--calibrate` does that, when asked
    if not args.calibrate and not args.measure:
        return None, path, "none"
    print("calibrating the step model ...", file=sys.stderr, flush=True)
    profile = probe(llm.engine, watts_per_cpu=args.watts_per_cpu).profile(fp)
    profile.save(path)
    return profile, path, "written"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-len", type=POSITIVE_INT, default=2048, help="tokens per sequence (prompt + output)")
    p.add_argument(
        "--bandwidth", type=POSITIVE_FLOAT, default=None, help="memory bandwidth in GB/s (default: measured now)"
    )
    p.add_argument("--measure", action="store_true", help="run the engine and print measured beside predicted")
    p.add_argument(
        "--watts-per-cpu",
        type=POSITIVE_FLOAT,
        default=None,
        help="power per busy logical CPU for the energy figures (default 3)",
    )
    p.add_argument(
        "--price-per-hour",
        type=NON_NEGATIVE_FLOAT,
        default=None,
        help="the machine's $ per hour: adds $ per 1M tokens",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="the calibrated step model to read (with --calibrate: to write); default: one per configuration "
        "under $XDG_CACHE_HOME/tokenmill/profiles (~/.cache/...)",
    )
    p.add_argument("--calibrate", action="store_true", help="probe the engine (seconds) and write the profile")
    p.add_argument(
        "--concurrency",
        type=POSITIVE_INT,
        default=16,
        help="sequences decoding together, predicted (default %(default)s)",
    )
    p.add_argument(
        "--rate", type=POSITIVE_FLOAT, default=None, help="a load: requests/s (default: the predicted capacity's load)"
    )
    p.add_argument("--input-len", type=POSITIVE_INT, default=256, help="a load's prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=POSITIVE_INT, default=128, help="a load's output tokens (default %(default)s)")
    p.add_argument(
        "--measure-seconds",
        type=POSITIVE_FLOAT,
        default=30,
        help="--measure: seconds of arrivals for the load (default %(default)s)",
    )


def run_several(args: argparse.Namespace, planned: list) -> int:
    """`tokenmill plan --model A=... --model B=...`: each model's plan, as `tokenmill serve`
    would load it (its share of the KV budget), then what they need together against the
    memory free now."""
    from tokenmill.configuration.memory import available_memory
    from tokenmill.llm import LLM

    bw = args.bandwidth * 1e9 if args.bandwidth else measure_bandwidth()
    total = 0
    for spec, engine_args in planned:
        print(f"model {spec.name}:")
        llm = LLM(args=engine_args, progress=False)
        try:
            plan = report(args, llm, bw)
        finally:
            llm.close()
        total += plan.weight_bytes + plan.kv_budget_bytes
    free, gib = available_memory(), 1 << 30
    verdict = "fits" if total <= free else "does NOT fit: lower --kv-cache-memory or a model's kv_cache_memory="
    print(f"all {len(planned)} models: weights + KV {total / gib:.3f} GiB; {free / gib:.2f} GiB free now: {verdict}")
    return 0 if total <= free else 1


def run(args: argparse.Namespace, llm) -> int:
    report(args, llm, args.bandwidth * 1e9 if args.bandwidth else measure_bandwidth())
    return 0


def report(args: argparse.Namespace, llm, bw: float) -> Plan:
    """Print one model's plan (and, with --measure, the measured figures beside it)."""
    from tokenmill.configuration.memory import parse_memory

    plan = make_plan(llm, parse_memory(llm.args.cache.kv_cache_memory), args.context_len, bw)
    gib = 1 << 30
    rows = [
        ("weights in memory", f"{plan.weight_bytes / gib:.3f} GiB"),
        ("weights read per decode step", f"{plan.weight_bytes_per_step / gib:.3f} GiB"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,} B ({llm.kv_cache_dtype})"),
        ("KV budget", f"{plan.kv_budget_bytes / gib:.3f} GiB = {plan.num_blocks} blocks of {plan.block_size}"),
        (f"max sequences of {plan.context_len} tokens", f"{plan.max_seqs}"),
        ("memory bandwidth", f"{bw / 1e9:.1f} GB/s" + (" (measured)" if not args.bandwidth else "")),
        (f"decode bound, 1 sequence at {plan.context_len} tokens", f"{plan.decode_bound(1):.1f} tok/s"),
        (f"decode bound, {max(plan.max_seqs, 1)} sequences", f"{plan.decode_bound(max(plan.max_seqs, 1)):.1f} tok/s"),
    ]
    from tokenmill.host.energy import DEFAULT_WATTS_PER_CPU, dollars_per_million

    watts = (args.watts_per_cpu or DEFAULT_WATTS_PER_CPU) * _threads(llm)
    seqs = max(plan.max_seqs, 1)
    for label, rate in (("1 sequence", plan.decode_bound(1)), (f"{seqs} sequences", plan.decode_bound(seqs))):
        rows.append((f"energy per token at the bound, {label}", f"{watts / rate:.3f} J (estimated, {watts:g} W)"))
        if args.price_per_hour is not None:
            rows.append(
                (
                    f"$ per 1M tokens at the bound, {label}",
                    f"${dollars_per_million(args.price_per_hour, 1.0, rate):.2f}",
                )
            )
    from tokenmill.kernels.cpu import cpu_info

    print(
        f"plan for {llm.model_path.name}: dtype {str(llm.dtype).removeprefix('torch.')}, "
        f"weights {llm.quantization}, KV {llm.kv_cache_dtype}, kernels {llm.parts.model.ops.name}"
    )
    print(f"  CPU: {cpu_info().describe()}; native bfloat16: {'yes' if cpu_info().native_bf16 else 'no'}")
    for k, v in rows:
        print(f"  {k:45s} {v}")
    profile, path, how = load_profile(args, llm)
    if profile is None:
        hint = "another configuration's" if how == "mismatch" else "none yet"
        print(f"  step profile: {hint} at {path}; `--calibrate` probes the engine and writes one")
        if args.measure:
            print(f"  {'max sequences, measured':45s} {_max_seqs_measured(llm, plan)}")
        return plan
    predict(args, llm, plan, profile, path, how)
    return plan


def predict(args: argparse.Namespace, llm, plan: Plan, profile, path, how: str) -> None:
    """The step model's rows, and with --measure the measured ones beside them."""
    import math

    from tokenmill.plan.step_model import predict_load

    m = profile.model
    dec_err, pre_err = profile.fit_errors()
    watts = None if args.watts_per_cpu is None else args.watts_per_cpu * m.busy_cpus
    busy_w = m.busy_watts if watts is None else watts
    print(
        f"  step profile ({how} {path}, {profile.created}, probe {profile.probe_seconds:.1f} s): decode step "
        f"{m.a * 1e3:.2f} ms + {m.b * 1e3:.3f} ms/seq + {m.c * 1e6:.4f} us/KV token (fit +-{dec_err:.0%}); "
        f"prefill {m.p * 1e6:.1f} us/token + {m.q * 1e9:.2f} ns/token/context (fit +-{pre_err:.0%}); "
        f"{busy_w:.1f} W busy ({profile.energy_source if watts is None else 'estimated'}, "
        f"{m.busy_cpus:.2f} CPUs)"
    )
    ctx = plan.context_len
    sched = llm.args.scheduler
    conc = max(1, min(args.concurrency, plan.max_seqs or 1, sched.max_num_seqs))
    blocks = -(-(args.input_len + args.output_len) // plan.block_size)
    load_seqs = max(1, min(sched.max_num_seqs, plan.num_blocks // blocks))
    cap = predict_load(m, math.inf, args.input_len, args.output_len, load_seqs, args.price_per_hour, watts)
    rate = args.rate if args.rate is not None else math.inf
    load = predict_load(m, rate, args.input_len, args.output_len, load_seqs, args.price_per_hour, watts)
    single_ctx = ctx - 32  # --measure decodes 64 tokens after a prompt of context - 32
    rows = [
        (f"single-stream decode tok/s at {ctx} tokens", m.decode_tok_s(1, single_ctx)),
        (f"decode tok/s, {conc} sequences at {ctx} tokens", m.decode_tok_s(conc, single_ctx)),
    ]
    label = f"{args.input_len}+{args.output_len} tokens at " + (
        f"{rate:g} req/s" if math.isfinite(rate) else "capacity"
    )
    print(
        f"  load of {args.input_len} prompt + {args.output_len} output tokens: capacity "
        f"{cap.capacity_rate:.2f} req/s ({load_seqs} sequences at most); "
        + (f"{rate:g} req/s is {'below' if load.stable else 'ABOVE'} it" if math.isfinite(rate) else "at capacity")
        + f", {load.concurrency:.1f} decoding at once, busy {load.busy:.0%}"
    )
    rows += [
        (f"output tok/s, {label}", load.output_tok_s),
        (f"time per output token (ms), {label}", load.tpot * 1e3),
        (f"J per output token, {label}", load.joules_per_token),
    ]
    if args.price_per_hour is not None:
        rows.append((f"$ per 1M output tokens, {label}", load.dollars_per_million))
    measured: list[float | None] = [None] * len(rows)
    if args.measure:
        from tokenmill.plan.load_measure import measure_decode, measure_load

        print("measuring ...", file=sys.stderr, flush=True)
        measured[0] = measure_decode(llm.engine, 1, ctx)
        measured[1] = measure_decode(llm.engine, conc, ctx)
        # a finite rate for --measure-seconds; at capacity, twice the sequences it holds or capacity's seconds' worth
        n = (
            round(rate * args.measure_seconds)
            if math.isfinite(rate)
            else round(cap.capacity_rate * args.measure_seconds)
        )
        n = n if math.isfinite(rate) else max(n, 2 * load_seqs)
        got = measure_load(llm.engine, n, rate, args.input_len, args.output_len, args.watts_per_cpu)
        measured[2:5] = [got.output_tok_s, got.tpot * 1e3, got.joules_per_token]
        if args.price_per_hour is not None:
            from tokenmill.host.energy import dollars_per_million

            measured[5] = dollars_per_million(args.price_per_hour, 1.0, got.output_tok_s)
        print(
            f"  load measured: {got.requests} requests in {got.seconds:.1f} s, TTFT p50 {got.ttft_p50:.2f} s, "
            f"energy {got.energy_source}"
        )
    print(f"  {'':52s} {'predicted':>10s}" + (f" {'measured':>10s} {'ratio':>6s}" if args.measure else ""))
    for (label, value), got in zip(rows, measured, strict=True):
        line = f"  {label:52s} {_num(value):>10s}"
        if args.measure:
            ratio = f"{value / got:.2f}" if got and value is not None and math.isfinite(got) else "-"
            line += f" {_num(got):>10s} {ratio:>6s}"
        print(line)
    if args.measure:
        print(f"  {f'max sequences of {ctx} tokens':52s} {plan.max_seqs:10d} {_max_seqs_measured(llm, plan):10d}")


def _max_seqs_measured(llm, plan: Plan) -> int:
    from tokenmill.plan.load_measure import measure_max_seqs

    return measure_max_seqs(llm.engine, plan.max_seqs + 2, plan.context_len)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def _threads(llm) -> int:
    """The compute threads a decode step keeps busy."""
    import torch

    return torch.get_num_threads() if llm.device.type == "cpu" else 1
