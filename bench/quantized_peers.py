"""Checkpoints quantised by other libraries, loaded by tokenmill, checked against their oracle.

    python bench/quantized_peers.py [--dir /work/peers/quantized] [--only REGEX]

Every folder under ``--dir`` with a ``reference.json`` (transformers' own greedy tokens for
fixed prompts: the folder loaded with ``AutoModelForCausalLM.from_pretrained``, which
decompresses compressed-tensors checkpoints) is loaded twice: with tokenmill's default
(``quantization="auto"``: native kernels over the packed weights where there are some) and
with ``quantization="none"`` (the weights dequantised to float32: the reference path). For
each prompt the same prompt token ids are run greedily for the same number of tokens, and
the report counts the tokens equal to the reference's, the length of the common prefix, and
at the first divergence the reference's own top-1/top-2 logit margin there (a divergence at
a near-tie, margin < ``--tie``, is float noise rather than a loader bug).

Writes bench/results/quantized_peers.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check(folder: Path, ref: dict, quantization: str, tie: float) -> dict:
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=str(folder), quantization=quantization, dtype="float32", progress=False, kv_cache_memory="64MiB"
        )
    except Exception as e:  # noqa: BLE001 - a folder that does not load records why
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(ref["prompt_ids"], params)]
    row = {"load_s": round(load_s, 2), "vs_reference": compare(got, ref, "", tie)}
    if "weight_only_output_ids" in ref:
        row["vs_weight_only"] = compare(got, ref, "weight_only_", tie)
    row["qkv_module"] = type(llm.model.layers[0].self_attn.qkv_proj).__name__
    return row


def compare(got: list[list[int]], ref: dict, prefix: str, tie: float) -> list[dict]:
    """Per prompt: tokens equal to the reference's, common prefix, the reference's margin there."""
    prompts = []
    for i, (g, want) in enumerate(zip(got, ref[prefix + "output_ids"], strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, want, strict=False)) if a != b), len(want))
        margins = ref.get(prefix + "top2_margins", [[]] * len(got))[i]
        margin = margins[first] if first < min(len(want), len(margins)) else None
        prompts.append(
            {
                "equal": sum(a == b for a, b in zip(g, want, strict=False)),
                "prefix": first,
                "of": len(want),
                "margin_at_divergence": margin,
                "near_tie": margin is not None and margin < tie,
            }
        )
    return prompts


def summary(ps: list[dict]) -> str:
    exact = sum(p["prefix"] == p["of"] for p in ps)
    ties = sum(p["near_tie"] for p in ps)
    cells = " ".join(f"{p['prefix']}/{p['of']}" for p in ps)
    return f"{exact}/{len(ps)} exact ({cells})" + (f", {ties} at a near-tie" if ties else "")


def verdict(r: dict) -> str:
    if "error" in r:
        return "not loaded: " + r["error"].replace("|", "/")
    text = summary(r["vs_reference"])
    if "vs_weight_only" in r:
        text += "; weight-only ref: " + summary(r["vs_weight_only"])
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/work/peers/quantized"))
    ap.add_argument("--only", help="regular expression on the folder names")
    ap.add_argument("--tie", type=float, default=1e-3, help="a reference margin below this is a near-tie")
    ap.add_argument("--out", type=Path, default=RESULTS / "quantized_peers.json")
    args = ap.parse_args()
    results = {}
    for folder in sorted(p.parent for p in args.dir.glob("*/reference.json")):
        if args.only and not re.search(args.only, folder.name):
            continue
        ref = json.loads((folder / "reference.json").read_text())
        qcfg = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
        row = {"format": qcfg.get("format"), "quant_method": qcfg.get("quant_method")}
        for mode in ("auto", "none"):
            row[mode] = check(folder, ref, mode, args.tie)
            log(f"{folder.name} [{mode}]: {verdict(row[mode])}")
        results[folder.name] = row
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    log(f"wrote {args.out}")
    print("| folder | format | default (auto) | quantization=none |")
    print("|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['format']} | {verdict(row['auto'])} | {verdict(row['none'])} |")


if __name__ == "__main__":
    main()
