"""The int8 block kernels alone against the float path's (quant_ops.cpp), per call: a random
[--rows, 2048] weight of each type, 1 and 4 activation rows, best of 5 x 10 calls; the int8 ones
a row at a time (csrc/ggml_ops.cpp) and eight rows interleaved (csrc/ggml_groups.cpp), alternated.

    .venv/bin/python bench/block_linear.py [--types Q4_K,Q5_K,Q6_K,Q4_1,Q8_0]

For an A/B of two checkouts, run it from each in turn (PYTHONPATH=<checkout>), alternating.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_linear import best_ms
from tests.helpers import random_gguf_blocks
from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import load_native
from tokenmill.quant.blocks import BlockWeight
from tokenmill.quant.packed import PackedWeight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q4_1,Q8_0")
    ap.add_argument("--rows", type=int, default=16384, help="weight rows (16384 x 2048 at 4 bits: ~19 MB)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set up)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert load_native(), "the native kernels did not build"
    print(cpu_info().describe())
    n, k = args.rows, 2048
    for t in args.types.split(","):
        raw = random_gguf_blocks(t, n, k)
        blocks, widened = BlockWeight.from_gguf(t, raw, (n, k)), PackedWeight.from_gguf(t, raw, (n, k))
        grouped = BlockWeight.for_native([BlockWeight.from_gguf(t, raw, (n, k))])[0]
        for rows in (1, 4):
            x = torch.randn(rows, k)
            a = best_ms(lambda w=widened, x=x: w.matmul(x, True))
            b = best_ms(lambda w=blocks, x=x: w.matmul(x, True))
            g = best_ms(lambda w=grouped, x=x: w.matmul(x, True)) if grouped.grouped else float("nan")
            b2 = best_ms(lambda w=blocks, x=x: w.matmul(x, True))
            b = min(b, b2)
            print(
                f"{t} rows {rows}: float {a:.2f} ms, int8 by row {b:.2f} ms ({blocks.nbytes / b / 1e6:.1f} GB/s), "
                f"int8 grouped {g:.2f} ms ({blocks.nbytes / g / 1e6:.1f} GB/s)"
            )


if __name__ == "__main__":
    main()
