"""Paged attention alone on the 135M model's shapes (9 query heads, 3 KV heads, 64 wide, 16-token
blocks scattered over one layer's share of a 2 GiB bfloat16 cache): decodes, and a prompt chunk
over a cached context beside decodes, ms a call. Pass a checkout to time its kernels, e.g. one
made with ``git worktree add /tmp/before HEAD~1``; run it from each, alternating:

    .venv/bin/python bench/paged_attention.py [CHECKOUT]

The cases fit in this EPYC's L3 after the first call, so they time the arithmetic; in serving,
a decode step reads each layer's KV once from DRAM (bench/RESULTS.md, issue 58).
"""

import os
import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
from tokenmill.kernels.cpu import cpu_info  # noqa: E402
from tokenmill.kernels.native import load_native  # noqa: E402

BS, HEADS, KV_HEADS, D = 16, 9, 3, 64
CASES = {
    "15 decodes x 800 tokens": (15, 800, 0, 0),
    "35 decodes x 400 tokens": (35, 400, 0, 0),
    "a 480-token chunk over 700 cached + 30 decodes x 400": (30, 400, 480, 700),
}


def main() -> None:
    assert load_native(), "the native kernels did not build"
    torch.manual_seed(0)
    nblocks = 2**31 // 30 // 2 // (BS * KV_HEADS * D * 2)
    kc = torch.randn(nblocks, BS, KV_HEADS, D).bfloat16()
    vc = torch.randn(nblocks, BS, KV_HEADS, D).bfloat16()
    perm = torch.randperm(nblocks)
    print(f"CPU: {cpu_info().describe()}")
    for name, (decodes, ctx, chunk, chunk_ctx) in CASES.items():
        lens, news = [ctx] * decodes, [1] * decodes
        if chunk:
            lens.append(chunk_ctx + chunk)
            news.append(chunk)
        width = max(-(-n // BS) for n in lens)
        tables, used = torch.zeros(len(lens), width, dtype=torch.int64), 0
        for i, n in enumerate(lens):
            tables[i, : -(-n // BS)] = perm[used : used + -(-n // BS)]
            used += -(-n // BS)
        qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int64)
        q = torch.randn(int(qsl[-1]), HEADS, D).bfloat16()
        out = torch.empty_like(q)
        args = (
            out,
            q,
            kc,
            vc,
            None,
            None,
            tables,
            qsl,
            torch.tensor(lens),
            torch.arange(len(lens)),
            D**-0.5,
            256,
            0,
            0.0,
        )
        for _ in range(3):
            torch.ops.tokenmill.paged_attention(*args)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            torch.ops.tokenmill.paged_attention(*args)
            times.append(time.perf_counter() - start)
        print(f"{name}: {sorted(times)[len(times) // 2] * 1e3:.2f} ms (median of 15)")


if __name__ == "__main__":
    main()
