"""Tensor and pipeline parallelism (issue 15): where a split step's time goes.

    python bench/parallel.py [--tokens 48]

All in one run, with the CPU recorded, on this machine's cores shared by the ranks
(gloo over loopback TCP):
- SmolLM2-135M (9 query heads, 3 KV heads, 30 layers) whole, TP=3, PP=2 and PP=3;
- a random model of SmolLM2's shapes with 8 query heads of 72 (2 KV heads), whole,
  TP=2 and PP=2 (SmolLM2 itself does not split in two);
each running three workloads: decode at batch 1 and batch 8 (64-token prompts,
``--tokens`` new tokens) and prefill (8 prompts of 256 tokens, one new token each).
Per step: wall time, and on the driver (rank 0) the seconds spent in each kind of
communication (all-reduce, logits gather, stage-to-stage receive, the step record's
broadcast), so compute = step - communication; bytes communicated per token.
First, gloo's all-reduce latency among otherwise idle processes (the floor under a
split step's 61 all-reduces); last, a prediction for a multi-GPU node from the byte
counts (no GPU was lent).
Writes bench/results/parallel.json and bench/results/parallel.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"decode b1": (1, 64, None), "decode b8": (8, 64, None), "prefill": (8, 256, 1)}  # batch, prompt, new


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def eight_head_model(path: Path, tokenizer) -> str:
    """SmolLM2's shapes (hidden 576, MLP 1536, 30 layers, vocabulary 49152) with 8 query
    heads of 72 and 2 KV heads: a model TP=2 splits. Random weights (timing only)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return str(path)


def run_workload(llm: LLM, name: str, max_new: int) -> dict:
    batch, prompt_len, new = WORKLOADS[name]
    vocab = llm.tokenizer.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new or max_new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    runner = llm.parts.runner
    stats = getattr(getattr(runner, "cluster", None), "stats", None)
    if stats is not None:
        stats.reset()
    llm.engine.core.step_stats.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = list(llm.engine.core.step_stats)
    tokens = sum(s.num_decode_tokens + s.num_prefill_tokens for s in steps)
    out = {
        "wall_s": wall,
        "steps": len(steps),
        "tokens_computed": tokens,
        "ms_per_step": 1e3 * wall / len(steps),
        "tokens_per_s": batch * params.max_tokens / wall,
    }
    if stats is not None:
        out["comm_ms_per_step"] = {k: 1e3 * v / len(steps) for k, v in stats.seconds.items()}
        out["bytes_per_token"] = {k: v / tokens for k, v in stats.bytes.items()}
        out["calls_per_step"] = {k: v / len(steps) for k, v in stats.calls.items()}
        comm = sum(stats.seconds.values())
        out["comm_share"] = comm / wall
        out["compute_ms_per_step"] = 1e3 * (wall - comm) / len(steps)
    else:
        out["compute_ms_per_step"] = out["ms_per_step"]
    return out


