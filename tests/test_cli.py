"""The console script, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_the_greedy_answer():
    r = run("chat", "What is the capital of France?", "--max-tokens", "20")
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
    r = run("generate", "a b c d e f a b c d e f a b c d e f a b", "--max-tokens", "12", "--speculative", "ngram",
            "--ignore-eos")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "drafts accepted" in r.stderr
