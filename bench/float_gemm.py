"""Prefill's float GEMM (``tile_gemm``) alone, GFLOP/s: x [m, k] float32 times a weight [n, k]
in float32, float16 or bfloat16, at Llama-3.2-1B's or SmolLM2-135M's shapes, best of ``--repeat``.

    python bench/float_gemm.py --dtype float16 --rows 64,256,512
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import load_native

SHAPES = {  # (k, n): q/o, gate/up, down, k/v
    "1b": [(2048, 2048), (2048, 8192), (8192, 2048), (2048, 512)],
    "135m": [(576, 576), (576, 1536), (1536, 576), (576, 192)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert load_native(), "the native kernels did not build"
    print(f"# {cpu_info().describe()}; torch {torch.__version__}; {args.threads} threads; weight {args.dtype}")
    dtype = getattr(torch, args.dtype)
    total_flop, total_s = 0.0, 0.0
    for m in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES[args.shape]:
            x, w = torch.randn(m, k), (torch.randn(n, k) * 0.02).to(dtype)
            torch.ops.tokenmill.tile_gemm(x, w)
            best = min(_timed(x, w) for _ in range(args.repeat))
            flop = 2.0 * m * n * k
            total_flop, total_s = total_flop + flop, total_s + best
            print(f"m={m:4d} k={k:5d} n={n:5d}  {best * 1e3:8.2f} ms  {flop / best / 1e9:7.1f} GFLOP/s")
    print(f"all shapes: {total_flop / total_s / 1e9:.1f} GFLOP/s")


def _timed(x: torch.Tensor, w: torch.Tensor) -> float:
    t = time.perf_counter()
    torch.ops.tokenmill.tile_gemm(x, w)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
