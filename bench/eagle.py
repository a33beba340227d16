"""Speculative heads (EAGLE, Medusa) on held-out chat: batch-1 decode speed-up, accepted
length and acceptance by depth, draft and verification cost per step, and batch 8.

    python bench/eagle.py [--head DIR] [--medusa DIR] [--max-tokens 128] [--rounds 1]

The chats (``bench/eagle_chats.txt``) are not the training prompts and do not copy their
input, so prompt lookup has little to find. Every configuration is loaded once and the
runs are interleaved chat by chat, so the machine's drift hits all alike. Greedy; every
output is compared with the plain one (the default dtype is bfloat16 on a CPU with
AVX512_BF16: a verification of several rows may round differently from a one-row
decode, which the count of identical outputs shows; the float32 identity is a test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import cpu_info

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chats() -> list[list[dict]]:
    lines = [ln.strip() for ln in Path(__file__).with_name("eagle_chats.txt").read_text().splitlines() if ln.strip()]
    return [[{"role": "user", "content": ln}] for ln in lines]


class Timer:
    """Seconds spent in the target's forward and in the proposer, per step."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.parts.runner
        self.forward_s = self.propose_s = 0.0
        self.steps = 0
        forward = runner._forward

        def timed_forward(seqs):
            t = time.perf_counter()
            out = forward(seqs)
            self.forward_s += time.perf_counter() - t
            self.steps += 1
            return out

        runner._forward = timed_forward
        if runner.proposer is not None:
            propose = runner.proposer.propose

            def timed_propose(*a, **kw):
                t = time.perf_counter()
                out = propose(*a, **kw)
                self.propose_s += time.perf_counter() - t
                return out

            runner.proposer.propose = timed_propose

    def reset(self) -> None:
        self.forward_s = self.propose_s = 0.0
        self.steps = 0


