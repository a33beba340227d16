"""Paged attention alone on the 135M model's shapes (9 query heads, 3 KV heads, 64 wide, 16-token
blocks scattered over one layer's share of a 2 GiB bfloat16 cache): decodes, and a prompt chunk
over a cached context beside decodes, fresh prompts as a batch-invariant step takes them (the
int8 arithmetic's: every query in the paged kernel, partitions of one size), ms a call. Pass a
checkout to time its kernels, e.g. one made with ``git worktree add /tmp/before HEAD~1``; run it
from each, alternating:

    .venv/bin/python bench/paged_attention.py [CHECKOUT] [--dtype bfloat16|float32]

``--dtype float32`` is what a GGUF file's steps hold on a CPU without bfloat16 units (queries and
cache in float32, read in place).

In bfloat16 the cases fit in a 32 MB L3 after the first call, so they time the arithmetic; in
float32, or with a smaller L3, the decodes read their KV from DRAM as a serving step reads each
layer's (bench/RESULTS.md, issue 58).
"""

import argparse
import os
import sys
import time

import torch

AP = argparse.ArgumentParser(description=__doc__.split("\n")[0])
AP.add_argument("checkout", nargs="?", default=os.path.join(os.path.dirname(__file__), ".."))
AP.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="queries and cache")
ARGS = AP.parse_args()
sys.path.insert(0, ARGS.checkout)
from tokenmill.kernels.cpu import cpu_info  # noqa: E402
from tokenmill.kernels.native import load_native  # noqa: E402

BS, HEADS, KV_HEADS, D = 16, 9, 3, 64
CASES = {
    "15 decodes x 800 tokens": (15, 800, 0, 0),
    "35 decodes x 400 tokens": (35, 400, 0, 0),
    "a 480-token chunk over 700 cached + 30 decodes x 400": (30, 400, 480, 700),
    "16 fresh prompts x 256 tokens, batch-invariant": (0, 0, 256, 0, 16),
}


def main() -> None:
    assert load_native(), "the native kernels did not build"
    torch.manual_seed(0)
    nblocks = 2**31 // 30 // 2 // (BS * KV_HEADS * D * 2)
    dtype = getattr(torch, ARGS.dtype)
    kc = torch.randn(nblocks, BS, KV_HEADS, D).to(dtype)
    vc = torch.randn(nblocks, BS, KV_HEADS, D).to(dtype)
    perm = torch.randperm(nblocks)
    print(f"CPU: {cpu_info().describe()}; queries and cache in {ARGS.dtype}")
    for name, (decodes, ctx, chunk, chunk_ctx, *chunks) in CASES.items():
        lens, news = [ctx] * decodes, [1] * decodes
        for _ in range(chunks[0] if chunks else 1 if chunk else 0):
            lens.append(chunk_ctx + chunk)
            news.append(chunk)
        width = max(-(-n // BS) for n in lens)
        tables, used = torch.zeros(len(lens), width, dtype=torch.int64), 0
        for i, n in enumerate(lens):
            tables[i, : -(-n // BS)] = perm[used : used + -(-n // BS)]
            used += -(-n // BS)
        qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int64)
        q = torch.randn(int(qsl[-1]), HEADS, D).to(dtype)
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
            -256 if chunks else 256,  # a negative size: every partition exactly that (batch-invariant)
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
