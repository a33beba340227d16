"""What batch-invariant attention costs a prefill (the int8 arithmetic's; model/ops.py
NativeOps.batch_invariant): the paged kernel with one partition size against SDPA for fresh
prefills, the default model, prompts of 256 / 1024 / 2048 tokens, best of 2 alternating.

    .venv/bin/python bench/invariant_attention.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(cpu_info().describe())
    llm = LLM(dtype=args.dtype, progress=False, kv_cache_memory="512MiB", enable_prefix_caching=False)
    ops, one = llm.parts.model.ops, SamplingParams(max_tokens=1, temperature=0)
    for n in (256, 1024, 2048):
        ids = [1000 + (i * 7919) % 40000 for i in range(n)]
        best = {True: 0.0, False: 0.0}
        for invariant in (True, False, True, False):
            ops.batch_invariant = invariant
            llm.generate([ids], one)
            t0 = time.perf_counter()
            llm.generate([ids], one)
            best[invariant] = max(best[invariant], n / (time.perf_counter() - t0))
        print(f"{args.dtype} prompt {n}: prefill tok/s, paged (invariant) {best[True]:.0f}, SDPA {best[False]:.0f}")


if __name__ == "__main__":
    main()
