"""Multi-LoRA serving (issue 14): what serving many adapters in one batch costs.

    python bench/lora.py [--requests 64] [--rank 16] [--dtype auto]

All in one run, on SmolLM2-135M with random rank-16 adapters on all seven projections
(written in PEFT's format to a temporary folder), with the CPU recorded:
- mixed-workload throughput (the same 64 prompts and lengths each time) with requests
  spread over 1, 4 and 16 adapters, relative to the base model alone (and to the base
  model in an engine with LoRA slots but no adapter in the batch);
- adapter load time (read + check) and memory per adapter;
- TTFT of the first request to a cold adapter (not in memory: read from disk on
  demand) against a warm one.
Writes bench/results/lora.json and bench/results/lora.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info
from tokenmill.lora.adapter import load_adapter, target_shapes

RESULTS = Path(__file__).parent / "results"
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    shapes = target_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for t, parent in TARGETS.items():
            out, inp = shapes[t]
            prefix = f"base_model.model.model.layers.{i}.{parent}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path


def workload(llm: LLM, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    text = Path(__file__).with_name("prompt.txt").read_text()
    ids = llm.tokenizer.encode(text)
    prompts, params = [], []
    for _ in range(n):
        start, length = rng.randrange(0, len(ids) - 256), rng.randint(32, 192)
        prompts.append(ids[start : start + length])
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(32, 96), ignore_eos=True))
    return prompts, params


def run(llm: LLM, prompts, params, loras) -> float:
    llm.generate(prompts[:2], params[:2], lora=None if loras is None else loras[:2])  # warm up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - t0)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["label"] for r in res["throughput"]]
    rel = [r["relative_to_base"] for r in res["throughput"]]
    bars = ax.bar(range(len(labels)), rel, color=["#777"] + ["#4a7"] * (len(labels) - 1))
    for b, r in zip(bars, res["throughput"], strict=True):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height(),
            f"{r['tok_per_s']:.0f} tok/s\n{r['relative_to_base']:.2f}x",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(0.8, color="r", ls="--", lw=1, label="target at 4 adapters (0.8x)")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("output throughput / base model alone")
    ax.set_ylim(0, 1.25)
    ax.set_title(f"Multi-LoRA: {res['requests']} requests, rank {res['rank']}, all 7 projections")
    ax.legend(loc="lower left")
    fig.suptitle(f"CPU: {cpu_info().describe()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    log(f"CPU: {cpu_info().describe()}")
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-lora-"))
    base = LLM(dtype=args.dtype, progress=False)
    cfg = base.config
    paths = [write_adapter(tmp / f"a{i}", cfg, args.rank, i) for i in range(17)]
    prompts, params = workload(base, args.requests)
    res: dict = {
        "cpu": cpu_info().as_dict(),
        "dtype": str(base.dtype),
        "requests": args.requests,
        "rank": args.rank,
        "command": " ".join(sys.argv),
    }

    t0 = time.perf_counter()
    adapter = load_adapter("a0", paths[0], cfg, args.rank)
    res["load_ms"] = (time.perf_counter() - t0) * 1e3
    res["adapter_mib"] = adapter.num_bytes / 2**20
    log(f"adapter load {res['load_ms']:.0f} ms, {res['adapter_mib']:.2f} MiB in memory (float32)")

    rows = []
    base_tps = run(base, prompts, params, None)
    rows.append({"label": "base model\n(no LoRA)", "tok_per_s": base_tps})
    log(f"base: {base_tps:.1f} tok/s")
    del base
    for n_adapters, max_loras in ((0, 4), (1, 4), (4, 4), (16, 16), (16, 4)):
        mods = [f"a{i}={paths[i]}" for i in range(max(n_adapters, 1))]
        llm = LLM(
            dtype=args.dtype,
            progress=False,
            enable_lora=True,
            lora_modules=mods,
            max_loras=max_loras,
            max_lora_rank=args.rank,
            max_cpu_loras=max(16, max_loras),
        )
        loras = None if n_adapters == 0 else [f"a{i % n_adapters}" for i in range(args.requests)]
        tps = run(llm, prompts, params, loras)
        label = (
            "LoRA slots,\nbase requests"
            if n_adapters == 0
            else f"{n_adapters} adapter{'s' * (n_adapters > 1)}\nmax_loras {max_loras}"
        )
        rows.append({"label": label, "adapters": n_adapters, "max_loras": max_loras, "tok_per_s": tps})
        log(f"{label.replace(chr(10), ' ')}: {tps:.1f} tok/s ({tps / base_tps:.2f}x)")
        if n_adapters == 16 and max_loras == 4:
            # TTFT to a cold adapter (evicted from memory: max_cpu_loras is 16, a16 never loaded)
            llm.load_lora("cold", str(paths[16]))
            llm.engine.core.runner.lora.loaded.pop("cold", None)
            ttft = {}
            for label_, name in (("cold", "cold"), ("warm", "cold")):
                out = llm.generate(prompts[0], SamplingParams(max_tokens=1), lora=name)[0]
                ttft[label_] = out.timings[0].ttft * 1e3
            res["ttft_ms"] = ttft
            log(f"TTFT cold adapter {ttft['cold']:.0f} ms, warm {ttft['warm']:.0f} ms")
        del llm
    for r in rows:
        r["relative_to_base"] = r["tok_per_s"] / base_tps
    res["throughput"] = rows
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "lora.png")
    log(
        f"wrote {RESULTS / 'lora.json'} and lora.png; medians {statistics.median([r['relative_to_base'] for r in rows]):.2f}"
    )


if __name__ == "__main__":
    main()
