"""Model routing's cascade on a private set of easy and hard questions: the share the small
model answers, agreement with the large model, and cost per 1M tokens against always-large.

    python bench/routing.py [--pair quant|layers] [--max-tokens 24] [--out routing_quant] [--live 0.4]

Only one real model ships here (SmolLM2-135M-Instruct), so the two models are two
settings of it:

- ``quant``: small = the Q4_1 file as it is (native int4 kernels); large = the same
  weights dequantised to float32 (what the quantised file approximates; slower);
- ``layers``: small = a copy with fewer layers (``--keep-layers``, the last one kept),
  written once as a Hugging Face folder; large = the whole model, in the same precision.

Every question (``bench/routing_prompts.json``: 60 easy, 60 hard, short answers) is
answered greedily by both models, one at a time, small and large interleaved (the
machine's drift hits both alike); each answer's compute-seconds are timed. The large
model's answer is the reference. A cascade at threshold t keeps the small answer when
its confidence (the geometric mean of its tokens' probabilities, as the server's
router computes it) is >= t, and otherwise pays for the large answer as well; its
agreement is the share of questions whose delivered answer equals the large model's
(normalised: case, spaces, trailing punctuation), and its cost the small model's
seconds on every question plus the large model's on the escalated ones, per 1M tokens
delivered, against always-large's.

``--live T`` then checks the server against that arithmetic: `tokenmill serve` with the
pair as two models and ``--router auto=small,large --router-threshold T`` is sent every
question (greedy, one at a time, model ``auto``); the share it routed small and the
agreement of what it answered are printed beside what the offline curve predicts at T,
with the decisions that differ.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info
from tokenmill.model.paths import resolve_model_path
from tokenmill.server.gateway.model_router import confidence

RESULTS = Path(__file__).parent / "results"
CACHE = Path.home() / ".cache" / "tokenmill" / "bench"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fewer_layers(keep: int) -> Path:
    """The default model with its first keep-1 layers and its last, as a Hugging Face
    folder in float32 (made once, with transformers)."""
    out = CACHE / f"smollm2-135m-{keep}-layers"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    gguf = resolve_model_path(None)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([*list(layers)[: keep - 1], layers[-1]])
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # (transformers marks a model read from GGUF as quantised)
    config["num_hidden_layers"] = keep
    fresh = transformers.AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tok.save_pretrained(out)
    log(f"wrote {out} ({keep} of {len(layers)} layers)")
    return out


def normalised(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return re.sub(r"\s+", " ", line.lower()).strip(" .!?,;:'\"")


def answer(llm: LLM, messages: list[dict], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    t = time.perf_counter()
    out = llm.chat(messages, params)[0]
    seconds = time.perf_counter() - t
    c = out.outputs[0]
    return {
        "text": c.text,
        "tokens": len(c.token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "seconds": seconds,
        "confidence": confidence(c.logprobs or []),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=("quant", "layers"), default="quant")
    ap.add_argument("--keep-layers", type=int, default=20, help="layers: how many the small model keeps (of 30)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--live", type=float, default=None, metavar="T", help="then check a real server's router at T")
    args = ap.parse_args()
    out_name = args.out or f"routing_{args.pair}"
    if args.pair == "quant":
        small = LLM(progress=False)  # the Q4_1 file, the default dtype
        large = LLM(quantization="none", dtype="float32", progress=False)
        settings = {
            "small": f"Q4_1 file as it is ({small.quantization}, {small.dtype})",
            "large": "the same weights dequantised to float32",
        }
    else:
        folder = fewer_layers(args.keep_layers)
        small = LLM(model=str(folder), dtype="float32", progress=False)
        large = LLM(quantization="none", dtype="float32", progress=False)
        settings = {"small": f"{args.keep_layers} of 30 layers, float32", "large": "all 30 layers, float32"}
    questions = json.loads(Path(__file__).with_name("routing_prompts.json").read_text())
    items = [(kind, q) for kind in ("easy", "hard") for q in questions[kind]]
    warm = [{"role": "user", "content": "Hello!"}]
    answer(small, warm, 8), answer(large, warm, 8)
    rows = []
    for n, (kind, q) in enumerate(items):
        messages = [{"role": "user", "content": q}]
        s, b = answer(small, messages, args.max_tokens), answer(large, messages, args.max_tokens)
        rows.append(
            {
                "kind": kind,
                "question": q,
                "small": s,
                "large": b,
                "agree": normalised(s["text"]) == normalised(b["text"]),
            }
        )
        if (n + 1) % 20 == 0:
            log(f"{n + 1}/{len(items)} questions")
    thresholds = [round(0.05 * i, 2) for i in range(21)]
    curve = [cascade(rows, t) for t in thresholds]
    result = {
        "cpu": cpu_info().describe(),
        "pair": args.pair,
        "settings": settings,
        "max_tokens": args.max_tokens,
        "small_seconds": sum(r["small"]["seconds"] for r in rows),
        "large_seconds": sum(r["large"]["seconds"] for r in rows),
        "always_small_agreement": sum(r["agree"] for r in rows) / len(rows),
        "curve": curve,
        "rows": rows,
    }
    print(f"CPU: {result['cpu']}\nsmall: {settings['small']}; large: {settings['large']}")
    print(
        f"time per question: small {result['small_seconds'] / len(rows) * 1000:.0f} ms, large "
        f"{result['large_seconds'] / len(rows) * 1000:.0f} ms; the small model agrees with the large on "
        f"{result['always_small_agreement']:.0%} (easy {share(rows, 'easy'):.0%}, hard {share(rows, 'hard'):.0%})"
    )
    print(
        f"{'threshold':>9s} {'small':>6s} {'easy':>5s} {'hard':>5s} {'agree':>6s} {'cost/1M tok':>12s} {'vs large':>9s}"
    )
    for c in curve:
        print(
            f"{c['threshold']:9.2f} {c['small_share']:6.0%} {c['easy_small']:5.0%} {c['hard_small']:5.0%} "
            f"{c['agreement']:6.0%} {c['cost_per_1m']:10.0f} s {c['cost_vs_large']:8.2f}x"
        )
    if args.live is not None:
        small.close()
        large.close()
        if args.pair != "quant":
            raise SystemExit("--live checks the quant pair (the server loads it from the default model)")
        result["live"] = live(rows, args.live, args.max_tokens)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{out_name}.png")
    log(f"wrote {RESULTS / out_name}.json/.png")
    return 0


def live(rows: list[dict], threshold: float, max_tokens: int) -> dict:
    """The server's router at ``threshold`` on the same questions, against the offline prediction."""
    import os
    import signal
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "serve",
        "--port",
        str(port),
        "--model",
        "small=default",
        "--model",
        "large=default,quantization=none,dtype=float32",
        "--router",
        "auto=small,large",
        "--router-threshold",
        str(threshold),
    ]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    routed, agree, differ = [], 0, []
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        for r in rows:
            body = {
                "model": "auto",
                "messages": [{"role": "user", "content": r["question"]}],
                "temperature": 0,
                "max_tokens": max_tokens,
            }
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            model = reply.headers["x-tokenmill-route"]
            routed.append(model)
            agree += normalised(reply.json()["choices"][0]["message"]["content"]) == normalised(r["large"]["text"])
            predicted = "small" if r["small"]["confidence"] >= threshold else "large"
            if model != predicted:
                differ.append(
                    {
                        "question": r["question"],
                        "predicted": predicted,
                        "routed": model,
                        "offline_confidence": r["small"]["confidence"],
                        "live_confidence": float(reply.headers["x-tokenmill-route-confidence"]),
                    }
                )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    offline = cascade(rows, threshold)
    out = {
        "threshold": threshold,
        "small_share": routed.count("small") / len(rows),
        "agreement": agree / len(rows),
        "predicted_small_share": offline["small_share"],
        "predicted_agreement": offline["agreement"],
        "decisions_differing": differ,
    }
    print(
        f"live server at threshold {threshold}: routed small {out['small_share']:.0%} (offline: "
        f"{offline['small_share']:.0%}), agreement {out['agreement']:.0%} (offline: {offline['agreement']:.0%}); "
        f"{len(differ)} of {len(rows)} decisions differ from the offline ones"
    )
    return out