def decode(llm: LLM, conv: list[dict], max_tokens: int) -> tuple[list[int], int, float]:
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    t = out.timings[0]
    return out.outputs[0].token_ids, len(t.token_times) - 1, t.token_times[-1] - t.first_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, help="EAGLE head folder (default: the bundled one)")
    ap.add_argument("--medusa", default=None, help="a Medusa head folder to measure too")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--eagle",
        default="3:0:1:off,6:0.5:1:off,6:0.3:2:off,4:0.5:1:auto,6:0.5:1:auto",
        help="EAGLE configurations, k:draft_confidence:tree_width:auto-pause (auto|off),...",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="eagle")
    args = ap.parse_args()

    common = dict(progress=False, kv_cache_memory="1GiB")
    head = {} if args.head is None else {"draft_model": args.head}
    log("loading ...")
    configs: dict[str, LLM] = {
        "off": LLM(**common),
        "ngram k=4": LLM(speculative="ngram", spec_auto_pause=False, **common),
        "ngram k=4 auto-pause": LLM(speculative="ngram", **common),
    }
    settings = {}
    for spec in args.eagle.split(","):
        k, conf, width, pause = spec.split(":")
        name = (
            f"eagle k={k} conf={conf}"
            + (f" tree w={width}" if int(width) > 1 else "")
            + (" auto-pause" if pause == "auto" else "")
        )
        settings[name] = dict(
            speculative="eagle",
            num_speculative_tokens=int(k),
            draft_confidence=float(conf),
            spec_tree_width=int(width),
            spec_auto_pause=pause == "auto",
            **head,
        )
        configs[name] = LLM(**settings[name], **common)
    if args.medusa:
        configs["medusa k=3"] = LLM(speculative="medusa", draft_model=args.medusa, num_speculative_tokens=3, **common)
    timers = {c: Timer(llm) for c, llm in configs.items()}
    tokens = {c: 0 for c in configs}
    seconds = {c: 0.0 for c in configs}
    identical = {c: 0 for c in configs}
    convs = chats()
    for llm in configs.values():
        llm.engine.core.reset_spec_decode_stats()
    for t in timers.values():
        t.reset()
    for r in range(args.rounds):
        for i, conv in enumerate(convs):
            ref = None
            for c, llm in configs.items():
                ids, n, dt = decode(llm, conv, args.max_tokens)
                ref = ids if ref is None else ref
                identical[c] += ids == ref
                tokens[c] += n
                seconds[c] += dt
            log(
                f"round {r + 1} chat {i + 1}/{len(convs)}: "
                + ", ".join(f"{c} {tokens[c] / seconds[c]:.1f}" for c in configs)
            )
    off = tokens["off"] / seconds["off"]
    batch1 = {}
    for c, llm in configs.items():
        s, t = llm.engine.core.spec_decode_stats, timers[c]
        row = {
            "decode_tok_s": round(tokens[c] / seconds[c], 2),
            "speedup": round(tokens[c] / seconds[c] / off, 3),
            "identical_outputs": f"{identical[c]}/{len(convs) * args.rounds}",
            "forward_ms_per_step": round(1000 * t.forward_s / max(t.steps, 1), 2),
            "propose_ms_per_step": round(1000 * t.propose_s / max(t.steps, 1), 2),
            "steps": t.steps,
        }
        if s.num_drafts:
            row |= {
                "drafts": s.num_drafts,
                "draft_tokens": s.num_draft_tokens,
                "accepted": s.num_accepted_tokens,
                "acceptance_rate": round(s.acceptance_rate, 3),
                "tokens_per_step": round(tokens[c] / max(t.steps, 1), 2),
                "accepted_by_depth": [round(a / s.num_drafts, 3) for a in s.accepted_per_position],
            }
        batch1[c] = row
    log(json.dumps(batch1, indent=1))

    batched = {}
    prompts = [convs[i % len(convs)] for i in range(args.batch)]
    eagle_name = max(settings, key=lambda c: batch1[c]["speedup"])  # the best at batch 1
    runs = {"off": configs["off"], f"{eagle_name} (paused above 4)": configs[eagle_name]}
    runs[f"{eagle_name} (never paused)"] = LLM(**settings[eagle_name], spec_disable_batch_size=1000, **common)
    for r in range(args.rounds):
        for c, llm in runs.items():
            t0 = time.perf_counter()
            outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens // 2, ignore_eos=True))
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            batched.setdefault(c, []).append(rate)
        log(f"batch {args.batch} round {r + 1}: " + ", ".join(f"{c} {v[-1]:.1f}" for c, v in batched.items()))
    best = {c: max(v) for c, v in batched.items()}
    batch_n = {c: {"tok_s": round(v, 1), "ratio": round(v / best["off"], 3)} for c, v in best.items()}

    info = cpu_info()
    results = {
        "cpu": f"{info.model}, {info.cores} cores, {info.capability} ({' '.join(info.flags)}), torch {info.torch}",
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "chats": len(convs),
        "batch1": batch1,
        f"batch{args.batch}": batch_n,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    plot(results, RESULTS / f"{args.out}.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["batch1"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(rows)
    a.barh(names, [rows[c]["speedup"] for c in names], color=["grey"] + ["C0"] * (len(names) - 1))
    a.axvline(1.0, color="k", lw=0.8)
    for i, c in enumerate(names):
        a.annotate(
            f"{rows[c]['speedup']:.2f}x  ({rows[c]['decode_tok_s']:.0f} tok/s)",
            (rows[c]["speedup"], i),
            va="center",
            fontsize=7,
        )
    a.set_xlabel("batch-1 decode speed-up vs off (held-out chats, greedy)")
    for c in names:
        depth = rows[c].get("accepted_by_depth")
        if depth:
            b.plot(range(1, len(depth) + 1), depth, marker="o", label=c)
    b.set_xlabel("draft position")
    b.set_ylabel("share of drafts accepted up to this position")
    b.set_ylim(0, 1)
    b.legend(fontsize=7)
    fig.suptitle(results["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
