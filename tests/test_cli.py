"""The console script, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_the_greedy_answer():
    r = run("chat", "What is the capital of France? Answer in one sentence.", "--max-tokens", "20")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "finish: stop" in r.stderr


def test_bad_model_path_is_a_clear_error():
    r = run("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert r.returncode == 2
    assert "model path does not exist: /nonexistent/model.gguf" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_sampling_value_is_a_clear_error():
    r = run("generate", "hi", "--top-p", "1.5")
    assert r.returncode == 2 and "invalid top_p=1.5" in r.stderr


def test_generate_with_prompt_lookup_reports_acceptance():
    r = run(
        "generate",
        "a b c d e f a b c d e f a b c d e f a b",
        "--max-tokens",
        "12",
        "--speculative",
        "ngram",
        "--ignore-eos",
    )
    assert r.returncode == 0, r.stderr
    assert "drafts accepted" in r.stderr


def test_every_engine_option_is_a_flag_a_keyword_and_documented():
    """Options are declared once (tokenmill.configuration.config); the flags, the LLM keywords and the
    README's table must all follow from that one declaration."""
    from pathlib import Path

    from tokenmill.configuration.args import engine_args, engine_keywords
    from tokenmill.entrypoints.cli import build_parser

    keywords = engine_keywords()
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    negatives = {"enable_prefix_caching": "no-prefix-caching", "spec_auto_pause": "no-spec-auto-pause"}
    for kw in keywords:
        assert "--" + (negatives.get(kw) or kw.replace("_", "-")) in help_text, (
            kw
        )  # on by default: the flag turns it off
        assert f"| `{kw}` |" in readme, f"README's option table misses {kw}"
    args = engine_args(max_num_seqs=3, speculative="ngram", spec_disable_batch_size=2, kv_cache_dtype="int8")
    assert args.scheduler.max_num_seqs == 3 and args.cache.kv_cache_dtype == "int8"
    assert args.speculative is not None and args.speculative.disable_batch_size == 2


def test_an_unknown_option_or_a_bad_value_names_the_problem():
    import pytest

    from tokenmill.configuration.args import engine_args
    from tokenmill.errors import TokenmillError

    with pytest.raises(TypeError, match="max_num_seq"):
        engine_args(max_num_seq=3)
    with pytest.raises(TokenmillError, match="scheduling must be"):
        engine_args(scheduling="fifo")
    r = run("generate", "hi", "--max-num-batched-tokens", "0")
    assert r.returncode == 2 and "max_num_batched_tokens must be >= 1" in r.stderr


def test_plan_sizes_the_kv_cache_as_the_engine_does():
    """fp32 SmolLM2: 2 x 30 layers x 3 KV heads x 64 x 4 B = 46,080 B a token; 64 MiB
    buys 91 blocks of 16, two sequences of 512 tokens (32 blocks each)."""
    r = run(
        "plan",
        *("--dtype", "float32", "--kv-cache-memory", "64MiB", "--context-len", "512", "--bandwidth", "20"),
        *("--price-per-hour", "2", "--watts-per-cpu", "5"),
    )
    assert r.returncode == 0, r.stderr
    assert "46,080 B" in r.stdout and "= 91 blocks of 16" in r.stdout
    assert "CPU: " in r.stdout and "native bfloat16: " in r.stdout  # every plan records the machine
    assert [ln.split()[-1] for ln in r.stdout.splitlines() if "max sequences of 512 tokens" in ln] == ["2"]
    # energy and cost follow from the decode bound: threads x 5 W per token-rate, $2 an hour over 3600 x rate
    row = {ln[:47].strip(): ln[47:].strip() for ln in r.stdout.splitlines() if ln.startswith("  ")}
    bound = float(row["decode bound, 1 sequence at 512 tokens"].split()[0])
    joules, watts = row["energy per token at the bound, 1 sequence"].split(" J (estimated, ")
    assert float(joules) == pytest.approx(float(watts.removesuffix(" W)")) / bound, abs=1e-3)
    assert float(watts.removesuffix(" W)")) % 5 == 0
    dollars = float(row["$ per 1M tokens at the bound, 1 sequence"].removeprefix("$"))
    assert dollars == pytest.approx(2 / 3600 / bound * 1e6, abs=0.01)


def test_plan_of_several_models_splits_the_kv_budget_as_serve_does():
    """128 MiB shared by the one model that sets none (a: 182 blocks of float32 KV), b its
    own 32 MiB (45 blocks); then what both need together."""
    r = run(
        "plan",
        "--model",
        "a=default",
        "--model",
        "b=default,kv_cache_memory=32MiB",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "128MiB",
        "--context-len",
        "512",
        "--bandwidth",
        "20",
    )
    assert r.returncode == 0, r.stderr
    assert "model a:" in r.stdout and "model b:" in r.stdout
    assert "= 182 blocks of 16" in r.stdout and "= 45 blocks of 16" in r.stdout
    assert "all 2 models: weights + KV" in r.stdout and "fits" in r.stdout
    r = run("serve", "--model", "a=default", "--model", "/x.gguf")
    assert r.returncode == 2 and "NAME=PATH" in r.stderr
    r = run("serve", "--model", "a=default", "--model", "b=default", "--router", "auto=a,c")
    assert r.returncode == 2 and "'c' is not a served model" in r.stderr
    r = run("serve", "--model", "a=default,kv_cache_memory=100000GiB", "--model", "b=default")  # checked before loading
    assert r.returncode == 2 and "GiB is free" in r.stderr and "a: weights" in r.stderr


def test_generate_held_to_a_json_schema_or_a_regex(tmp_path):
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    r = run(
        "chat",
        "Name a city as JSON.",
        "--json-schema",
        f"@{tmp_path / 'schema.json'}",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "--max-tokens",
        "40",
    )
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout.strip().splitlines()[-1])) == {"city"} and "finish: stop" in r.stderr
    r = run("generate", "Answer:", "--choice", "yes", "--choice", "no", "--max-tokens", "4")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr
    r = run("generate", "x", "--regex", "(unclosed")
    assert r.returncode == 2 and "invalid structured output regex" in r.stderr and "Traceback" not in r.stderr


def test_the_bad_flags_of_issue_57_are_one_line_and_exit_2(tmp_path):
    """The real process: no traceback, the flag named, exit 2, before anything loads or
    starts. (The model path and the tune settings around each bad value would keep the
    commands short, and start no server, were the value let through.)"""
    nothing = ("--model", str(tmp_path / "none.gguf"))
    tune = ("tune", "--slo", "ttft_p99=2s", "--price-per-hour", "1", "--time-budget", "0.05")
    tune += ("--serve-args=--no-such-flag", "--output-dir", str(tmp_path))
    for argv, flag in [
        (("plan", *nothing, "--context-len", "0"), "--context-len"),
        (("serve", *nothing, "--port", "99999"), "--port"),
        ((*tune, "--workload", "/nonexistent.jsonl"), "--workload"),
        ((*tune, "--price-per-hour", "-1"), "--price-per-hour"),
        ((*tune, "--validate-seconds=-1"), "--validate-seconds"),
        (("serve", *nothing, "--max-request-bytes", "-5"), "--max-request-bytes"),
        ((*tune, "--time-budget", "0"), "--time-budget"),
    ]:
        r = run(*argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.startswith(f"tokenmill {argv[0]}: error: argument {flag}: "), r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
