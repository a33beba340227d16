"""One quantised linear layer, by batch rows: what ``quant_linear`` picks for each row count
(GEMV tiles, the blocked kernel that unpacks weight rows into L1, or dequantise + GEMM) against
the path batches past 32 rows took before the blocked kernel (the whole weight dequantised for
the call into PyTorch's GEMM), same run, same weight: SmolLM2's 3072x576 gate_up in Q4_1.

    .venv/bin/python bench/quant_linear.py                        # this machine's build
    TOKENMILL_MARCH=haswell .venv/bin/python bench/quant_linear.py  # the AVX2 build

Prints one JSON line per dtype and row count (best of 5 x 10 calls, ms per call).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import random_gguf_blocks
from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import build_name, load_native
from tokenmill.quant.packed import PackedWeight

ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512)


def best_ms(fn, calls: int = 10, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    assert load_native(), "the native kernels did not build"
    n, k = 3072, 576
    w = PackedWeight.from_gguf("Q4_1", random_gguf_blocks("Q4_1", n, k, 0), (n, k))
    bf16_units = cpu_info().native_bf16
    for dtype in (torch.float32, torch.bfloat16):
        bf16 = dtype == torch.bfloat16 and bf16_units
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            ours = best_ms(
                lambda x=x, bf16=bf16: torch.ops.tokenmill.quant_linear(x, w.qs, w.scale, w.minv, 4, 32, bf16)
            )

            def before(x=x, bf16=bf16, dtype=dtype) -> torch.Tensor:  # the whole weight dequantised, then the GEMM
                wd = w.dequantize_rows(bf16=bf16)
                return nn.functional.linear(x if bf16 else x.float(), wd).to(dtype)

            base = best_ms(before)
            print(
                json.dumps(
                    {
                        "build": build_name(),
                        "dtype": str(dtype).removeprefix("torch."),
                        "rows": rows,
                        "quant_linear_ms": round(ours, 4),
                        "dequantise_gemm_ms": round(base, 4),
                        "speedup": round(base / ours, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
