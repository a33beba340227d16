"""At the sizes people run (issue 41): random-weight GGUFs of Llama-3.2-1B / 3B shapes,
tokenmill's float and int8 arithmetic against llama.cpp on the same files, same run.

    .venv/bin/python bench/gguf_sizes.py --llama-bin /work/peers/llama.cpp-avx2/bin \\
        [--shapes 1b,3b] [--types Q4_K_M,Q8_0] [--rounds 2] [--dir /tmp/gguf_sizes] [--threads 1,2]
        [--arithmetics int8]

Each shape is written once as F16 with the gguf library (SmolLM2's tokenizer, from the
bundled file; weights N(0, 0.02), norms 1), then quantised with llama.cpp's own
``llama-quantize`` (files cached in --dir, never committed). Per type and round,
alternating: tokenmill in a fresh process for each arithmetic (load time with the page
cache warm; decode tok/s of 64 greedy tokens after an 8-token prompt; prefill tok/s of a
256-token prompt after a warm-up one, the mean of two as ``llama-bench -r 2`` takes it; with --depth N, decode tok/s of
64 tokens after an N-token prompt and that prompt's prefill tok/s), then ``llama-bench -p 256 -n 64`` (and
``-p 0 -n 64 -d N``, ``-p N -n 0``) on the same cores. Results and the CPU
go to bench/results/gguf_sizes.json and a plot to gguf_sizes.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # Llama-3.2's (vocabulary: SmolLM2's 49152 tokens; tied embeddings as Llama-3.2's)
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "3b": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_f16(path: Path, shape: dict) -> None:
    import gguf
    import numpy as np

    from tokenmill.model.gguf_file import read_gguf
    from tokenmill.model.paths import default_model_path

    meta, _ = read_gguf(default_model_path())
    h, inter, n_layers = shape["hidden"], shape["intermediate"], shape["layers"]
    head_dim = h // shape["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(131072)  # Llama-3.2's (--depth 8192 runs past 4,096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writers = {
        "tokenizer.ggml.model": "add_tokenizer_model",
        "tokenizer.ggml.pre": "add_tokenizer_pre",
        "tokenizer.ggml.tokens": "add_token_list",
        "tokenizer.ggml.merges": "add_token_merges",
        "tokenizer.ggml.token_type": "add_token_types",
        "tokenizer.ggml.bos_token_id": "add_bos_token_id",
        "tokenizer.ggml.eos_token_id": "add_eos_token_id",
        "tokenizer.chat_template": "add_chat_template",
    }
    for key, fn in writers.items():
        if key in meta:
            getattr(w, fn)(meta[key])
    vocab = len(meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    kv = shape["kv_heads"] * head_dim
    w.add_tensor("token_embd.weight", rand(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(n_layers):
        for name, dims in (
            ("attn_q", (h, h)),
            ("attn_k", (kv, h)),
            ("attn_v", (kv, h)),
            ("attn_output", (h, h)),
            ("ffn_gate", (inter, h)),
            ("ffn_up", (inter, h)),
            ("ffn_down", (h, inter)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*dims))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def model_file(directory: Path, shape: str, qtype: str, llama_bin: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / f"llama-{shape}-f16.gguf"
    if not f16.exists():
        log(f"writing {f16}")
        write_f16(f16.with_suffix(".tmp"), SHAPES[shape])
        f16.with_suffix(".tmp").rename(f16)
    if qtype == "F16":
        return f16
    out = directory / f"llama-{shape}-{qtype.lower()}.gguf"
    if not out.exists():
        log(f"llama-quantize {qtype}")
        subprocess.run([str(llama_bin / "llama-quantize"), str(f16), str(out), qtype], check=True, capture_output=True)
    return out


def measure(path: str, arithmetic: str, threads: int, depth: int = 0) -> dict:
    """Run in a fresh process: load time, decode and prefill throughput (and decode after a
    ``depth``-token context, when given)."""
    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)

    t0 = time.perf_counter()
    llm = LLM(
        path,
        quant_arithmetic=arithmetic,
        progress=False,
        kv_cache_memory="256MiB" if depth <= 4096 else "1GiB",
        max_model_len=max(1024, depth + 128),
    )
    load_s = time.perf_counter() - t0
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate(["The quick brown fox jumps over the lazy"], decode)[0]
    decode_s = time.perf_counter() - t0
    first = out.timings[0].ttft or 0.0  # decode only: the prompt's step taken out
    prefills = []  # as llama-bench -r 2 times them: a warm-up prompt, then the mean of two (new tokens each)
    for start in (1000, 3000, 5000):
        t0 = time.perf_counter()
        llm.generate([list(range(start, start + 256))], SamplingParams(max_tokens=1, temperature=0))
        prefills.append(time.perf_counter() - t0)
    prefill_s = statistics.mean(prefills[1:])
    res = {"load_s": load_s, "decode_tok_s": 63 / max(1e-9, decode_s - first), "prefill_tok_s": 256 / prefill_s}
    if depth:
        t0 = time.perf_counter()
        out = llm.generate([list(range(2000, 2000 + depth))], decode)[0]
        ttft = out.timings[0].ttft or 0.0
        res["deep_decode_tok_s"] = 63 / max(1e-9, time.perf_counter() - t0 - ttft)
        res["deep_prefill_tok_s"] = depth / max(1e-9, ttft)  # the whole context as one prompt (-p depth)
    return res


def ours(path: Path, arithmetic: str, threads: int, depth: int = 0) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            __file__,
            "--measure",
            str(path),
            "--arithmetic",
            arithmetic,
            "--threads",
            str(threads),
            "--depth",
            str(depth),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_bench(llama_bin: Path, path: Path, threads: int, depth: int = 0) -> dict:
    def bench(*args: str) -> list[dict]:
        r = subprocess.run(
            [str(llama_bin / "llama-bench"), "-m", str(path), "-t", str(threads), *args, "-r", "2", "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(r.stdout)

    rows = bench("-p", "256", "-n", "64")
    pp = next(x for x in rows if x["n_prompt"] > 0)
    tg = next(x for x in rows if x["n_gen"] > 0)
    res = {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "build": rows[0].get("build_commit")}
    if depth:  # 64 tokens generated after a depth-token context (-d)
        res["deep_decode_tok_s"] = bench("-p", "0", "-n", "64", "-d", str(depth))[0]["avg_ts"]
        res["deep_prefill_tok_s"] = bench("-p", str(depth), "-n", "0")[0]["avg_ts"]
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['shape']} {r['type']}" + (f" t{r['threads']}" if len(res["threads"]) > 1 else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("decode_tok_s", "prefill_tok_s"), strict=True):
        for j, arith in enumerate(res["arithmetics"]):
            ax.bar(
                [i + (j - 0.5) * 0.4 for i in range(len(rows))],
                [r[f"{arith}_{key}_ratio"] for r in rows],
                0.4,
                label=f"tokenmill {arith}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=20)
        ax.set_title(f"{key.split('_')[0]}: tokenmill / llama.cpp")
        ax.legend()
    fig.suptitle(res["cpu"][:80], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure")
    ap.add_argument("--arithmetic", default="float")
    ap.add_argument("--llama-bin", type=Path, default=Path("/work/peers/llama.cpp-avx2/bin"))
    ap.add_argument("--shapes", default="1b")
    ap.add_argument("--types", default="Q4_K_M,Q8_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/gguf_sizes"))
    ap.add_argument("--name", default="gguf_sizes")
    ap.add_argument(
        "--files", default="", help="more GGUF files to measure as they are (e.g. 'bundled': the default model)"
    )
    ap.add_argument(
        "--threads",
        default=str(min(os.cpu_count() or 1, 2)),
        help="thread counts, each a row of its own (e.g. 1,2: both engines' scaling)",
    )
    ap.add_argument("--arithmetics", default="float,int8")
    ap.add_argument(
        "--depth", type=int, default=0, help="also decode after a context of this many tokens (llama-bench -d)"
    )
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.arithmetic, int(args.threads), args.depth)))
        return
    from tokenmill.kernels.cpu import cpu_info

    thread_counts = [int(t) for t in args.threads.split(",")]
    ariths = args.arithmetics.split(",")
    res = {"cpu": cpu_info().describe(), "threads": thread_counts, "arithmetics": ariths, "rows": []}
    from tokenmill.model.paths import resolve_model_path

    jobs = [(shape, qtype, None) for shape in args.shapes.split(",") if shape for qtype in args.types.split(",")]
    jobs += [
        ("file", Path(f).name if f != "bundled" else "bundled", resolve_model_path(None if f == "bundled" else f))
        for f in args.files.split(",")
        if f
    ]
    for (shape, qtype, given), threads in ((job, t) for job in jobs for t in thread_counts):
        path = given or model_file(args.dir, shape, qtype, args.llama_bin)
        runs: dict[str, list[dict]] = {**{a: [] for a in ariths}, "llama": []}
        for i in range(args.rounds):
            for arith in ariths:
                runs[arith].append(ours(path, arith, threads, args.depth))
            runs["llama"].append(llama_bench(args.llama_bin, path, threads, args.depth))
            log(
                f"{shape} {qtype} {threads} threads round {i + 1}: "
                + ", ".join(
                    f"{k} decode {v[-1]['decode_tok_s']:.1f} prefill {v[-1]['prefill_tok_s']:.1f}"
                    + (f" deep decode {v[-1]['deep_decode_tok_s']:.1f}" if "deep_decode_tok_s" in v[-1] else "")
                    + (f" load {v[-1]['load_s']:.1f}s" if "load_s" in v[-1] else "")
                    for k, v in runs.items()
                )
            )
        row = {"shape": shape, "type": qtype, "threads": threads, "file_bytes": path.stat().st_size, "runs": runs}
        deep = ["deep_decode_tok_s", "deep_prefill_tok_s"] if args.depth else []
        for key in ("decode_tok_s", "prefill_tok_s", *deep):
            theirs = statistics.median(r[key] for r in runs["llama"])
            row[f"llama_{key}"] = theirs
            for arith in ariths:
                row[f"{arith}_{key}"] = statistics.median(r[key] for r in runs[arith])
                row[f"{arith}_{key}_ratio"] = row[f"{arith}_{key}"] / theirs
        for arith in ariths:
            row[f"{arith}_load_s"] = statistics.median(r["load_s"] for r in runs[arith])
        res["rows"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "runs"}))
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    log(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