def _allreduce_rank(rank: int, port: int, size: int, shape: tuple[int, int], calls: int, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroupGloo

    torch.set_num_threads(1)
    store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", rank=rank, world_size=size))
    pg = ProcessGroupGloo(PrefixStore("bench", store), rank, size, timedelta(seconds=60))
    x = torch.randn(*shape)
    for _ in range(20):
        pg.allreduce([x]).wait()
    t0 = time.perf_counter()
    for _ in range(calls):
        pg.allreduce([x]).wait()
    if rank == 0:
        out.put((time.perf_counter() - t0) / calls)


def allreduce_latency(size: int, shape: tuple[int, int] = (8, 576), calls: int = 200) -> float:
    """Seconds per gloo all-reduce of ``shape`` float32 among ``size`` otherwise idle
    processes on this machine (what a split model's 61 calls per step cost at best)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, size, shape, calls, out)) for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def predict_gpu(hidden: int, layers: int, vocab: int, weight_bytes: float, tp: int, pp: int) -> dict:
    """Decode at batch 1 on an NVLink node (H200-class), from the byte counts above.

    Assumptions (stated, not measured here): HBM 4.8 TB/s at 70% -> weight-read time
    per step; NCCL all-reduce of a few KB within a node ~8 us (latency-bound; the
    bytes are negligible at NVLink's ~400 GB/s bus bandwidth); a stage-to-stage send
    ~8 us; kernel launch ~4 us per layer op (CUDA graphs remove most of it)."""
    hbm = 4.8e12 * 0.7
    compute_s = weight_bytes / tp / pp / hbm * pp  # each stage reads its share; the stages run in turn at batch 1
    all_reduces = 2 * layers + 1 if tp > 1 else 0
    comm_s = all_reduces * 8e-6 + (pp - 1) * 8e-6 + (8e-6 if tp > 1 else 0)  # + the logits gather
    return {
        "compute_ms": 1e3 * compute_s,
        "comm_ms": 1e3 * comm_s,
        "comm_share": comm_s / (compute_s + comm_s),
        "bytes_per_token_all_reduce": all_reduces * hidden * 2,
        "bytes_per_token_logits": vocab * 4,
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, name in zip(axes, WORKLOADS, strict=True):
        labels, compute, comm = [], [], []
        for r in res["runs"]:
            w = r["workloads"][name]
            labels.append(f"{r['model']}\n{r['split']}")
            compute.append(w["compute_ms_per_step"])
            comm.append(w["ms_per_step"] - w["compute_ms_per_step"])
        x = range(len(labels))
        ax.bar(x, compute, label="compute (driver)")
        ax.bar(x, comm, bottom=compute, label="communication + waiting (driver)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(name)
        ax.set_ylabel("ms per step")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Split model on {cpu_info().cores} CPU cores (gloo, loopback) - CPU: {cpu_info().describe()}", fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per decode request")
    p.add_argument("--allreduce-only", action="store_true", help="only the idle all-reduce latency")
    args = p.parse_args()
    log(f"CPU: {cpu_info().describe()}")
    latency = {n: allreduce_latency(n) for n in (2, 3)}
    log(
        "gloo all-reduce of [8, 576] float32, idle processes: "
        + ", ".join(f"{n} ranks {1e3 * t:.2f} ms" for n, t in latency.items())
    )
    if args.allreduce_only:
        return
    res: dict = {
        "cpu": cpu_info().as_dict(),
        "torch": torch.__version__,
        "runs": [],
        "idle_allreduce_ms": {n: 1e3 * t for n, t in latency.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = LLM(progress=False)
        eight = eight_head_model(Path(tmp), base.tokenizer)
        base.close()
        del base
        plans = [("smollm2", None, [(1, 1), (3, 1), (1, 2), (1, 3)]), ("smollm2-8h", eight, [(1, 1), (2, 1), (1, 2)])]
        for model_name, model, splits in plans:
            for tp, pp in splits:
                split = "whole" if tp * pp == 1 else f"TP={tp}" if pp == 1 else f"PP={pp}"
                log(f"{model_name} {split}: loading")
                t0 = time.perf_counter()
                llm = LLM(
                    model, progress=False, kv_cache_memory="256MiB", tensor_parallel_size=tp, pipeline_parallel_size=pp
                )
                run = {
                    "model": model_name,
                    "split": split,
                    "tp": tp,
                    "pp": pp,
                    "dtype": str(llm.dtype),
                    "build_s": time.perf_counter() - t0,
                    "workloads": {},
                }
                for name in WORKLOADS:
                    run["workloads"][name] = w = run_workload(llm, name, args.tokens)
                    comm = w["ms_per_step"] - w["compute_ms_per_step"]
                    log(
                        f"  {name}: {w['ms_per_step']:.1f} ms/step (communication {comm:.1f}), {w['tokens_per_s']:.1f} tok/s"
                    )
                llm.close()
                res["runs"].append(run)
    cfg = {"smollm2": (576, 30, 49152, 2 * 134.5e6), "70b": (8192, 80, 128256, 2 * 70.6e9)}
    res["gpu_prediction"] = {
        f"{m} TP={tp} PP={pp}": predict_gpu(*cfg[m], tp, pp)
        for m in cfg
        for tp, pp in ((1, 1), (2, 1), (8, 1), (1, 2), (4, 2))
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "parallel.png")
    log("wrote bench/results/parallel.json and parallel.png")


if __name__ == "__main__":
    main()
