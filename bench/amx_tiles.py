"""GGUF block batches on AMX tiles (csrc/ggml_amx.cpp) against the zmm pair kernel, in one
process: the same weights and activations, ``TOKENMILL_AMX`` switched per call, the order
alternating, best of ``--repeats`` x 10 calls each. Also the dequantised bfloat16 GEMM
(oneDNN, which uses AMX for bfloat16 on such a CPU) for the batch sizes where
``gemm_choice.block_gemm_rows`` weighs it. Needs a CPU with AMX (Sapphire Rapids or later).

    .venv/bin/python bench/amx_tiles.py [--types Q4_1,Q8_0,Q4_K] [--rows 16,32,64,256,512]

Writes bench/results/amx_tiles.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import random_gguf_blocks
from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import load_native
from tokenmill.quant.blocks import BLOCK_TYPES, BlockWeight

SHAPES = {
    "135M MLP up (1536x576)": (1536, 576),
    "1B attention (2048x2048)": (2048, 2048),
    "1B MLP (8192x2048)": (8192, 2048),
}


def best_ms(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            call()
        best = min(best, (time.perf_counter() - start) / 10)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K")
    ap.add_argument("--rows", default="16,32,64,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "amx_tiles.json")
    args = ap.parse_args()
    assert load_native(), "the native kernels did not build"
    info = cpu_info().describe()
    print(info)
    assert torch.ops.tokenmill.block_has_tiles(BLOCK_TYPES["Q4_1"]), "no AMX tiles here (CPU, build or OS)"
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for t in args.types.split(","):
        for label, (n, k) in SHAPES.items():
            if t.endswith("_K") and k % 256:
                continue  # (super-blocks of 256)
            (w,) = BlockWeight.for_native([BlockWeight.from_gguf(t, random_gguf_blocks(t, n, k), (n, k))])
            for rows in rows_list:
                x = torch.randn(rows, k).bfloat16()
                ms = {"tiles": [], "zmm": []}
                for rnd in range(2):
                    for mode in ("tiles", "zmm") if rnd == 0 else ("zmm", "tiles"):
                        os.environ["TOKENMILL_AMX"] = "1" if mode == "tiles" else "0"
                        ms[mode].append(
                            best_ms(
                                lambda x=x, w=w: torch.ops.tokenmill.block_linear(x, w.qs, w.type_code, 0), args.repeats
                            )
                        )
                os.environ["TOKENMILL_AMX"] = "1"
                gemm = best_ms(lambda x=x, w=w: torch.ops.tokenmill.block_linear(x, w.qs, w.type_code, 1), args.repeats)
                row = {
                    "type": t,
                    "shape": label,
                    "rows": rows,
                    "tiles_ms": min(ms["tiles"]),
                    "zmm_ms": min(ms["zmm"]),
                    "bf16_gemm_ms": gemm,
                }
                row["tiles_gops"] = 2 * rows * n * k / row["tiles_ms"] / 1e6
                row["speedup"] = row["zmm_ms"] / row["tiles_ms"]
                results.append(row)
                print(
                    f"{t:5} {label:26} {rows:4} rows: tiles {row['tiles_ms']:8.3f} ms ({row['tiles_gops']:5.0f} GOP/s)"
                    f"  zmm {row['zmm_ms']:8.3f}  x{row['speedup']:.2f}  bf16 GEMM (dequantised) {gemm:8.3f}",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"cpu": info, "torch_threads": torch.get_num_threads(), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
