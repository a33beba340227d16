"""Where a decode step's time goes: the whole step against each quantised linear timed alone
(one row, the model's own weights), grouped by projection.

    .venv/bin/python bench/linear_profile.py MODEL.gguf [--arithmetic int8|float]

Timed alone, a layer's weights stay in the last-level cache between calls, so the linears'
GB/s here are an upper bound of what they read inside a step, where every weight streams
from DRAM once.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info
from tokenmill.quant.packed import QuantLinear


def best_of(fn, rounds: int = 7, calls: int = 5) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--arithmetic", default="int8")
    args = ap.parse_args()
    print(cpu_info().describe())
    llm = LLM(
        args.model, quant_arithmetic=args.arithmetic, progress=False, kv_cache_memory="256MiB", max_model_len=1024
    )
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    step = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate(["The quick brown fox jumps over the lazy"], params)[0]
        step = min(step, (time.perf_counter() - t0 - (out.timings[0].ttft or 0.0)) / 63)
    print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s), dtype {llm.parts.dtype}")
    seconds: collections.Counter[str] = collections.Counter()
    nbytes: collections.Counter[str] = collections.Counter()
    for name, m in llm.parts.model.named_modules():
        if isinstance(m, QuantLinear):
            x = torch.randn(1, m.in_features).to(llm.parts.dtype)
            key = name.rsplit(".", 1)[-1]
            seconds[key] += best_of(lambda m=m, x=x: m(x))
            nbytes[key] += sum(p.nbytes for p in m.parts)
    for key, s in seconds.most_common():
        print(f"{key:14s} {s * 1e3:7.2f} ms {nbytes[key] / 1e6:8.1f} MB {nbytes[key] / s / 1e9:6.1f} GB/s")
    total = sum(seconds.values())
    print(
        f"linears {total * 1e3:.2f} ms of the {step * 1e3:.2f} ms step "
        f"({sum(nbytes.values()) / 1e6:.0f} MB at {sum(nbytes.values()) / total / 1e9:.1f} GB/s)"
    )


if __name__ == "__main__":
    main()