def share(rows: list[dict], kind: str) -> float:
    mine = [r for r in rows if r["kind"] == kind]
    return sum(r["agree"] for r in mine) / len(mine)


def cascade(rows: list[dict], threshold: float) -> dict:
    kept = [r["small"]["confidence"] >= threshold for r in rows]
    seconds = sum(r["small"]["seconds"] + (0 if k else r["large"]["seconds"]) for r, k in zip(rows, kept, strict=True))
    delivered = sum(
        (r["small"] if k else r["large"])["tokens"] + r["large"]["prompt_tokens"]
        for r, k in zip(rows, kept, strict=True)
    )
    large_tokens = sum(r["large"]["tokens"] + r["large"]["prompt_tokens"] for r in rows)
    large_cost = sum(r["large"]["seconds"] for r in rows) / large_tokens * 1e6
    cost = seconds / delivered * 1e6

    def small_share(kind: str) -> float:
        mine = [k for r, k in zip(rows, kept, strict=True) if r["kind"] == kind]
        return sum(mine) / len(mine)

    return {
        "threshold": threshold,
        "small_share": sum(kept) / len(rows),
        "easy_small": small_share("easy"),
        "hard_small": small_share("hard"),
        "agreement": sum(r["agree"] or not k for r, k in zip(rows, kept, strict=True)) / len(rows),
        "cost_per_1m": cost,
        "cost_vs_large": cost / large_cost,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["curve"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.plot([c["cost_vs_large"] for c in curve], [c["agreement"] for c in curve], "o-")
    for c in curve[::2]:
        ax.annotate(
            f"{c['threshold']:.1f}",
            (c["cost_vs_large"], c["agreement"]),
            fontsize=7,
            xytext=(3, -9),
            textcoords="offset points",
        )
    ax.axvline(1.0, color="grey", ls=":", label="always large (agreement 1.0)")
    ax.set_xlabel("cost per 1M tokens, relative to always-large")
    ax.set_ylabel("agreement with the large model")
    ax.set_title("Cascade over thresholds (labels: threshold)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ts = [c["threshold"] for c in curve]
    ax.plot(ts, [c["easy_small"] for c in curve], "g-", label="easy questions answered small")
    ax.plot(ts, [c["hard_small"] for c in curve], "r-", label="hard questions answered small")
    ax.plot(ts, [c["agreement"] for c in curve], "k--", label="agreement")
    ax.set_xlabel("threshold (small answer's geometric-mean token probability)")
    ax.legend(fontsize=8)
    ax.set_title(f"small: {result['settings']['small']}\nlarge: {result['settings']['large']}", fontsize=8)
    fig.suptitle(f"CPU: {result['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
