"""The CPU hot path (issue 12): native kernels and bfloat16 against the pure-torch float32
path (the previous default), and against vLLM-CPU and llama.cpp, all in one run.

    python bench/hot_path.py [--vllm bench/peers/run_vllm.sh]
        [--llama-bench /work/peers/llama.cpp-build/bin/llama-bench --llama-gguf-dir /work/peers/gguf]
        [--skip-batched] [--skip-single]

Measures, with the CPU's capability recorded:
- single stream: 512-token prefill (tok/s, best of 3) and batch-1 decode (128 tokens), per
  configuration (dtype x kernels x weight quantisation), as a share of the bandwidth bound
  (weights read per token / measured copy bandwidth) and of the measured GEMM peak;
- a per-step time breakdown (attention, GEMMs, other ops, host) from torch.profiler, for a
  batch-1 decode step and a 32-sequence decode step at ~800 tokens of context;
- batched: the mixed workload (64 requests) and the shared-prefix workload (32 requests,
  caching on and off), from bench/throughput.py's generators;
- peers on the same workloads: vLLM-CPU (bfloat16 where native, prefix caching on/off) and
  llama-bench at F32/BF16/Q8_0 (`-p 512 -n 128`).
Writes bench/results/hot_path.json and bench/results/hot_path.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import mixed_workload, run_ours, run_vllm, shared_prefix_workload, write_jsonl

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info
from tokenmill.plan.command import measure_bandwidth
from tokenmill.quant.weights import weight_bytes

RESULTS = Path(__file__).parent / "results"
SINGLE = [  # (label, dtype, kernels, quantization)
    ("float32 torch (old default)", "float32", "torch", "none"),
    ("float32 native", "float32", "native", "none"),
    ("bfloat16 torch", "bfloat16", "torch", "none"),
    ("bfloat16 native", "bfloat16", "native", "none"),
    ("int8 native", "bfloat16", "native", "int8"),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make(dtype: str, kernels: str, quantization: str = "none", **kw) -> LLM:
    return LLM(dtype=dtype, kernels=kernels, quantization=quantization, progress=False, **kw)


def prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(Path(__file__).with_name("prompt.txt").read_text())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def gemm_peak(dtype: torch.dtype) -> float:
    """FLOP/s of a prefill-shaped matmul (512 x 576 @ 576 x 1536), best of 5."""
    a, b = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    torch.nn.functional.linear(a, b)
    best = min(_timed(lambda: torch.nn.functional.linear(a, b)) for _ in range(5))
    return 2 * 512 * 576 * 1536 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def single_stream(label, dtype, kernels, quant, bandwidth, peaks) -> dict:
    llm = make(dtype, kernels, quant, kv_cache_memory="256MiB", enable_prefix_caching=False)  # a real prefill each time
    ids = prompt(llm.tokenizer, 512)
    llm.generate([ids[:64]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    ttft = min(llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].timings[0].ttft for _ in range(3))
    out = llm.generate([ids[:16]], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0]
    t = out.timings[0]
    decode = (len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
    model = llm.parts.model
    read = weight_bytes(model) - (
        model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        if model.lm_head is not None and quant != "none"
        else 0
    )
    cfg = model.config  # decoder weights (any storage, int8 included) from the shapes, not the tensors
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = cfg.num_layers * cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)
    flops_per_token = 2 * params + 2 * cfg.vocab_size * cfg.hidden_size / 512  # the LM head: last token only
    res = {
        "label": label,
        "dtype": dtype,
        "kernels": kernels,
        "quantization": quant,
        "prefill_tok_s": 512 / ttft,
        "decode_tok_s": decode,
        "weight_bytes_per_token": read,
        "decode_bound_tok_s": bandwidth / read,
        "decode_share_of_bound": decode * read / bandwidth,
        "prefill_share_of_gemm_peak": 512 / ttft * flops_per_token / peaks[dtype],
        "decode_tokens": out.token_ids,
    }
    res["breakdown_batch1"] = breakdown(llm, [ids[:16]], 24)
    log(
        f"  {label}: prefill {res['prefill_tok_s']:.0f} tok/s, decode {decode:.1f} tok/s "
        f"({100 * res['decode_share_of_bound']:.0f}% of the bandwidth bound)"
    )
    del llm
    gc.collect()
    return res


def breakdown(llm: LLM, prompts: list[list[int]], warm_tokens: int) -> dict:
    """Mean decode step, split by torch.profiler into attention, GEMMs, other ops and host
    (wall time not covered by any op's own time)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"bd{i}", p, SamplingParams(temperature=0, max_tokens=warm_tokens + 8, ignore_eos=True))
    for _ in range(warm_tokens):  # prefill and settle into decoding
        engine.step()
    steps = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) / steps
    while engine.has_unfinished():
        engine.step()
    cats = {"attention": 0.0, "gemm": 0.0, "other_ops": 0.0}
    for e in prof.key_averages():
        name, us = e.key, e.self_cpu_time_total / steps / 1e6
        if any(
            s in name
            for s in ("paged_attention", "scaled_dot_product", "_flash_attention", "index_select", "masked_fill")
        ):
            cats["attention"] += us
        elif any(s in name for s in ("addmm", "aten::mm", "linear", "matmul", "int8pack", "int4pack", "mkldnn", "bmm")):
            cats["gemm"] += us
        elif name.startswith(("aten::", "tokenmill::")):
            cats["other_ops"] += us
    covered = sum(cats.values())
    cats = {k: v * 1e3 for k, v in cats.items()} | {"host": max(0.0, wall - covered) * 1e3, "wall": wall * 1e3}
    return {k: round(v, 3) for k, v in cats.items()}  # milliseconds per step


