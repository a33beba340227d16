"""lm-eval's `local-completions` model against `tokenmill serve`: a small loglikelihood
task with local data (no hub), and its per-item loglikelihoods checked against our
offline prompt logprobs.

lm-eval pulls its own dependencies (datasets, torch and more), so it runs in a venv of
its own; this script runs with ours (it also computes the offline reference):

    python -m venv /tmp/lv && /tmp/lv/bin/pip install torch==2.13.0 "lm_eval[api]"
    .venv/bin/python bench/lm_eval_check.py --lm-eval /tmp/lv/bin/lm_eval

lm-eval tokenises through the server (/tokenizer_info, /tokenize: its "remote"
tokenizer), sends `echo: true, max_tokens: 1, logprobs: 1` with token-id prompts, and
sums the continuation's logprobs. Writes results/lm_eval.json with its table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from soak import free_port, wait_healthy  # noqa: E402 - a sibling script

MODEL = "smollm2"
CAPITALS = [
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Greece", "Athens"),
    ("Cuba", "Havana"),
]
TASK = """task: tokenmill_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path) -> None:
    cities = [c for _, c in CAPITALS]
    with open(folder / "capitals.jsonl", "w") as f:
        for i, (country, city) in enumerate(CAPITALS):
            choices = [city, cities[(i + 3) % len(cities)], cities[(i + 7) % len(cities)]]
            choices = [" " + c for c in sorted(choices)]
            f.write(json.dumps({"country": country, "choices": choices, "answer": choices.index(" " + city)}) + "\n")
    (folder / "tokenmill_capitals.yaml").write_text(TASK.format(data=folder / "capitals.jsonl"))


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """A logged sample's (context, continuation) per choice."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [(a[0], a[1]) for a in args]


def offline_loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per sample, per choice: sum of the continuation's prompt logprobs, tokenised as
    lm-eval does (context alone, then context + continuation, no special tokens)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype="float32", progress=False)
    out = []
    for s in samples:
        row = []
        for context, continuation in _pairs(s):
            whole = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
            ctx = llm.tokenizer.encode(context, add_special_tokens=False)
            lp = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0].prompt_logprobs
            row.append(sum(lp[len(ctx) :]))
        out.append(row)
    llm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", default="lm_eval", help="lm-eval's command (in its own venv)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-lm-eval-"))
    write_task(work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(HERE / "results" / "lm_eval_server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill",
            "serve",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--served-model-name",
            MODEL,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        wait_healthy(url)
        cmd = [
            args.lm_eval,
            "--model",
            "local-completions",
            "--model_args",
            f"model={MODEL},base_url={url}/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True",
            "--tasks",
            "tokenmill_capitals",
            "--include_path",
            str(work),
            "--output_path",
            str(work / "out"),
            "--log_samples",
            "--batch_size",
            "4",
        ]
        t0 = time.perf_counter()
        run = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        )
        seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    if run.returncode != 0:
        sys.exit(f"lm_eval failed ({run.returncode}):\n{run.stderr[-4000:]}")
    table = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if line.startswith("|"))
    sample_file = next((work / "out").rglob("samples_tokenmill_capitals_*.jsonl"))
    samples = [json.loads(line) for line in sample_file.read_text().splitlines()]
    theirs = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    ours = offline_loglikelihoods(samples)
    diff = max(abs(a - b) for x, y in zip(theirs, ours, strict=True) for a, b in zip(x, y, strict=True))
    results = json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"]["tokenmill_capitals"]
    report = {
        "command": " ".join(cmd[:1] + ["..."] + cmd[3:]),
        "lm_eval_seconds": round(seconds, 1),
        "items": len(samples),
        "loglikelihoods": sum(len(x) for x in theirs),
        "max_abs_diff_vs_offline_prompt_logprobs": diff,
        "results": results,
        "table": table,
        "per_item": [
            {"doc": s["doc"]["country"], "lm_eval": t, "offline": o}
            for s, t, o in zip(samples, theirs, ours, strict=True)
        ],
    }
    (HERE / "results" / "lm_eval.json").write_text(json.dumps(report, indent=1))
    print(table)
    print(f"{report['loglikelihoods']} loglikelihoods; max |lm-eval - offline| = {diff:.2e}")
    sys.exit(0 if diff < 1e-3 else 1)


if __name__ == "__main__":
    main()
