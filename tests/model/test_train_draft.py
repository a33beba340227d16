"""``tokenmill train-draft`` on the real model, at toy sizes: it writes a head in the
published layout that the engine loads and speculates with losslessly, a plot, and a
state it resumes from (the data is not generated again, training continues)."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli import main

CHATS = [[{"role": "user", "content": "Tell me about the moon."}], [{"role": "user", "content": "Name three fruits."}]]


def train(out, method, epochs, *extra):
    argv = [
        "train-draft",
        "--method",
        method,
        "--output",
        str(out),
        "--num-prompts",
        "6",
        "--max-tokens",
        "24",
        "--epochs",
        str(epochs),
        "--batch-size",
        "3",
        "--eval-every",
        "1",
        *extra,
    ]
    assert main(argv) == 0


def greedy(llm):
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=24))]


@pytest.fixture(scope="module")
def plain(llm):
    return greedy(llm)


def test_an_eagle_head_is_trained_saved_resumed_and_served(tmp_path, plain, capsys):
    train(tmp_path, "eagle", 1, "--draft-vocab-size", "512")
    head = tmp_path / "head"
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["draft_vocab_size"] == 512
    assert (head / "model.safetensors").exists() and (tmp_path / "training.png").exists()
    assert "use it: tokenmill chat --speculative eagle" in capsys.readouterr().out
    first = json.loads((head / "history.json").read_text())
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "data").glob("shard_*.pt")}
    assert shards and first["step"][-1] == 2 and len(first["eval"]) == 2

    train(tmp_path, "eagle", 2, "--draft-vocab-size", "512")  # resumes: same data, steps 3 and 4 only
    again = json.loads((head / "history.json").read_text())
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "data").glob("shard_*.pt")} == shards
    assert again["step"] == [1, 2, 3, 4] and again["loss"][:2] == first["loss"]

    spec = LLM(
        dtype="float32",
        progress=False,
        speculative="eagle",
        draft_model=str(head),
        kv_cache_memory="64MiB",
        spec_auto_pause=False,
        draft_confidence=0.0,
    )
    assert greedy(spec) == plain
    assert spec.spec_decode_stats.num_drafts > 0


def test_a_medusa_head_is_trained_and_served(tmp_path, float_llm):
    """(Medusa verifies a token tree, with masked attention: greedy-identical under the float
    arithmetic; under int8 the tree's rounding differs from plain decoding's, see README.)"""
    train(tmp_path, "medusa", 1, "--medusa-heads", "2")
    head = tmp_path / "head"
    assert json.loads((head / "config.json").read_text())["medusa_num_heads"] == 2
    spec = LLM(
        dtype="float32",
        quant_arithmetic="float",
        progress=False,
        speculative="medusa",
        draft_model=str(head),
        kv_cache_memory="64MiB",
        num_speculative_tokens=2,
        spec_tree_width=2,
        spec_auto_pause=False,
        draft_confidence=0.0,
    )
    assert greedy(spec) == greedy(float_llm)
    assert spec.spec_decode_stats.num_drafts > 0


def test_bad_train_draft_options_are_clear_errors(tmp_path, capsys):
    """Refused as the flags are parsed (exit 2, one line), before any model loads."""
    for flags, said in (
        (["--epochs", "0"], "argument --epochs: must be > 0, got 0"),
        (["--prompts", str(tmp_path / "none.txt")], "argument --prompts: no such file: "),
    ):
        with pytest.raises(SystemExit) as e:
            main(["train-draft", "--output", str(tmp_path), *flags])
        assert e.value.code == 2 and said in capsys.readouterr().err
