"""Single-stream prefill and decode speed: tokenmill vs transformers `generate`, same run.

    python bench/single_stream.py [--decode-tokens 128] [--repeats 3] [--dtypes float32,bfloat16]

Prefill: a 512-token prompt, one output token (time to first token, best of 3). Decode: tokens/s
after the first token at batch 1. Beside both, the bandwidth ceiling: this machine's
measured memory bandwidth divided by the bytes of weights each decode step reads.
Writes bench/results/single_stream.json and bench/results/single_stream.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.plan.command import measure_bandwidth

OUT = Path(__file__).parent / "results"
PROMPT_TOKENS = 512


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memory_bandwidth_gbs() -> float:
    """Read+write bandwidth of a large tensor copy, as `tokenmill plan` measures it."""
    return measure_bandwidth(512) / 1e9


def prompt_ids(tokenizer) -> list[int]:
    text = Path(__file__).with_name("prompt.txt").read_text()
    ids = tokenizer.encode(text)
    while len(ids) < PROMPT_TOKENS:
        ids = ids + ids
    return ids[:PROMPT_TOKENS]


def bench_tokenmill(llm: LLM, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    ttft = min(llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].timings[0].ttft for _ in range(3))
    prefill = len(ids) / ttft
    short = ids[:16]
    out = llm.generate([short], SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))[0]
    t = out.timings[0]
    decode = (len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
    return prefill, decode


@torch.inference_mode()
def bench_transformers(model, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    from transformers import GenerationConfig

    def gen(inp: list[int], n: int) -> float:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        t = time.perf_counter()
        model.generate(torch.tensor([inp]), generation_config=cfg)
        return time.perf_counter() - t

    prefill = len(ids) / min(gen(ids, 1) for _ in range(3))
    short = ids[:16]
    t1 = gen(short, 1)
    tn = gen(short, decode_tokens)
    return prefill, (decode_tokens - 1) / (tn - t1)


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes read per decode step: every weight once (the tied embedding as LM head)."""
    return sum(p.numel() * p.element_size() for p in llm.model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    OUT.mkdir(exist_ok=True)
    bandwidth = memory_bandwidth_gbs()
    log(f"memory bandwidth (copy): {bandwidth:.1f} GB/s; torch threads: {torch.get_num_threads()}")
    results = {"bandwidth_gbs": bandwidth, "threads": torch.get_num_threads(), "torch": torch.__version__, "runs": {}}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        log(f"[{dtype_name}] loading tokenmill and transformers")
        llm = LLM(dtype=dtype_name, kv_cache_memory="256MiB")
        path = llm.model_path
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
        ids = prompt_ids(llm.tokenizer)
        bench_tokenmill(llm, ids[:64], 8)  # warm-up
        bench_transformers(hf, ids[:64], 8)
        ours, theirs = [], []
        for r in range(args.repeats):  # interleaved, so that machine noise hits both
            ours.append(bench_tokenmill(llm, ids, args.decode_tokens))
            theirs.append(bench_transformers(hf, ids, args.decode_tokens))
            log(
                f"[{dtype_name}] repeat {r + 1}/{args.repeats}: tokenmill prefill {ours[-1][0]:.0f} tok/s, "
                f"decode {ours[-1][1]:.1f} tok/s | transformers prefill {theirs[-1][0]:.0f}, decode {theirs[-1][1]:.1f}"
            )
        wbytes = weight_bytes_per_token(llm)
        row = {
            "tokenmill_prefill_tps": statistics.median(o[0] for o in ours),
            "tokenmill_decode_tps": statistics.median(o[1] for o in ours),
            "transformers_prefill_tps": statistics.median(t[0] for t in theirs),
            "transformers_decode_tps": statistics.median(t[1] for t in theirs),
            "weight_bytes": wbytes,
            "decode_ceiling_tps": bandwidth * 1e9 / wbytes,
        }
        row["prefill_ratio"] = row["tokenmill_prefill_tps"] / row["transformers_prefill_tps"]
        row["decode_ratio"] = row["tokenmill_decode_tps"] / row["transformers_decode_tps"]
        results["runs"][dtype_name] = row
        del llm, hf
    (OUT / "single_stream.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    plot(results, OUT / "single_stream.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(results["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ["prefill", "decode"], strict=True):
        xs = range(len(dtypes))
        ours = [results["runs"][d][f"tokenmill_{kind}_tps"] for d in dtypes]
        theirs = [results["runs"][d][f"transformers_{kind}_tps"] for d in dtypes]
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="tokenmill")
        ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="transformers generate")
        if kind == "decode":
            ceil = [results["runs"][d]["decode_ceiling_tps"] for d in dtypes]
            ax.scatter(list(xs), ceil, marker="_", s=2000, color="k", label="bandwidth ceiling")
        ax.set_xticks(list(xs), dtypes)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{kind} ({'512-token prompt' if kind == 'prefill' else 'batch 1'})")
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), single stream, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
