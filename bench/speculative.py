"""Speculative decoding: batch-1 decode speed with and without each proposer, on text
that repeats its prompt and on open-ended chat, and throughput at batch 1, 8 and 32
with prompt lookup on vs off (which sets the default spec_disable_batch_size).

    python bench/speculative.py [--max-tokens 96] [--repeats 2] [--self-layers 28]

Every configuration is loaded once and the runs are interleaved prompt by prompt, so
that the machine's drift hits all of them alike. Greedy decoding throughout; every
speculative output is checked token-identical to the plain one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.engine.stats import SpecDecodeStats

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def passages() -> list[str]:
    paras = [p.strip() for p in Path(__file__).with_name("prompt.txt").read_text().split("\n\n") if p.strip()]
    return [p[:700] for p in paras]


def workloads() -> dict[str, list[list[dict]]]:
    p = passages()

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    return {
        "repetitive": [
            user(f"Repeat the following text exactly, word for word:\n\n{p[0]}"),
            user(f"Rewrite the following text, changing 'mill' to 'factory' and nothing else:\n\n{p[1]}"),
            user(f"Copy out the first three sentences of this text:\n\n{p[2]}"),
            user(f"Fix any spelling mistakes in this text and return it in full:\n\n{p[3]}"),
        ],
        "open_chat": [
            user("Write a short story about a dragon who learns to bake bread."),
            user("Explain how rain forms, step by step."),
            user("Give me five tips for learning a new language."),
            user("What are the pros and cons of working from home?"),
        ],
    }


def decode_rate(llm: LLM, conv: list[dict], max_tokens: int) -> tuple[list[int], int, float]:
    """(tokens, number of tokens after the first, seconds they took)."""
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    t = out.timings[0]
    return out.outputs[0].token_ids, len(t.token_times) - 1, t.token_times[-1] - t.first_token


def batch_throughput(llm: LLM, convs: list[list[dict]], batch: int, max_tokens: int) -> tuple[float, list]:
    prompts = [convs[i % len(convs)] for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, [o.outputs[0].token_ids for o in outs]


def stats_dict(s: SpecDecodeStats) -> dict:
    return {
        "drafts": s.num_drafts,
        "proposed": s.num_draft_tokens,
        "accepted": s.num_accepted_tokens,
        "acceptance_rate": round(s.acceptance_rate, 3),
        "mean_accepted_length": round(s.mean_accepted_length, 2),
        "accepted_per_position": s.accepted_per_position,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens for ngram and draft")
    ap.add_argument("--self-layers", type=int, default=28)
    ap.add_argument("--self-k", type=int, default=1)
    ap.add_argument("--batches", default="1,2,4,8,32")
    ap.add_argument("--only-batched", action="store_true", help="skip the batch-1 decode comparison")
    args = ap.parse_args()

    common = dict(dtype="float32", progress=False, kv_cache_memory="1GiB", spec_disable_batch_size=1_000)
    log("loading models ...")
    base = LLM(**common)
    configs = {"off": base, "ngram": LLM(speculative="ngram", num_speculative_tokens=args.k, **common)}
    if not args.only_batched:
        configs |= {
            f"self(L={args.self_layers},k={args.self_k})": LLM(
                speculative="self", draft_layers=args.self_layers, num_speculative_tokens=args.self_k, **common
            ),
            "draft(=target)": LLM(
                speculative="draft", draft_model=str(base.model_path), num_speculative_tokens=args.k, **common
            ),
        }
    results: dict = {"max_tokens": args.max_tokens, "repeats": args.repeats, "batch1": {}, "batched": {}}

    for name, convs in ({} if args.only_batched else workloads()).items():
        tokens = {c: 0 for c in configs}
        seconds = {c: 0.0 for c in configs}
        for llm in configs.values():
            llm.engine.core.reset_spec_decode_stats()
        for rep in range(args.repeats):
            for i, conv in enumerate(convs):
                ref = None
                for c, llm in configs.items():
                    ids, n, dt = decode_rate(llm, conv, args.max_tokens)
                    ref = ids if ref is None else ref
                    assert ids == ref, f"{c} changed the greedy output of {name}[{i}]"
                    tokens[c] += n
                    seconds[c] += dt
                log(
                    f"{name} repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(convs)}: "
                    + ", ".join(f"{c} {tokens[c] / seconds[c]:.1f}" for c in configs)
                    + " tok/s"
                )
        rate_off = tokens["off"] / seconds["off"]
        results["batch1"][name] = {
            c: {
                "decode_tok_s": round(tokens[c] / seconds[c], 2),
                "speedup": round(tokens[c] / seconds[c] / rate_off, 2),
                **({} if c == "off" else stats_dict(llm.engine.core.spec_decode_stats)),
            }
            for c, llm in configs.items()
        }

    convs = [c for cs in workloads().values() for c in cs]
    batched = {"off": base, "ngram": configs["ngram"]}
    for b in [int(x) for x in args.batches.split(",")]:
        row = {}
        for rep in range(args.repeats):
            ref = None
            for c, llm in batched.items():
                llm.engine.core.reset_spec_decode_stats()
                rate, ids = batch_throughput(llm, convs, b, args.max_tokens // 2)
                ref = ids if ref is None else ref
                assert ids == ref, f"{c} changed greedy outputs at batch {b}"
                row.setdefault(c, []).append(rate)
                if c != "off":
                    row["ngram_stats"] = stats_dict(llm.engine.core.spec_decode_stats)
            log(f"batch {b} repeat {rep + 1}: " + ", ".join(f"{c} {row[c][-1]:.1f}" for c in batched) + " tok/s")
        best = {c: max(row[c]) for c in batched}
        results["batched"][str(b)] = {
            "off_tok_s": round(best["off"], 1),
            "ngram_tok_s": round(best["ngram"], 1),
            "ratio": round(best["ngram"] / best["off"], 2),
            "ngram_stats": row["ngram_stats"],
        }

    RESULTS.mkdir(exist_ok=True)
    if args.only_batched and (RESULTS / "speculative.json").exists():  # add these sizes to the full run's
        full = json.loads((RESULTS / "speculative.json").read_text())
        full["batched"] = dict(sorted({**full["batched"], **results["batched"]}.items(), key=lambda kv: int(kv[0])))
        results = full
    (RESULTS / "speculative.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    if results["batch1"]:
        plot(results)


def plot(results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results["batch1"])
    configs = list(results["batch1"][names[0]])
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        vals = [results["batch1"][n][c]["decode_tok_s"] for n in names]
        bars = ax1.bar([i + j * width for i in range(len(names))], vals, width, label=c)
        for bar, n in zip(bars, names, strict=True):
            ax1.annotate(
                f"{results['batch1'][n][c]['speedup']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax1.set_ylabel("decode tokens/s (batch 1)")
    ax1.set_title("Batch-1 decode, greedy")
    ax1.legend(fontsize=8)
    sizes = list(results["batched"])
    for key, label in (("off_tok_s", "off"), ("ngram_tok_s", "ngram")):
        ax2.plot([int(s) for s in sizes], [results["batched"][s][key] for s in sizes], "o-", label=label)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("Throughput, prompt lookup on vs off")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "speculative.png", dpi=120)
    log(f"wrote {RESULTS / 'speculative.png'}")


if __name__ == "__main__":
    main()
