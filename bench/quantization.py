"""Weight and KV-cache quantisation: size, memory, speed, capacity and quality, one run.

    python bench/quantization.py [--repeats 2] [--only REGEX] [--models-dir /work/peers]
                                 [--budget 256MiB] [--context 1024] [--merge]

Rows (each loaded with tokenmill, float32 activations):

- ``float32``: the bundled SmolLM2-135M-Instruct Q4_1 GGUF dequantised at load
  (``quantization="none"``): the reference every other row is compared with;
- ``rtn-*``: tokenmill's load-time round-to-nearest int8 (per channel) and int4 (per group;
  a layer whose width the group does not divide is int8: SmolLM2's 576-wide inputs at g128);
- ``gguf-*``: GGUF files served natively (the quantised blocks kept, llama.cpp's integer
  arithmetic), ``MODELS_DIR/gguf/smollm2-<TYPE>.gguf``; ``gguf-Q4_1`` is the bundled file;
- ``llmc-*``: compressed-tensors folders made by llm-compressor,
  ``MODELS_DIR/quantized/smollm2-<scheme>/``;
- ``tm-*``: folders made by ``tokenmill quantize``, ``MODELS_DIR/quantized/tm-*/``;
- ``kv-*``: float32 weights with a quantised KV cache.

A row whose checkpoint does not load records the loader's error instead of numbers.

Columns: checkpoint size on disk (the file or folder loaded; for ``rtn-*`` and ``kv-*``
the source file, the quantisation happens at load), weights in memory, KV bytes per
token, perplexity on held-out English (tests/data/heldout.txt, the head of the Apache-2.0
licence), **top-1 agreement** with float32 (teacher-forced: at each of the held-out
text's positions, does the row's most likely next token equal float32's), **KL vs
float32** (the mean KL divergence of the row's next-token distribution from float32's over
the same positions: the fidelity measure with the least noise, as llama.cpp's KLD), **greedy
prefix** (free-running: 3 prompts x 64 greedy tokens, the mean fraction of tokens before
the first divergence from float32's continuation), single-stream decode tok/s (64 tokens
after a short prompt), prefill tok/s (a 512-token prompt, prefix caching off), throughput
with 32 concurrent sequences, and how many ``--context``-token sequences fit ``--budget``
of KV cache. Speeds: best of ``--repeats``, configurations interleaved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.configuration.memory import parse_memory
from tokenmill.evaluate.perplexity import chunk_logprobs
from tokenmill.quant.weights import weight_bytes
from tokenmill.worker.kv_allocation import kv_bytes_per_token

RESULTS = Path(__file__).parent / "results"
HELDOUT = Path(__file__).parent.parent / "tests" / "data" / "heldout.txt"
GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q8_0")
GREEDY_PROMPTS = (
    "The history of the river mill",
    "def quicksort(items):",
    "Write three sentences about the moon.",
)
PREFILL_TOKENS = 512


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rows_to_run(models_dir: Path) -> dict[str, dict]:
    """Row name -> LLM keywords (``model`` None: the bundled Q4_1 GGUF)."""
    none = {"quantization": "none"}
    rows: dict[str, dict] = {
        "float32": none,
        "rtn-int8": {"quantization": "int8"},
        "rtn-int4-g32": {"quantization": "int4", "quantization_group_size": 32},
        "rtn-int4-g64": {"quantization": "int4", "quantization_group_size": 64},
        "rtn-int4-g128": {"quantization": "int4", "quantization_group_size": 128},
    }
    for t in GGUF_TYPES:
        path = None if t == "Q4_1" else models_dir / "gguf" / f"smollm2-{t}.gguf"
        rows[f"gguf-{t}"] = {"model": path}
    for folder in sorted((models_dir / "quantized").glob("smollm2-*/config.json")):
        rows["llmc-" + folder.parent.name.removeprefix("smollm2-")] = {"model": folder.parent}
    for folder in sorted((models_dir / "quantized").glob("tm-*")):
        rows[folder.name] = {"model": folder}
    rows["kv-int8"] = {**none, "kv_cache_dtype": "int8"}
    rows["kv-fp8"] = {**none, "kv_cache_dtype": "fp8"}
    return rows


def disk_mib(path: Path) -> float:
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("*.bin")]
    return round(sum(f.stat().st_size for f in files) / 2**20, 1)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown"


def score_against(
    llm: LLM, ids: list[int], ref: list[torch.Tensor] | None
) -> tuple[float, list[int], float, list[torch.Tensor]]:
    """Perplexity of ``ids``, the top-1 token at each position, and the mean KL divergence
    KL(ref || this model) per position against the reference's log-probabilities (``ref``:
    float32's chunks; None: this is the reference, its chunks are returned to keep)."""
    nll, count, kl, top1, kept = 0.0, 0, 0.0, [], []
    for i, (targets, lp) in enumerate(chunk_logprobs(llm, ids)):
        top1 += lp.argmax(dim=-1).tolist()
        nll -= lp.gather(1, targets[:, None]).sum().item()
        count += len(targets)
        if ref is None:
            kept.append(lp)
        else:
            kl += float((ref[i].exp() * (ref[i] - lp)).sum())
    return math.exp(nll / count), top1, kl / count, kept


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(list(GREEDY_PROMPTS), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def prefix_fraction(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(b), 1)


def decode_rate(llm: LLM) -> float:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t = llm.generate("The history of the river mill", params)[0].timings[0]
    return (len(t.token_times) - 1) / (t.token_times[-1] - t.first_token)


def prefill_rate(llm: LLM, prompt: list[int]) -> float:
    t = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].timings[0]
    return len(prompt) / t.ttft


