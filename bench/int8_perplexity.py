"""The int8 arithmetic's perplexity against llama.cpp's on the same file and text (issue 41:
the fast mode is the default only where its perplexity is within llama.cpp's own).

    .venv/bin/python bench/int8_perplexity.py --llama-bin /work/peers/llama.cpp-avx2/bin \\
        [--model FILE.gguf] [--text tests/data/heldout.txt] [--ctx 128]

llama.cpp's ``llama-perplexity -c CTX`` cuts the text into windows of CTX tokens and scores
the second half of each (every token seen with at least CTX/2 before it). tokenmill does
the same here on **llama.cpp's own tokens** (``llama-tokenize --ids``: the two tokenizers
split some whitespace runs differently, which alone moved the perplexity by ~1%), feeding
each window 8 tokens a step (decode-sized steps: the int8 kernels; the float arithmetic for
comparison), and reports both arithmetics' perplexity and llama.cpp's (and ours on our own
tokens, for reference). Writes bench/results/int8_perplexity.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


@torch.inference_mode()
def windows_perplexity(llm, ids: list[int], ctx: int, step: int = 8) -> tuple[float, int]:
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.inputs import SeqInput

    runner, engine = llm.parts.runner, llm.engine
    nll, count = 0.0, 0
    for w in range(len(ids) // ctx):
        window = ids[w * ctx : (w + 1) * ctx]
        with engine.core.borrow_blocks(-(-ctx // engine.core.block_size)) as blocks:
            for start in range(0, ctx - 1, step):
                piece = window[start : start + step]
                s = SeqInput("ppl", piece, start, blocks, False, SamplingParams(), [], [])
                logprobs = runner.all_logits([s]).log_softmax(dim=-1)
                for j in range(len(piece)):
                    pos = start + j
                    if ctx // 2 <= pos < ctx - 1:
                        nll -= logprobs[j, window[pos + 1]].item()
                        count += 1
    return math.exp(nll / count), count


def llama_perplexity(binary: Path, model: Path, text: Path, ctx: int) -> float:
    r = subprocess.run(
        [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    assert m, (r.stdout + r.stderr)[-2000:]
    return float(m.group(1))


def llama_tokens(binary: Path, model: Path, text: Path) -> list[int]:
    r = subprocess.run(
        [str(binary), "-m", str(model), "-f", str(text), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, default=Path("/work/peers/llama.cpp-avx2/bin"))
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "heldout.txt")
    ap.add_argument("--ctx", type=int, default=128)
    args = ap.parse_args()
    from tokenmill import LLM
    from tokenmill.kernels.cpu import cpu_info
    from tokenmill.model.paths import resolve_model_path

    model = resolve_model_path(args.model)
    res = {"cpu": cpu_info().describe(), "model": str(model), "text": str(args.text), "ctx": args.ctx}
    theirs = llama_tokens(args.llama_bin / "llama-tokenize", model, args.text)
    for arith in ("float", "int8"):
        llm = LLM(str(model), dtype="float32", quant_arithmetic=arith, progress=False, kv_cache_memory="64MiB")
        ours = llm.tokenizer.encode(args.text.read_text())
        res["tokens_differ"] = ours != theirs
        for name, ids in (("", theirs), ("_own_tokens", ours)):
            t0 = time.perf_counter()
            res[f"tokenmill_{arith}{name}"], res["scored_tokens"] = windows_perplexity(llm, ids, args.ctx)
            print(
                f"tokenmill {arith}{name}: {res[f'tokenmill_{arith}{name}']:.4f} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    res["llama_cpp"] = llama_perplexity(args.llama_bin / "llama-perplexity", model, args.text, args.ctx)
    print(f"llama.cpp: {res['llama_cpp']:.4f}")
    out = ROOT / "bench" / "results" / "int8_perplexity.json"
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
