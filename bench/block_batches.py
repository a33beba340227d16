"""A GGUF block weight times a batch (a prefill chunk, a batched decode step), per call, in GOP/s:
``block_linear`` on a Llama-3.2-1B layer's three shapes (2048x2048, 8192x2048, 2048x8192) at 1, 8,
32 and 256 activation rows, best of 5 (each of at least 64 rows' work).

    .venv/bin/python bench/block_batches.py [--types Q6_K,Q4_K] [--rows 1,8,32,256]

For an A/B of two checkouts, run it from each in turn (``cd <checkout> && PYTHONPATH=<checkout>``):
the script imports the tokenmill of the checkout it lies in.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import random_gguf_blocks
from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import build_name, load_native
from tokenmill.quant.blocks import BlockWeight

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q6_K")
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert load_native(), "the native kernels did not build"
    print(cpu_info().describe(), build_name())
    for t in args.types.split(","):
        for n, k in SHAPES:
            w = BlockWeight.from_gguf(t, random_gguf_blocks(t, n, k, seed=1), (n, k))
            cells = []
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                reps = max(1, 64 // rows)
                torch.ops.tokenmill.block_linear(x, w.qs, w.type_code)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        torch.ops.tokenmill.block_linear(x, w.qs, w.type_code)
                    best = min(best, (time.perf_counter() - t0) / reps)
                cells.append(f"{rows} rows {2 * n * k * rows / best / 1e9:.0f}")
            print(f"{t} {n}x{k}: " + ", ".join(cells) + " GOP/s")


if __name__ == "__main__":
    main()