def batched(label, dtype, kernels, mixed, prefix, max_num_seqs) -> dict:
    res = {"label": label}
    for name, reqs, kw in (
        ("mixed", mixed, {}),
        ("prefix_on", prefix, {}),
        ("prefix_off", prefix, {"enable_prefix_caching": False}),
    ):
        llm = make(dtype, kernels, kv_cache_memory="2GiB", max_num_seqs=max_num_seqs, **kw)
        llm.generate([mixed[0][0][:32]], SamplingParams(max_tokens=4))
        r = run_ours(llm, reqs)
        r["outputs_hash"] = hash(str(r.pop("outputs")))
        res[name] = r
        log(f"  {label} {name}: {r['output_tokens_per_s']:.1f} tok/s in {r['elapsed_s']:.1f} s")
        if name == "prefix_on":
            ids = [p for p, _ in prefix[:32]]
            res["breakdown_32_decodes"] = breakdown(llm, [p[:800] for p in ids], 4)
        del llm
        gc.collect()
    return res


def llama_bench(binary: str, gguf_dir: str) -> list[dict]:
    rows = []
    for kind in ("f32", "bf16", "q8_0"):
        path = Path(gguf_dir) / f"smollm2-{kind}.gguf"
        if not path.exists():
            continue
        log(f"  llama-bench {kind}")
        cmd = [binary, "-m", str(path), "-p", "512", "-n", "128", "-t", str(cpu_info().cores), "-r", "3", "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        try:
            for row in json.loads(r.stdout):
                rows.append({"type": kind, "n_prompt": row["n_prompt"], "n_gen": row["n_gen"], "tok_s": row["avg_ts"]})
        except (json.JSONDecodeError, KeyError):
            log(f"  llama-bench failed: {r.stderr[-1000:]}")
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    single = res.get("single", [])
    if single:
        ax = axes[0]
        labels = [s["label"].replace(" (old default)", "\n(old default)") for s in single]
        x = range(len(single))
        ax.bar(
            [i - 0.2 for i in x],
            [100 * s["decode_share_of_bound"] for s in single],
            0.4,
            label="decode: % of bandwidth bound",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [100 * s["prefill_share_of_gemm_peak"] for s in single],
            0.4,
            label="prefill: % of GEMM peak",
        )
        for i, s in enumerate(single):
            ax.text(i - 0.2, 100 * s["decode_share_of_bound"] + 1, f"{s['decode_tok_s']:.0f}", ha="center", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=7, rotation=20)
        ax.set_ylabel("% of roofline")
        ax.set_title("Roofline (numbers: decode tok/s)")
        ax.legend(fontsize=7)
        ax = axes[1]
        parts = ["attention", "gemm", "other_ops", "host"]
        bottom = [0.0] * len(single)
        for part in parts:
            vals = [s["breakdown_batch1"][part] for s in single]
            ax.bar(list(x), vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(list(x), labels, fontsize=7, rotation=20)
        ax.set_ylabel("ms per batch-1 decode step")
        ax.set_title("Where a batch-1 decode step goes")
        ax.legend(fontsize=7)
    ax = axes[2]
    bars = []
    for b in res.get("batched", []):
        short = b["label"].replace(" (old default)", "\n(old)").replace(" (new default)", "\n(new)")
        bars += [
            (f"{short}\nmixed", b["mixed"]["output_tokens_per_s"]),
            (f"{short}\nprefix on", b["prefix_on"]["output_tokens_per_s"]),
        ]
    for key, name in (("vllm_mixed", "vLLM\nmixed"), ("vllm_prefix_on", "vLLM\nprefix on")):
        if res.get(key):
            bars.append((name, res[key]["output_tokens_per_s"]))
    if bars:
        ax.bar(range(len(bars)), [v for _, v in bars], color=["C0", "C0", "C1", "C1", "C2", "C2"][: len(bars)])
        ax.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=7)
        ax.set_ylabel("output tok/s")
        ax.set_title("Batched throughput (offline)")
    fig.suptitle(f"CPU: {cpu_info().describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", default=None)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--llama-gguf-dir", default="/work/peers/gguf")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-batched", action="store_true")
    ap.add_argument("--keep-from", default=None, help="a previous hot_path.json whose sections this run skips")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    info = cpu_info()
    log(f"CPU: {info.describe()}")
    best = "bfloat16" if info.native_bf16 else "float32"
    res: dict = {"cpu": info.as_dict(), "args": vars(args), "torch_threads": torch.get_num_threads()}
    bandwidth = measure_bandwidth(512)
    peaks = {"float32": gemm_peak(torch.float32), "bfloat16": gemm_peak(torch.bfloat16)}
    res["bandwidth_bytes_s"], res["gemm_peak_flops"] = bandwidth, peaks
    log(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; GEMM peak f32 {peaks['float32'] / 1e9:.0f}, bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s"
    )

    if not args.skip_single:
        log("single stream")
        res["single"] = [single_stream(*cfg, bandwidth, peaks) for cfg in SINGLE]
        ref = {s["label"]: s["decode_tokens"] for s in res["single"]}
        res["greedy_identical_float32_native_vs_torch"] = ref["float32 native"] == ref["float32 torch (old default)"]
        for s in res["single"]:
            s.pop("decode_tokens")
    if args.llama_bench and not args.skip_single:
        res["llama_bench"] = llama_bench(args.llama_bench, args.llama_gguf_dir)

    if not args.skip_batched:
        tok = make("float32", "torch", kv_cache_memory="64MiB").tokenizer
        mixed, prefix = mixed_workload(tok, 64), shared_prefix_workload(tok)
        write_jsonl(mixed, RESULTS / "workload_mixed.jsonl")
        write_jsonl(prefix, RESULTS / "workload_shared_prefix.jsonl")
        log("batched")
        res["batched"] = [
            batched("float32 torch (old default)", "float32", "torch", mixed, prefix, args.max_num_seqs),
            batched(f"{best} native (new default)", best, "native", mixed, prefix, args.max_num_seqs),
        ]
        if args.vllm:
            flags = ["--dtype", best, "--max-num-seqs", str(args.max_num_seqs)]
            res["vllm_mixed"] = run_vllm(args.vllm, RESULTS / "workload_mixed.jsonl", *flags)
            res["vllm_prefix_on"] = run_vllm(args.vllm, RESULTS / "workload_shared_prefix.jsonl", *flags)
            res["vllm_prefix_off"] = run_vllm(
                args.vllm, RESULTS / "workload_shared_prefix.jsonl", "--no-prefix-caching", *flags
            )
    if args.keep_from:  # sections skipped here come from an earlier run (noted in the file)
        old = json.loads(Path(args.keep_from).read_text())
        kept = [
            k
            for k in (
                "single",
                "llama_bench",
                "batched",
                "vllm_mixed",
                "vllm_prefix_on",
                "vllm_prefix_off",
                "greedy_identical_float32_native_vs_torch",
            )
            if k in old and k not in res
        ]
        res.update({k: old[k] for k in kept})
        res["sections_from_earlier_run"] = kept
    (RESULTS / "hot_path.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "hot_path.png")
    log(f"wrote {RESULTS / 'hot_path.json'} and hot_path.png")


if __name__ == "__main__":
    main()
