"""What KV eviction (StreamingLLM, ``kv_eviction``) costs in quality, against full KV on the same
requests (issue 62): perplexity over a long private text, and retrieval of a fact planted at
several depths of a long context (a needle test), at 2x, 4x and 8x compression.

    .venv/bin/python bench/kv_eviction_quality.py [--model FILE.gguf] [--tokens 4096] [--needle-tokens 2048]

Rows: full KV; StreamingLLM (sinks and a recent window); SnapKV (a prompt once read keeps the
tokens its last 32 tokens attend to most; its perplexity column is n/a: a prompt's own logprobs
are computed before it is compressed). Compression is the context's length over the window: at 4x a 4,096-token text is read with the
sinks and 1,024-1,280 recent tokens' K/V, never more. (The bundled 135M model finds a needle
with full KV up to ~2,000 tokens of this text and loses it at 4,096: the needle test runs where
full KV passes, ``--needle-tokens``, its compression relative to that length.) The text is tokenmill's own README and
docs/ARCHITECTURE.md, written after the model was trained (private to it). Perplexity comes
from the prompt's own logprobs (each token scored as the engine reads it, in chunks that keep
the cache within its budget). The needle: "The passphrase is <word>-<word>-<n>." planted at a
depth of the same text, and the text ends asking for it; a hit is the greedy answer naming it.
Writes bench/results/kv_eviction_quality.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDLES = ["violet-harbor-42", "copper-lantern-17", "quiet-meadow-93", "amber-falcon-58", "silver-orchard-26"]
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def settings() -> list[tuple[str, str, int | None, int]]:
    """(label, policy, compression, sinks) rows: full KV; StreamingLLM at 2x, 4x, 8x and 8x without
    attention sinks; SnapKV at 2x, 4x, 8x."""
    return [
        ("full KV", "", None, 0),
        ("StreamingLLM 2x", "streaming", 2, 4),
        ("StreamingLLM 4x", "streaming", 4, 4),
        ("StreamingLLM 8x", "streaming", 8, 4),
        ("StreamingLLM 8x, no sinks", "streaming", 8, 0),
        ("SnapKV 2x", "snapkv", 2, 0),
        ("SnapKV 4x", "snapkv", 4, 0),
        ("SnapKV 8x", "snapkv", 8, 0),
    ]


def eviction(policy: str, ratio: int | None, sinks: int, tokens: int) -> dict | None:
    if ratio is None:
        return None
    if policy == "snapkv":
        return {"policy": policy, "window": tokens // ratio}
    return {"policy": policy, "window": tokens // ratio, "sinks": sinks}


def perplexity(llm, ids: list[int], eviction: dict | None) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, kv_eviction=eviction)
    out = llm.generate([ids], params)[0]
    lps = out.prompt_logprobs[1:]  # each prompt token's logprob (the first has none)
    assert len(lps) == len(ids) - 1
    return math.exp(-sum(lps) / len(lps))


def needle_prompts(tok, text_ids: list[int], tokens: int) -> list[tuple[str, float, list[int]]]:
    """(needle, depth, prompt ids): the needle sentence planted at ``depth`` of a ``tokens``-long
    stretch of the text, a question after it."""
    out = []
    question = tok.encode("\n\nQuestion: what is the passphrase?\nAnswer: The passphrase is", add_special_tokens=False)
    for depth in DEPTHS:
        for needle in NEEDLES[:2]:
            sentence = tok.encode(f" The passphrase is {needle}. Remember it. ", add_special_tokens=False)
            body = text_ids[: tokens - len(sentence) - len(question)]
            at = int(len(body) * depth)
            out.append((needle, depth, body[:at] + sentence + body[at:] + question))
    return out


def retrieval(llm, prompts, eviction: dict | None) -> dict[float, float]:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, kv_eviction=eviction)
    outs = llm.generate([ids for _, _, ids in prompts], params)
    hits: dict[float, list[bool]] = {}
    for (needle, depth, _), out in zip(prompts, outs, strict=True):
        hits.setdefault(depth, []).append(needle in out.outputs[0].text.replace(" ", ""))
    return {d: sum(h) / len(h) for d, h in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=4096, help="the perplexity text's length")
    ap.add_argument("--needle-tokens", type=int, default=2048, help="the needle test's context")
    args = ap.parse_args()

    from tokenmill import LLM

    llm = LLM(args.model, max_model_len=2 * args.tokens, kv_cache_memory="1GiB", progress=False)
    text = (ROOT / "README.md").read_text() + "\n\n" + (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    ids = llm.tokenizer.encode(text)
    if len(ids) < args.tokens:
        raise SystemExit(f"the text is {len(ids)} tokens, fewer than --tokens {args.tokens}")
    text_ids, ids = ids[1:], ids[: args.tokens]
    prompts = needle_prompts(llm.tokenizer, text_ids, args.needle_tokens)
    rows = []
    for label, policy, ratio, sinks in settings():
        t = time.perf_counter()
        ppl_ev = eviction(policy, ratio, sinks, args.tokens)
        needle_ev = eviction(policy, ratio, sinks, args.needle_tokens)
        # (SnapKV compresses a prompt once read: the prompt's own logprobs are full KV's)
        ppl = None if policy == "snapkv" else perplexity(llm, ids, ppl_ev)
        found = retrieval(llm, prompts, needle_ev)
        rows.append({"setting": label, "perplexity_eviction": ppl_ev, "needle_eviction": needle_ev})
        rows[-1] |= {"perplexity": ppl, "needle": found}
        print(f"{label}: perplexity {ppl}, needle {found} ({time.perf_counter() - t:.0f} s)", flush=True)
    full = rows[0]["perplexity"]
    print(
        f"\nperplexity over {args.tokens} tokens, needles in {args.needle_tokens}; {llm.model_path.name}, {cpu_name()}\n"
    )
    depths = " / ".join(f"{d:.0%}" for d in DEPTHS)
    print(f"| KV kept | window (text / needle) | perplexity | vs full | needle found at depth {depths} |")
    print("|---|---|---|---|---|")
    for r in rows:
        found = " / ".join(f"{r['needle'][d]:.0%}" for d in DEPTHS)
        ev, nev = r["perplexity_eviction"], r["needle_eviction"]
        window = "all" if ev is None else f"{ev['window']} / {nev['window']}"
        window += f", {ev['sinks']} sinks" if ev is not None and "sinks" in ev else ""
        ppl = r["perplexity"]
        ppl_cells = "n/a | n/a" if ppl is None else f"{ppl:.3f} | {ppl / full:.3f}x"
        print(f"| {r['setting']} | {window} | {ppl_cells} | {found} |")
    out = ROOT / "bench" / "results" / "kv_eviction_quality.json"
    out.write_text(
        json.dumps(
            {
                "cpu": cpu_name(),
                "tokens": args.tokens,
                "needle_tokens": args.needle_tokens,
                "model": str(llm.model_path),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
