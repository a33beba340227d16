"""The int8 block kernels alone (csrc/ggml_ops.cpp) against the float path's (quant_ops.cpp), per call:
a random [16384, 2048] weight of each type, 1 and 4 activation rows, best of 5 x 10 calls.

    .venv/bin/python bench/block_linear.py [--types Q4_K,Q5_K,Q6_K,Q4_1,Q8_0]

For an A/B of two checkouts, run it from each in turn (PYTHONPATH=<checkout>), alternating.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import load_native
from tokenmill.quant.blocks import BlockWeight
from tokenmill.quant.packed import PackedWeight


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes with small float16 scales where the type keeps them."""
    import gguf

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    at = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[type_name]
    for pos in at:
        d = rng.uniform(0.0001, 0.002, size=raw.shape[:2]).astype(np.float16)
        raw[..., pos : pos + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def best_ms(f, calls: int = 10, repeats: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q4_1,Q8_0")
    args = ap.parse_args()
    assert load_native(), "the native kernels did not build"
    print(cpu_info().describe())
    n, k = 16384, 2048
    for t in args.types.split(","):
        raw = random_blocks(t, n, k)
        blocks, widened = BlockWeight.from_gguf(t, raw, (n, k)), PackedWeight.from_gguf(t, raw, (n, k))
        for rows in (1, 4):
            x = torch.randn(rows, k)
            a = best_ms(lambda w=widened, x=x: w.matmul(x, True))
            b = best_ms(lambda w=blocks, x=x: w.matmul(x, True))
            print(f"{t} rows {rows}: float {a:.2f} ms, int8 {b:.2f} ms ({blocks.nbytes / b / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
