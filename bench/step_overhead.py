"""Host time of one engine step: everything but the model's forward.

    python bench/step_overhead.py [--seqs 1 8 32 64] [--steps 20] [--stream-tokens 4000]
                                  [--label after] [--compare-with /path/to/old/checkout]

Two measurements, both on the public API only (``LLM``, ``engine.add_request``,
``engine.step``, ``llm.model``), so that the same script times an older checkout:

1. **Host time per step** at 1, 8, 32 and 64 running sequences on the real model
   (float32): the wall time of ``engine.step()`` minus the time spent inside the
   model's forward and LM head (timed by wrapping them). What is left is scheduling,
   input preparation, sampling and output processing.
2. **One streamed request of 4,000 tokens** (greedy, with logprobs) on a tiny
   random model written to a temporary folder (so the forward costs ~nothing):
   host time per token at the start and at the end of the stream, and in all. A
   per-token cost that grows with the length is the O(L^2) of copying the whole
   output (ids, logprobs, text) every step.

``--compare-with DIR`` first runs this same script against DIR (another checkout) in
a subprocess, then on this checkout, and writes both to the JSON and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ForwardTimer:
    """Wraps the model's forward and LM head; accumulates the seconds spent in them."""

    def __init__(self, model) -> None:
        self.total = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t

        return wrapper


def host_time_per_step(llm, batch_sizes: list[int], steps: int) -> list[dict]:
    from tokenmill import SamplingParams

    timer = ForwardTimer(llm.model)
    engine = llm.engine
    rows = []
    for b in batch_sizes:
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)
        for i in range(b):
            prompt = [1000 + (i * 37 + j) % 20000 for j in range(32)]
            engine.add_request(f"b{b}-{i}", prompt, params)
        started: set[str] = set()
        while len(started) < b:  # prefill: every request gets its first token
            for out in engine.step():
                started.add(out.request_id)
        host, fwd = [], []
        for _ in range(steps):
            timer.total = 0.0
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            host.append(wall - timer.total)
            fwd.append(timer.total)
        while engine.has_unfinished():
            engine.step()
        row = {"num_seqs": b, "host_ms": 1e3 * statistics.median(host), "forward_ms": 1e3 * statistics.median(fwd)}
        log(f"  {b:3d} seqs: host {row['host_ms']:.2f} ms/step, forward {row['forward_ms']:.1f} ms/step")
        rows.append(row)
    return rows


def write_tiny_model(folder: Path, tokenizer) -> None:
    """A 2-layer random Llama with the real tokenizer (so detokenising is real work)."""
    import torch
    from safetensors.torch import save_file

    vocab, hidden, inter, layers = tokenizer.vocab_size, 64, 128, 2
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for n, shape in {"q": (hidden, hidden), "k": (32, hidden), "v": (32, hidden), "o": (hidden, hidden)}.items():
            w[p + f"self_attn.{n}_proj.weight"] = torch.randn(*shape, generator=g) * 0.1
        for n, shape in {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}.items():
            w[p + f"mlp.{n}_proj.weight"] = torch.randn(*shape, generator=g) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    tokenizer.backend.save(str(folder / "tokenizer.json"))


def long_stream(tokenizer, num_tokens: int) -> dict:
    from tokenmill import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(Path(tmp), tokenizer)
        llm = LLM(model=tmp, dtype="float32", progress=False, kv_cache_memory="256MiB")
    timer = ForwardTimer(llm.model)
    # greedy with the chosen token's logprob and the top 1, as an OpenAI client streaming logprobs
    # asks: the per-step work is small, so any cost that grows with the length shows
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0, logprobs=1)
    per_token: list[float] = []
    last = time.perf_counter()
    timer.total = 0.0
    for _ in llm.stream([1000, 2000, 3000], params):
        now = time.perf_counter()
        per_token.append(now - last - timer.total)
        timer.total = 0.0
        last = now
    window = min(500, len(per_token) // 4)
    row = {
        "num_tokens": len(per_token),
        "host_total_s": sum(per_token),
        "host_us_per_token_first": 1e6 * statistics.median(per_token[1 : 1 + window]),
        "host_us_per_token_last": 1e6 * statistics.median(per_token[-window:]),
    }
    log(
        f"  stream of {row['num_tokens']} tokens: host {row['host_total_s']:.2f} s in all, "
        f"{row['host_us_per_token_first']:.0f} us/token at the start, {row['host_us_per_token_last']:.0f} at the end"
    )
    return row


def measure(args) -> dict:
    import torch

    from tokenmill import LLM

    torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(dtype="float32", progress=False, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory="1GiB")
    return {
        "label": args.label,
        "steps": host_time_per_step(llm, args.seqs, args.steps),
        "stream": long_stream(llm.tokenizer, args.stream_tokens),
    }


def cpu_info() -> dict:
    import torch

    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": [f for f in wanted if f" {f}" in flags],
        "cores": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        xs = [s["num_seqs"] for s in r["steps"]]
        a.plot(xs, [s["host_ms"] for s in r["steps"]], marker="o", label=r["label"])
        st = r["stream"]
        b.bar(
            [f"{r['label']}\nstart", f"{r['label']}\nend"],
            [st["host_us_per_token_first"], st["host_us_per_token_last"]],
        )
    a.set_xlabel("running sequences")
    a.set_ylabel("host time per step (ms), forward excluded")
    a.set_title("Engine step overhead (SmolLM2-135M, fp32)")
    a.legend()
    b.set_ylabel("host time per token (us)")
    b.set_title("One streamed 4,000-token request (tiny model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--label", default="after")
    p.add_argument("--compare-with", default=None, help="another checkout to measure in the same run (before)")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.json_only:  # the subprocess side of --compare-with
        print(json.dumps(measure(args)))
        return
    runs = []
    if args.compare_with:
        log(f"measuring {args.compare_with} (before) ...")
        cmd = [
            sys.executable,
            __file__,
            "--json-only",
            "--label",
            "before",
            "--steps",
            str(args.steps),
            "--stream-tokens",
            str(args.stream_tokens),
            "--seqs",
            *map(str, args.seqs),
        ]
        env = {**os.environ, "PYTHONPATH": str(Path(args.compare_with).resolve())}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=args.compare_with)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    log(f"measuring this checkout ({args.label}) ...")
    runs.append(measure(args))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "step_overhead.json").write_text(json.dumps({"cpu": cpu_info(), "runs": runs}, indent=1))
    plot(runs, RESULTS / "step_overhead.png")


if __name__ == "__main__":
    main()
