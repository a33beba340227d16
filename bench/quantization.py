"""Weight and KV-cache quantisation: memory, speed, capacity and quality, one run.

    python bench/quantization.py [--repeats 2] [--budget 256MiB] [--context 1024]

Per configuration: weights in memory, KV bytes per token, single-stream decode tok/s
(64 tokens after a short prompt, best of the repeats, configurations interleaved),
throughput with 32 concurrent sequences (32 tokens each), how many sequences of
`--context` tokens fit a KV budget of `--budget`, and perplexity on held-out English
(the head of the Apache-2.0 licence text that the tests ship).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.evaluate import perplexity
from tokenmill.memory import parse_memory
from tokenmill.quant.weights import weight_bytes
from tokenmill.worker.kv_cache import kv_bytes_per_token

RESULTS = Path(__file__).parent / "results"
HELDOUT = Path(__file__).parent.parent / "tests" / "data" / "heldout.txt"
CONFIGS = {
    "float32": {},
    "w-int8": {"quantization": "int8"},
    "w-int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "w-int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "kv-bfloat16": {"kv_cache_dtype": "bfloat16"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "w-int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def decode_rate(llm: LLM) -> float:
    out = llm.generate("The history of the river mill", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[
        0
    ]
    t = out.timings[0]
    return (len(t.token_times) - 1) / (t.token_times[-1] - t.first_token)


def throughput(llm: LLM, batch: int = 32) -> float:
    prompts = [f"Question {i}: describe the river mill in one paragraph." for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", default="256MiB", help="KV budget for the capacity column")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence for the capacity column")
    args = ap.parse_args()
    budget = parse_memory(args.budget)
    llms = {}
    for name, kw in CONFIGS.items():
        log(f"loading {name} ...")
        llms[name] = LLM(dtype="float32", progress=False, kv_cache_memory="512MiB", **kw)
    ids = llms["float32"].tokenizer.encode(HELDOUT.read_text())[:1024]
    rows = {}
    for name, llm in llms.items():
        kv = kv_bytes_per_token(llm.config, llm.dtype, llm.kv_cache_dtype)
        blocks = budget // (kv * llm.engine.core.block_size)
        rows[name] = {
            "weights_MiB": round(weight_bytes(llm.model) / 2**20, 1),
            "kv_bytes_per_token": kv,
            "max_seqs_in_budget": blocks // -(-args.context // llm.engine.core.block_size),
            "perplexity": round(perplexity(llm, ids), 3),
            "decode_tok_s": 0.0,
            "throughput_32_tok_s": 0.0,
        }
        log(f"{name}: {rows[name]}")
    for rep in range(args.repeats):
        for name, llm in llms.items():
            rows[name]["decode_tok_s"] = max(rows[name]["decode_tok_s"], round(decode_rate(llm), 2))
            rows[name]["throughput_32_tok_s"] = max(rows[name]["throughput_32_tok_s"], round(throughput(llm), 1))
            log(
                f"repeat {rep + 1} {name}: decode {rows[name]['decode_tok_s']} tok/s, "
                f"32 concurrent {rows[name]['throughput_32_tok_s']} tok/s"
            )
    base = rows["float32"]
    for r in rows.values():
        r["decode_vs_float32"] = round(r["decode_tok_s"] / base["decode_tok_s"], 2)
        r["throughput_vs_float32"] = round(r["throughput_32_tok_s"] / base["throughput_32_tok_s"], 2)
        r["perplexity_vs_float32"] = round(r["perplexity"] / base["perplexity"] - 1, 4)
    result = {"budget": args.budget, "context": args.context, "heldout_tokens": len(ids), "configs": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quantization.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    plot(rows)


def plot(rows: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(rows)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (key, title) in zip(
        axes,
        [
            ("weights_MiB", "weights (MiB)"),
            ("decode_tok_s", "batch-1 decode tok/s"),
            ("max_seqs_in_budget", "sequences in KV budget"),
            ("perplexity", "perplexity (held-out)"),
        ],
        strict=True,
    ):
        ax.barh(names, [rows[n][key] for n in names], color="#29335c")
        ax.set_title(title)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(RESULTS / "quantization.png", dpi=110)
    log(f"wrote {RESULTS / 'quantization.png'}")


if __name__ == "__main__":
    main()
