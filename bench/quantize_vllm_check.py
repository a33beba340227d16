"""vLLM (its CPU build) and tokenmill on the same `tokenmill quantize` folder: greedy tokens
compared, prompt by prompt.

    .venv/bin/tokenmill quantize /tmp/smol-gptq --method gptq --bits 4 --group-size 128 --samples 8 --seq-len 256
    .venv/bin/python bench/quantize_vllm_check.py /tmp/smol-gptq [--max-tokens 32] [--dtype float32]

Run with tokenmill's python: it renders the chat prompts with the folder's tokenizer, answers
them with tokenmill, then runs itself under the vLLM venv (``--vllm-worker``, with the
environment vLLM's CPU backend wants: KV space, thread binding, tcmalloc and Intel OpenMP
preloaded) on the same token ids, and prints per prompt the tokens both agree on before they
first differ, and the totals as one JSON line. ``VLLM_VENV`` overrides /work/peers/vllm-venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about rivers.",
    "Explain what a binary search does, briefly.",
    "List three primary colours.",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
]


def vllm_env(venv: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_CPU_OMP_THREADS_BIND="0-1",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in this process: the stand-in below reaches it
        LD_PRELOAD=f"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{venv / 'lib' / 'libiomp5.so'}",
    )
    return env


def stand_in_for_missing_gemm() -> bool:
    """vLLM's AVX2 build (what an AVX2-only CPU loads: ``vllm._C_AVX2``) has no
    ``cpu_gemm_wna16``, the one GEMM its CPUWNA16 kernel calls; only the AVX512 builds do. Where
    it is missing, the kernel is given a torch stand-in: vLLM still parses the config, matches
    the groups, loads and shards the tensors into its fused q/k/v and gate/up parameters; the
    stand-in keeps those loaded tensors (before vLLM repacks them for the missing GEMM) and
    multiplies by ``(q - zero) * scale`` unpacked with vLLM's own ``unpack_quantized_values_into_int32``.
    Returns whether it was needed."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return False
    process = CPUWNA16LinearKernel.process_weights_after_loading

    def keep_loaded(self, layer):
        w_q, w_s, w_zp = self._get_weight_params(layer)
        wtype = self.config.weight_type
        q = unpack_quantized_values_into_int32(w_q.data, wtype, 1).float()  # [N, K]: loaded as [N, K / 8]
        if self.config.zero_points and w_zp is not None:
            zero = unpack_quantized_values_into_int32(w_zp.data, wtype, 0).float()  # [N / 8, G] -> [N, G]
        else:
            zero = torch.full_like(w_s.data, float(wtype.bias), dtype=torch.float32)
        group = q.shape[1] // w_s.shape[1]
        scale = w_s.data.float()
        layer.stand_in_weight = ((q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)).to(
            w_s.dtype
        )
        process(self, layer)

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.stand_in_weight, bias)

    CPUWNA16LinearKernel.process_weights_after_loading = keep_loaded
    CPUWNA16LinearKernel.apply_weights = apply
    return True


def run_vllm(folder: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    """In the vLLM venv: greedy answers to the token-id prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stand_in = stand_in_for_missing_gemm()
    llm = LLM(model=folder, dtype=dtype, max_model_len=2048, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "gemm_stand_in": stand_in}


def run_tokenmill(folder: str, max_tokens: int, dtype: str) -> tuple[list[list[int]], list[list[int]], object]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(folder, dtype=dtype, progress=False, kv_cache_memory="256MiB")
    tok = llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False) for p in PROMPTS
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return prompts, [list(o) for o in outs], tok


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="both engines' compute dtype (bfloat16 is emulated on AVX2)")
    p.add_argument("--vllm-worker", metavar="JSON", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_worker:  # in the vLLM venv
        job = json.loads(Path(args.vllm_worker).read_text())
        outs = run_vllm(args.folder, job["prompts"], args.max_tokens, args.dtype)
        Path(job["out"]).write_text(json.dumps(outs))
        return 0
    prompts, ours, tok = run_tokenmill(args.folder, args.max_tokens, args.dtype)
    venv = Path(os.environ.get("VLLM_VENV", "/work/peers/vllm-venv"))
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"prompts": prompts, "out": str(out)}))
        cmd = [str(venv / "bin" / "python"), __file__, args.folder, "--max-tokens", str(args.max_tokens)]
        cmd += ["--dtype", args.dtype, "--vllm-worker", str(job)]
        done = subprocess.run(cmd, env=vllm_env(venv), capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-8000:], sep="\n", file=sys.stderr)
            print(json.dumps({"vllm": "failed", "returncode": done.returncode}))
            return 1
        result = json.loads(out.read_text())
        theirs = result["outputs"]
    agree = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    same = [sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(ours, theirs, strict=True)]
    for prompt, a, b, n in zip(PROMPTS, ours, theirs, agree, strict=True):
        print(f"{prompt!r}: {n}/{len(a)} tokens before the first difference")
        print(f"  tokenmill: {tok.decode(a)!r}")
        if n < len(a):
            print(f"  vLLM:      {tok.decode(b)!r}")
    total = sum(len(a) for a in ours)
    print(
        json.dumps(
            {
                "folder": args.folder,
                "dtype": args.dtype,
                "vllm_gemm": "torch stand-in (AVX2 build lacks cpu_gemm_wna16)"
                if result["gemm_stand_in"]
                else "native",
                "prompts": len(PROMPTS),
                "identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                "prefix_tokens_agreeing": sum(agree),
                "positions_agreeing": sum(same),
                "tokens": total,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