def throughput(llm: LLM, batch: int = 32) -> float:
    prompts = [f"Question {i}: describe the river mill in one paragraph." for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", help="regular expression: run the rows whose names match (float32 always runs)")
    ap.add_argument("--models-dir", type=Path, default=Path("/work/peers"), help="where gguf/ and quantized/ are")
    ap.add_argument("--budget", default="256MiB", help="KV budget for the capacity column")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence for the capacity column")
    ap.add_argument("--no-throughput", action="store_true", help="skip the 32-concurrent-sequences column")
    ap.add_argument("--merge", action="store_true", help="update the rows run in the existing results file")
    ap.add_argument("--out", type=Path, default=RESULTS / "quantization.json")
    args = ap.parse_args()
    budget = parse_memory(args.budget)
    wanted = {
        name: kw
        for name, kw in rows_to_run(args.models_dir).items()
        if name == "float32" or args.only is None or re.search(args.only, name)
    }
    common = {"dtype": "float32", "progress": False, "kv_cache_memory": "128MiB", "enable_prefix_caching": False}
    llms: dict[str, LLM] = {}
    rows: dict[str, dict] = {}
    ref_top1: list[int] = []
    ref_greedy: list[list[int]] = []
    ref_logprobs: list[torch.Tensor] | None = None
    heldout: list[int] = []
    prefill_prompt: list[int] = []
    for name, kw in wanted.items():
        kw = dict(kw)
        path = kw.pop("model", None)
        if path is not None and not Path(path).exists():
            log(f"{name}: skipped, {path} does not exist")
            continue
        log(f"loading {name} ...")
        t0 = time.perf_counter()
        try:
            llm = LLM(model=None if path is None else str(path), **common, **kw)
        except Exception as e:  # noqa: BLE001 - a row that does not load records why
            rows[name] = {"checkpoint": str(path), "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            log(f"{name}: {rows[name]['error']}")
            continue
        load_s = time.perf_counter() - t0
        if not heldout:
            heldout = llm.tokenizer.encode(HELDOUT.read_text())[:1024]
            prefill_prompt = heldout[:PREFILL_TOKENS]
        ppl, top1, kl, logprobs = score_against(llm, heldout, ref_logprobs)
        outs = greedy(llm)
        if name == "float32":
            ref_top1, ref_greedy, ref_logprobs = top1, outs, logprobs
        kv = kv_bytes_per_token(llm.config, llm.dtype, llm.kv_cache_dtype)
        blocks = budget // (kv * llm.engine.core.block_size)
        rows[name] = {
            "checkpoint": str(llm.model_path),
            "disk_MiB": disk_mib(Path(llm.model_path)),
            "weights_MiB": round(weight_bytes(llm.model) / 2**20, 1),
            "load_s": round(load_s, 1),
            "kv_bytes_per_token": kv,
            "max_seqs_in_budget": blocks // -(-args.context // llm.engine.core.block_size),
            "perplexity": round(ppl, 3),
            "top1_agreement": round(sum(a == b for a, b in zip(top1, ref_top1, strict=True)) / len(top1), 4),
            "kl_vs_float32": round(kl, 4),
            "greedy_prefix": round(sum(map(prefix_fraction, outs, ref_greedy)) / len(outs), 3),
            "decode_tok_s": 0.0,
            "prefill_tok_s": 0.0,
            "throughput_32_tok_s": 0.0,
        }
        llms[name] = llm
        log(f"{name}: {rows[name]}")
    for rep in range(args.repeats):
        for name, llm in llms.items():
            r = rows[name]
            r["decode_tok_s"] = max(r["decode_tok_s"], round(decode_rate(llm), 2))
            r["prefill_tok_s"] = max(r["prefill_tok_s"], round(prefill_rate(llm, prefill_prompt), 1))
            if not args.no_throughput:
                r["throughput_32_tok_s"] = max(r["throughput_32_tok_s"], round(throughput(llm), 1))
            log(f"repeat {rep + 1} {name}: decode {r['decode_tok_s']}, prefill {r['prefill_tok_s']} tok/s")
    base = rows["float32"]
    for r in rows.values():
        if "error" not in r:
            r["perplexity_vs_float32"] = round(r["perplexity"] / base["perplexity"] - 1, 4)
            r["decode_vs_float32"] = (
                round(r["decode_tok_s"] / base["decode_tok_s"], 2) if base["decode_tok_s"] else None
            )
    if args.merge and args.out.exists():
        rows = {**json.loads(args.out.read_text())["configs"], **rows}
    result = {
        "cpu": cpu_name(),
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(["python", *sys.argv]),
        "budget": args.budget,
        "context": args.context,
        "heldout_tokens": len(heldout),
        "prefill_tokens": len(prefill_prompt),
        "greedy": f"{len(GREEDY_PROMPTS)} prompts x 64 tokens, first divergence from float32",
        "top1_agreement": "teacher-forced over the held-out text, vs float32",
        "configs": rows,
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    log(f"wrote {args.out}")
    print(markdown(result))
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n, r in rows.items() if "error" not in r]
    fig, axes = plt.subplots(1, 5, figsize=(21, 0.35 * len(names) + 1.5))
    for ax, (key, title) in zip(
        axes,
        [
            ("weights_MiB", "weights (MiB)"),
            ("decode_tok_s", "batch-1 decode tok/s"),
            ("prefill_tok_s", "prefill tok/s"),
            ("perplexity", "perplexity (held-out)"),
            ("top1_agreement", "top-1 agreement with float32"),
        ],
        strict=True,
    ):
        ax.barh(names, [rows[n][key] for n in names], color="#29335c")
        ax.set_title(title)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def markdown(result: dict) -> str:
    cols = [
        ("disk_MiB", "disk MiB"),
        ("weights_MiB", "weights MiB"),
        ("kv_bytes_per_token", "KV B/token"),
        ("perplexity", "perplexity"),
        ("top1_agreement", "top-1 agree"),
        ("kl_vs_float32", "KL vs float32"),
        ("greedy_prefix", "greedy prefix"),
        ("decode_tok_s", "decode tok/s"),
        ("prefill_tok_s", "prefill tok/s"),
        ("throughput_32_tok_s", "32-seq tok/s"),
        ("max_seqs_in_budget", f"seqs in {result['budget']}"),
    ]
    measured = [r for r in result["configs"].values() if "error" not in r]
    cols = [(k, h) for k, h in cols if any(r.get(k) for r in measured) or k == "greedy_prefix"]
    lines = [
        f"CPU: {result['cpu']} ({result['torch_threads']} threads); held-out {result['heldout_tokens']} tokens",
        "",
        "| row | " + " | ".join(h for _, h in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, r in result["configs"].items():
        if "error" in r:
            lines.append(f"| {name} | not loaded: {r['error'].replace('|', '/')} |" + " |" * (len(cols) - 1))
        else:
            lines.append(f"| {name} | " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
