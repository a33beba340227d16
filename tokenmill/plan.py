"""`tokenmill plan`: what a configuration can serve, from the inference arithmetic.

Decode is bound by memory traffic: every step reads all the weights once (shared by
the batch) plus each sequence's K/V. So, with bandwidth BW, weights W read per step,
KV bytes per token k and context C:

    single-stream decode   <= BW / (W + k * C)                  tokens/s
    batch of B             <= B * BW / (W + B * k * C)          tokens/s
    sequences that fit      = floor(KV budget / (k * C)), in whole blocks

Energy and cost follow from the decode rate: with every compute thread busy at P watts
each (``--watts-per-cpu``, tokenmill/energy.py's default otherwise) a token costs
``threads * P / rate`` joules, and at ``--price-per-hour`` dollars the machine's hour buys
``3600 * rate`` tokens.

``--measure`` runs the engine with the same configuration and prints the measured
figures beside the predicted ones (joules from RAPL where readable, else the estimate).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass


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


def measure(llm, plan: Plan, tokens: int = 64, watts_per_cpu: float | None = None) -> dict:
    """Single-stream decode tok/s (at a short context) and the most sequences of
    `context_len` tokens that ran at once when two more than predicted were sent
    (`tokenmill plan --measure` lifts the token budget so that prefill speed does
    not limit how many are admitted together)."""
    from tokenmill import SamplingParams
    from tokenmill.energy import EnergyMeter

    prompt = list(range(1000, 1032))
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    meter = EnergyMeter(watts_per_cpu)
    out = llm.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))[0]
    energy = meter.read()
    t = out.timings[0]
    decode = (len(t.token_times) - 1) / (t.token_times[-1] - t.first_token)
    n = plan.max_seqs + 2
    out_len = min(8, plan.context_len // 4)
    prompts = [[1000 + (i * 7 + j) % 20000 for j in range(plan.context_len - out_len)] for i in range(n)]
    llm.engine.core.step_stats.clear()
    llm.generate(prompts, SamplingParams(max_tokens=out_len, ignore_eos=True))
    peak = max(s.num_running for s in llm.engine.core.step_stats)
    return {
        "decode_tok_s": decode,
        "decode_context": len(prompt) + tokens // 2,
        "max_seqs": peak,
        "joules_per_token": energy.joules / tokens,
        "energy_source": energy.source,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-len", type=int, default=2048, help="tokens per sequence (prompt + output)")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (default: measured now)")
    p.add_argument("--measure", action="store_true", help="run the engine and print measured beside predicted")
    p.add_argument(
        "--watts-per-cpu",
        type=float,
        default=None,
        help="power per busy logical CPU for the energy figures (default 3)",
    )
    p.add_argument("--price-per-hour", type=float, default=None, help="the machine's $ per hour: adds $ per 1M tokens")


def run_several(args: argparse.Namespace, planned: list) -> int:
    """`tokenmill plan --model A=... --model B=...`: each model's plan, as `tokenmill serve`
    would load it (its share of the KV budget), then what they need together against the
    memory free now."""
    from tokenmill.llm import LLM
    from tokenmill.memory import available_memory

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
    from tokenmill.memory import parse_memory

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
    from tokenmill.energy import DEFAULT_WATTS_PER_CPU, dollars_per_million

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
    if args.measure:
        print("measuring ...", file=sys.stderr, flush=True)
        m = measure(llm, plan, watts_per_cpu=args.watts_per_cpu)
        predicted = plan.decode_bound(1, m["decode_context"])
        print(f"  {'':45s} {'predicted':>12s} {'measured':>12s}")
        print(
            f"  {'single-stream decode tok/s':45s} {predicted:12.1f} {m['decode_tok_s']:12.1f}"
            f"   ({m['decode_tok_s'] / predicted:.0%} of the bound)"
        )
        print(f"  {f'max sequences of {plan.context_len} tokens':45s} {plan.max_seqs:12d} {m['max_seqs']:12d}")
        print(
            f"  {'single-stream J per token':45s} {watts / predicted:12.3f} {m['joules_per_token']:12.3f}"
            f"   (measured: {m['energy_source']})"
        )
        if args.price_per_hour is not None:
            price = args.price_per_hour
            print(
                f"  {'single-stream $ per 1M tokens':45s} {dollars_per_million(price, 1.0, predicted):12.2f} "
                f"{dollars_per_million(price, 1.0, m['decode_tok_s']):12.2f}"
            )
    return plan


def _threads(llm) -> int:
    """The compute threads a decode step keeps busy."""
    import torch

    return torch.get_num_threads() if llm.device.type == "cpu" else 1
