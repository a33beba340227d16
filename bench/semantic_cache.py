"""The semantic cache's threshold: false hits and true hits over cosine thresholds.

    python bench/semantic_cache.py [--model PATH] [--out semantic_cache]

``bench/semantic_pairs.json`` holds 80 near-duplicate question pairs (same answer:
reworded, misspelt, reordered) and 80 look-alike pairs (nearly the same words, a
different answer: another country, swapped units, a negation). Each question is
embedded as the server's semantic cache embeds a last user message: the served model's
final hidden state at the last token (``--semantic-cache-pooling last``, the default) and
mean-pooled, L2-normalised.
A threshold t serves a cached answer for a pair whose cosine is >= t: on the first
set that is a true hit, on the second a false hit (a wrong answer served). The chosen
default is the lowest threshold with no false hit on this set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill import LLM
from tokenmill.kernels.cpu import cpu_info
from tokenmill.server.gateway.response_cache import cosine

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="semantic_cache")
    args = ap.parse_args()
    pairs = json.loads(Path(__file__).with_name("semantic_pairs.json").read_text())
    llm = LLM(model=args.model, progress=False)
    texts = sorted({q for kind in ("same", "different") for pair in pairs[kind] for q in pair})
    thresholds = [round(0.80 + 0.0025 * i, 4) for i in range(76)] + [round(0.99 + 0.0005 * i, 4) for i in range(21)]
    result: dict = {
        "cpu": cpu_info().describe(),
        "model": llm.model_path.name,
        "dtype": str(llm.dtype),
        "pairs": {k: len(v) for k, v in pairs.items()},
        "pooling": {},
    }
    for pooling in ("mean", "last"):
        vectors = dict(zip(texts, llm.embed(texts, pooling=pooling), strict=True))
        sims = {kind: [cosine(vectors[a], vectors[b]) for a, b in pairs[kind]] for kind in ("same", "different")}
        curve = [
            {
                "threshold": t,
                "true_hit": sum(s >= t for s in sims["same"]) / len(sims["same"]),
                "false_hit": sum(s >= t for s in sims["different"]) / len(sims["different"]),
            }
            for t in thresholds
        ]
        safe = next((c for c in curve if c["false_hit"] == 0), curve[-1])
        result["pooling"][pooling] = {
            "similarities": sims,
            "curve": curve,
            "lowest_threshold_without_false_hits": safe,
            "max_different": max(sims["different"]),
            "min_same": min(sims["same"]),
        }
        print(
            f"{pooling:5s} pooling: same pairs cos {min(sims['same']):.4f}..{max(sims['same']):.4f}, look-alikes "
            f"{min(sims['different']):.4f}..{max(sims['different']):.4f}; no false hit from t={safe['threshold']} "
            f"(true hits there: {safe['true_hit']:.0%})"
        )
        for t in (0.9, 0.95, 0.97, 0.98, 0.99, 0.9995):
            c = next(c for c in curve if abs(c["threshold"] - t) < 1e-9)
            print(f"   t={t:g}: true hits {c['true_hit']:.0%}, false hits {c['false_hit']:.0%}")
    result["variants"] = variants(llm, pairs, texts)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{args.out}.png")
    print(f"wrote {RESULTS / args.out}.json/.png", file=sys.stderr)
    return 0


def variants(llm: LLM, pairs: dict, texts: list[str]) -> dict[str, float]:
    """Could another use of the same model separate the two kinds? The ROC AUC (the chance
    that a near-duplicate pair is more alike than a look-alike pair; 0.5 is a coin) of
    lower-cased text, mean-centred vectors, a PromptEOL template and the chat template."""
    import torch

    def auc(vectors: list[list[float]], centred: bool) -> float:
        v = {t: torch.tensor(x) for t, x in zip(texts, vectors, strict=True)}
        mean = torch.stack(list(v.values())).mean(0) if centred else 0.0

        def cos(a: str, b: str) -> float:
            x, y = v[a] - mean, v[b] - mean
            return float(x @ y / (x.norm() * y.norm()))

        same = [cos(a, b) for a, b in pairs["same"]]
        diff = [cos(a, b) for a, b in pairs["different"]]
        return sum(s > d for s in same for d in diff) / (len(same) * len(diff))

    eol = 'This sentence : "{}" means in one word:"'
    inputs = {
        "last": (texts, "last"),
        "mean": (texts, "mean"),
        "lower-cased, last": ([t.lower() for t in texts], "last"),
        "PromptEOL template, last": ([eol.format(t) for t in texts], "last"),
        "chat template, last": (
            [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts],
            "last",
        ),
    }
    out = {}
    for name, (inp, pooling) in inputs.items():
        vectors = llm.embed(inp, pooling=pooling)
        for centred in (False, True):
            label = name + (", mean-centred" if centred else "")
            out[label] = auc(vectors, centred)
            print(f"   AUC {out[label]:.3f}  {label}")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pooling, style in (("mean", "-"), ("last", ":")):
        curve = result["pooling"][pooling]["curve"]
        ts = [c["threshold"] for c in curve]
        axes[0].plot(ts, [c["true_hit"] for c in curve], "g" + style, label=f"true hits ({pooling} pooling)")
        axes[0].plot(ts, [c["false_hit"] for c in curve], "r" + style, label=f"false hits ({pooling} pooling)")
        sims = result["pooling"][pooling]["similarities"]
        if pooling == "last":  # the server's default
            axes[1].hist(sims["same"], bins=30, alpha=0.6, color="g", label="near-duplicates")
            axes[1].hist(sims["different"], bins=30, alpha=0.6, color="r", label="look-alikes, other answer")
    axes[0].set_xlabel("cosine threshold")
    axes[0].set_ylabel("share of pairs served from the cache")
    axes[0].set_title("Semantic cache: hits over thresholds")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("cosine of the two questions' embeddings (last-token pooling, the default)")
    axes[1].set_title(f"{result['pairs']['same']} + {result['pairs']['different']} pairs, {result['model']}")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"CPU: {result['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
