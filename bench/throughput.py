"""Offline throughput: naive transformers vs our static and continuous batching (and vLLM),
prefix caching on vs off, and KV memory use. One run, one machine.

    python bench/throughput.py [--num-requests 64] [--max-num-seqs 32] [--naive-sample 8]
                               [--dtype float32|auto] [--vllm bench/peers/run_vllm.sh]

Workloads (seeded, written to bench/results/ as JSONL so peers run the same requests):
- mixed: prompts of 16..1000 tokens (log-uniform), outputs of 16..256 tokens (uniform),
  ignore_eos, all submitted at once;
- shared_prefix: 32 requests sharing a ~1000-token system prompt, each with its own
  question, 32 output tokens.
The naive baseline (transformers `generate`, one request at a time) runs on an evenly
spaced sample of the mixed workload: its tokens/s do not depend on how many requests
it is given, since it serves them one after another.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def corpus_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(Path(__file__).with_name("prompt.txt").read_text())
    return ids * 4


def mixed_workload(tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    reqs = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(16), math.log(1000))))
        start = rng.randrange(0, len(ids) - length)
        reqs.append((ids[start : start + length], rng.randint(16, 256)))
    return reqs


def shared_prefix_workload(tokenizer, n: int = 32) -> list[tuple[list[int], int]]:
    system = corpus_ids(tokenizer)[:1000]
    questions = [
        f"Question {i}: summarise paragraph {i % 4 + 1} in one sentence, mentioning item {i}." for i in range(n)
    ]
    return [(system + tokenizer.encode(q), 32) for q in questions]


def write_jsonl(reqs, path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": m}) + "\n" for p, m in reqs))


def run_ours(llm: LLM, reqs) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.engine.core.step_stats.clear()
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.token_ids) for o in outs)
    stats = list(llm.engine.core.step_stats)
    slots = sum(s.kv_slots_held for s in stats)
    return {
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "mean_ttft_s": sum(o.timings[0].ttft for o in outs) / len(outs),
        "steps": len(stats),
        "mean_batch_seqs": sum(s.num_seqs for s in stats) / len(stats),
        "kv_waste": 1 - sum(s.kv_tokens_held for s in stats) / slots if slots else 0.0,
        "preemptions": sum(s.num_preempted for s in stats),
        "prefix_hit_rate": llm.prefix_cache_stats.hit_rate,
        "outputs": [o.token_ids for o in outs],
    }


@torch.inference_mode()
def run_naive(model, reqs) -> dict:
    from transformers import GenerationConfig

    tokens, t = 0, time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(reqs):
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        out = model.generate(torch.tensor([prompt]), generation_config=cfg)
        tokens += out.shape[1] - len(prompt)
        log(f"  naive {i + 1}/{len(reqs)}")
    elapsed = time.perf_counter() - t
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def run_vllm(script: str, workload: Path, *flags: str) -> dict | None:
    log(f"  vLLM {workload.name} {' '.join(flags)} (starts in a few minutes)")
    r = subprocess.run([script, "--workload", str(workload), *flags], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        log(f"  vLLM failed ({r.returncode}): {r.stderr[-2000:]}")
        return None
    return json.loads(lines[-1])


def make_llm(max_num_seqs: int, dtype: str = "float32", **kw) -> LLM:
    return LLM(dtype=dtype, kv_cache_memory="2GiB", max_num_seqs=max_num_seqs, progress=False, **kw)


def kv_capacity(reqs, bytes_per_token: int, waste: float, max_model_len: int) -> dict:
    """Requests of this workload that fit at once in 1 GiB of KV, three ways."""
    budget = (1 << 30) // bytes_per_token  # tokens
    final = [len(p) + m for p, m in reqs]
    paged = sum(math.ceil(n / BLOCK) * BLOCK for n in final) / len(final)
    return {
        "tokens_per_gib": budget,
        "paged_mean_slots_per_request": paged,
        "paged_concurrency": int(budget // paged),
        "reserve_prompt_plus_max_tokens_concurrency": int(budget // (sum(final) / len(final))),
        "prealloc_max_model_len": max_model_len,
        "prealloc_max_model_len_concurrency": budget // max_model_len,
        "prealloc_waste_vs_final_length": 1 - (sum(final) / len(final)) / max_model_len,
        "paged_measured_waste": waste,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--naive-sample", type=int, default=8)
    ap.add_argument("--dtype", default="float32", help="tokenmill's dtype (auto: bfloat16 where the CPU has it)")
    ap.add_argument("--vllm", default=None, help="path of bench/peers/run_vllm.sh to include vLLM")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    res: dict = {"args": vars(args), "torch_threads": torch.get_num_threads()}

    log("loading tokenmill (continuous batching)")
    llm = make_llm(args.max_num_seqs, args.dtype)
    mixed = mixed_workload(llm.tokenizer, args.num_requests)
    prefix = shared_prefix_workload(llm.tokenizer)
    write_jsonl(mixed, RESULTS / "workload_mixed.jsonl")
    write_jsonl(prefix, RESULTS / "workload_shared_prefix.jsonl")
    res["mixed_workload"] = {
        "requests": len(mixed),
        "prompt_tokens": sum(len(p) for p, _ in mixed),
        "output_tokens": sum(m for _, m in mixed),
    }
    llm.generate(mixed[0][0][:32], SamplingParams(max_tokens=4))  # warm-up

    log("mixed workload: continuous batching")
    cont = run_ours(llm, mixed)
    log(f"  {cont['output_tokens_per_s']:.1f} tok/s in {cont['elapsed_s']:.1f}s")
    log("shared-prefix workload: prefix caching on")
    llm_prefix_on = make_llm(args.max_num_seqs, args.dtype)
    p_on = run_ours(llm_prefix_on, prefix)
    del llm_prefix_on
    log(f"  {p_on['output_tokens_per_s']:.1f} tok/s, mean TTFT {p_on['mean_ttft_s']:.2f}s")
    res["kv_capacity"] = kv_capacity(mixed, llm.config.kv_bytes_per_token(4), cont["kv_waste"], 2048)
    del llm

    log("mixed workload: static batching")
    llm = make_llm(args.max_num_seqs, args.dtype, scheduling="static")
    static = run_ours(llm, mixed)
    log(f"  {static['output_tokens_per_s']:.1f} tok/s in {static['elapsed_s']:.1f}s")
    del llm
    log("shared-prefix workload: prefix caching off")
    llm = make_llm(args.max_num_seqs, args.dtype, enable_prefix_caching=False)
    p_off = run_ours(llm, prefix)
    log(f"  {p_off['output_tokens_per_s']:.1f} tok/s, mean TTFT {p_off['mean_ttft_s']:.2f}s")
    model_path = llm.model_path
    del llm

    res["static_equals_continuous"] = static.pop("outputs") == cont.pop("outputs")
    res["prefix_on_equals_off"] = p_on.pop("outputs") == p_off.pop("outputs")
    res.update(continuous=cont, static=static, prefix_on=p_on, prefix_off=p_off)

    log(f"naive transformers generate on {args.naive_sample} of the requests")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32).eval()
    step = max(1, len(mixed) // args.naive_sample)
    res["naive"] = run_naive(hf, mixed[::step][: args.naive_sample])
    del hf
    log(f"  {res['naive']['output_tokens_per_s']:.1f} tok/s")

    if args.vllm:
        res["vllm_mixed"] = run_vllm(
            args.vllm, RESULTS / "workload_mixed.jsonl", "--max-num-seqs", str(args.max_num_seqs)
        )
        res["vllm_prefix_on"] = run_vllm(
            args.vllm, RESULTS / "workload_shared_prefix.jsonl", "--max-num-seqs", str(args.max_num_seqs)
        )
        res["vllm_prefix_off"] = run_vllm(
            args.vllm,
            RESULTS / "workload_shared_prefix.jsonl",
            "--no-prefix-caching",
            "--max-num-seqs",
            str(args.max_num_seqs),
        )

    naive = res["naive"]["output_tokens_per_s"]
    res["ratios"] = {
        "continuous_vs_naive": cont["output_tokens_per_s"] / naive,
        "continuous_vs_static": cont["output_tokens_per_s"] / static["output_tokens_per_s"],
        "prefix_on_vs_off_throughput": p_on["output_tokens_per_s"] / p_off["output_tokens_per_s"],
        "prefix_on_vs_off_ttft": p_off["mean_ttft_s"] / p_on["mean_ttft_s"],
    }
    if res.get("vllm_mixed"):
        res["ratios"]["continuous_vs_vllm"] = cont["output_tokens_per_s"] / res["vllm_mixed"]["output_tokens_per_s"]
    (RESULTS / "throughput.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    plot(res, RESULTS / "throughput.png")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["transformers\nnaive", "tokenmill\nstatic", "tokenmill\ncontinuous"]
    vals = [
        res["naive"]["output_tokens_per_s"],
        res["static"]["output_tokens_per_s"],
        res["continuous"]["output_tokens_per_s"],
    ]
    if res.get("vllm_mixed"):
        names.append("vLLM\n(CPU)")
        vals.append(res["vllm_mixed"]["output_tokens_per_s"])
    a.bar(names, vals, color=["grey", "tab:blue", "tab:green", "tab:red"][: len(vals)])
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    a.set_ylabel("output tokens/s")
    a.set_title(f"mixed workload ({res['mixed_workload']['requests']} requests)")
    labels = ["prefix cache off", "prefix cache on"]
    b.bar(
        labels,
        [res["prefix_off"]["output_tokens_per_s"], res["prefix_on"]["output_tokens_per_s"]],
        color=["grey", "tab:green"],
    )
    b.set_ylabel("output tokens/s")
    b2 = b.twinx()
    b2.plot(labels, [res["prefix_off"]["mean_ttft_s"], res["prefix_on"]["mean_ttft_s"]], "ko-", label="mean TTFT")
    b2.set_ylabel("mean TTFT (s)")
    b.set_title("32 requests sharing a 1000-token prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
