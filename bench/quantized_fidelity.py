"""How far quantised Hugging Face folders are from their float model, on texts none was calibrated on.

    python bench/quantized_fidelity.py REFERENCE FOLDER [FOLDER ...] [--out bench/results/quantized_fidelity.json]

Every model runs in transformers (compressed-tensors decompresses the quantised folders): an
oracle independent of our loader. Three texts, each cut into 512-token chunks:

- ``heldout``: tests/data/heldout.txt (the head of the Apache-2.0 licence), as bench/quantization.py;
- ``pydoc_other``: pydoc's plain-text pages of standard-library modules that neither our
  calibration mix (tokenmill/quantize/calibration.py) nor llm-compressor's runs here read,
  rendered now (first 40,000 characters);
- ``gpl3``: /usr/share/common-licenses/GPL-3 (Debian's copy; first 20,000 characters).

Per text: perplexity, top-1 agreement with the reference at each position, and the mean
KL(reference || folder) per position, the least noisy of the three (a perplexity can move
either way by chance; a KL only grows with the distance from the reference).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pydoc
import sys
from pathlib import Path

import torch

OTHER_MODULES = (
    "difflib", "pprint", "copy", "glob", "fnmatch", "calendar", "unicodedata", "xml.etree.ElementTree", "gzip",
    "operator", "numbers", "weakref", "traceback", "warnings", "locale", "gettext",
)  # fmt: skip
CHUNK = 512
ROOT = Path(__file__).resolve().parent.parent


def texts() -> dict[str, str]:
    out = {"heldout": (ROOT / "tests" / "data" / "heldout.txt").read_text()}
    docs = "\n\n".join(pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext) for m in OTHER_MODULES)
    out["pydoc_other"] = docs[:40_000]
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.exists():
        out["gpl3"] = gpl.read_text()[:20_000]
    return out


@torch.inference_mode()
def logprobs(path: str, ids: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for name, t in ids.items():
        chunks = [t[i : i + CHUNK] for i in range(0, len(t), CHUNK)]
        out[name] = [torch.log_softmax(model(c[None]).logits[0].float(), -1) for c in chunks if len(c) > 1]
    return out


def compare(ids: dict[str, torch.Tensor], ref: dict, got: dict) -> dict:
    res = {}
    for name, t in ids.items():
        nll, kl, agree, positions, predicted = 0.0, 0.0, 0, 0, 0
        for i, (a, b) in enumerate(zip(ref[name], got[name], strict=True)):
            chunk = t[i * CHUNK : (i + 1) * CHUNK]
            nll -= float(b[:-1].gather(1, chunk[1:, None]).sum())
            predicted += len(chunk) - 1
            kl += float((a.exp() * (a - b)).sum())
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            positions += len(chunk)
        res[name] = {
            "tokens": predicted,
            "perplexity": round(float(torch.tensor(nll / predicted).exp()), 3),
            "kl": round(kl / positions, 4),
            "top1": round(agree / positions, 4),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", help="the float Hugging Face folder the others were quantised from")
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quantized_fidelity.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.reference)
    ids = {k: tok(v, return_tensors="pt").input_ids[0][:8192] for k, v in texts().items()}
    ref = logprobs(args.reference, ids)
    rows = {}
    for folder in [args.reference, *args.folders]:
        try:
            got = ref if folder == args.reference else logprobs(folder, ids)
        except Exception as e:  # noqa: BLE001 - a folder transformers cannot load records why
            rows[Path(folder).name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
            continue
        rows[Path(folder).name] = compare(ids, ref, got)
        print(json.dumps({Path(folder).name: rows[Path(folder).name]}), flush=True)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows}, indent=2))
    names = list(ids)
    print("\n| folder | " + " | ".join(f"{n} KL | {n} ppl" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for folder, r in rows.items():
        if "error" in r:
            print(f"| {folder} | not loaded by transformers: {r['error']} |")
            continue
        print(f"| {folder} | " + " | ".join(f"{r[n]['kl']} | {r[n]['perplexity']}" for n in names) + " |")


if __name__ == "__main__":
    main()
