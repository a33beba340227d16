"""Offline throughput benchmark of vLLM (CPU build) on a token-id workload.

Run with the *vLLM venv's* python (not tokenmill's .venv), e.g. via the
wrapper /work/peers/run_vllm.sh, which sets everything below:

    VLLM_CPU_KVCACHE_SPACE=4          # GiB of KV cache vLLM's CPU backend allocates
    VLLM_CPU_OMP_THREADS_BIND=0-1     # cores the engine's OpenMP threads are pinned to
    VLLM_CPU_NUM_OF_RESERVED_CPU=0    # reserve no core for the frontend (2-core box)
    LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:<venv>/lib/libiomp5.so"
        # tcmalloc from Debian's libtcmalloc-minimal4; Intel OpenMP shipped in the
        # vLLM venv (intel-openmp wheel). vLLM's CPU docs recommend preloading both;
        # without them it runs, but slower and with a warning.

    /work/peers/vllm-venv/bin/python bench/peers/vllm_offline.py \
        --workload W.jsonl [--model /work/peers/smollm2-hf] [--dtype float32] \
        [--prefix-caching | --no-prefix-caching] [--dump-outputs OUT.jsonl]

The workload is JSONL, one request per line:
    {"prompt_token_ids": [1, 504, 3458, 314], "max_tokens": 16}

All requests are submitted in one LLM.generate() call (greedy, temperature=0,
ignore_eos=True so each request produces exactly max_tokens tokens). Only that
call is timed, after one tiny warm-up generate. One JSON line is printed to
stdout with the totals; mean_ttft_s is the mean over requests of vLLM's
RequestOutput.metrics.first_token_latency (seconds from the request's arrival,
i.e. it includes queueing behind the other requests of the batch), or null if
vLLM did not provide metrics.

--dump-outputs writes one JSON line per request, in workload order:
    {"index": i, "prompt_token_ids": [...], "output_token_ids": [...]}
for comparing greedy outputs against another engine.
"""

import argparse
import json
import sys
import time


def load_workload(path):
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            ids = obj.get("prompt_token_ids")
            n = obj.get("max_tokens")
            if not isinstance(ids, list) or not ids or not isinstance(n, int) or n < 1:
                raise ValueError(f"{path}:{lineno}: need non-empty prompt_token_ids and max_tokens >= 1")
            reqs.append((ids, n))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="JSONL of {prompt_token_ids, max_tokens}")
    p.add_argument("--model", default="/work/peers/smollm2-hf", help="Hugging Face model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="enable vLLM automatic prefix caching (default: on)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM max_num_seqs (default: vLLM's)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="vLLM max_num_batched_tokens (default: vLLM's)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dump-outputs", metavar="PATH", default=None, help="write generated token ids per request as JSONL"
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    reqs = load_workload(args.workload)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm_kwargs = dict(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        # keep per-request metrics (RequestOutput.metrics) for TTFT
        disable_log_stats=False,
    )
    if args.max_num_seqs is not None:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(**llm_kwargs)

    # Warm-up: shorter than one KV block, so it leaves nothing in the prefix cache.
    llm.generate(
        [TokensPrompt(prompt_token_ids=[1, 100, 101, 102])],
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    total_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    total_prompt = sum(len(ids) for ids, _ in reqs)

    ttfts = []
    for o in outputs:
        m = getattr(o, "metrics", None)
        v = getattr(m, "first_token_latency", None) if m is not None else None
        if v is not None and v > 0:
            ttfts.append(float(v))
    mean_ttft = sum(ttfts) / len(ttfts) if len(ttfts) == len(outputs) else None

    if args.dump_outputs:
        with open(args.dump_outputs, "w") as f:
            for i, ((ids, _), o) in enumerate(zip(reqs, outputs, strict=True)):
                f.write(
                    json.dumps({"index": i, "prompt_token_ids": ids, "output_token_ids": list(o.outputs[0].token_ids)})
                    + "\n"
                )

    result = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "prefix_caching": args.prefix_caching,
        "num_requests": len(outputs),
        "total_output_tokens": total_out,
        "total_prompt_tokens": total_prompt,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(total_out / elapsed, 3) if elapsed > 0 else None,
        "mean_ttft_s": round(mean_ttft, 4) if mean_ttft is not None else None,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
