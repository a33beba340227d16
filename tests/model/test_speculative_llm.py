"""Speculative decoding on the real model, through the LLM API."""

from __future__ import annotations

import pytest

from tests.helpers import make_tiny_llama
from tokenmill import LLM, SamplingParams
from tokenmill.errors import TokenmillError

PASSAGE = (
    "The old mill stood at the bend of the river, where the water ran fast over a shelf of stone. "
    "For a hundred years it ground the valley's wheat, and the miller's family lived above the wheel."
)
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n{PASSAGE}"}],
    [{"role": "user", "content": f"Extract the first sentence of this text:\n{PASSAGE}"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "List three facts about Paris."}],
]


@pytest.fixture(scope="module")
def reference(llm):
    params = SamplingParams(temperature=0, max_tokens=48)
    return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, params)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"speculative": "ngram"},
        {"speculative": "self", "draft_layers": 10, "num_speculative_tokens": 2},
        {"speculative": "draft", "kv_cache_memory": "24MiB"},  # both models' K/V share the budget
    ],
    ids=["ngram", "self", "draft"],
)
def test_greedy_output_is_token_identical(llm, reference, kwargs):
    if kwargs["speculative"] == "draft":  # the model itself as its draft: every token is accepted
        kwargs = {**kwargs, "draft_model": str(llm.model_path)}
    kwargs = {"kv_cache_memory": "12MiB", **kwargs}
    spec = LLM(dtype="float32", progress=False, spec_disable_batch_size=8, **kwargs)
    outs = spec.chat(CONVERSATIONS, SamplingParams(temperature=0, max_tokens=48))
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = spec.spec_decode_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if kwargs["speculative"] == "draft":
        assert stats.acceptance_rate == 1.0
    assert spec.engine.core.scheduler.num_preemptions > 0  # the cache cannot hold all four at once
    pool = spec.engine.core.block_pool
    assert pool.num_free == pool.num_blocks


def test_prompt_lookup_accepts_most_drafts_when_copying(llm):
    spec = LLM(dtype="float32", progress=False, kv_cache_memory="64MiB", speculative="ngram")
    out = spec.chat(CONVERSATIONS[0], SamplingParams(temperature=0, max_tokens=40))[0]
    assert PASSAGE[:40] in out.outputs[0].text
    assert spec.spec_decode_stats.acceptance_rate > 0.6
    assert spec.spec_decode_stats.mean_accepted_length > 3


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    make_tiny_llama(tmp_path)  # vocabulary of 512
    with pytest.raises(TokenmillError, match="vocabulary of 512 tokens but the target's has 49152"):
        LLM(progress=False, kv_cache_memory="16MiB", speculative="draft", draft_model=str(tmp_path))


def test_speculative_options_are_checked_before_any_weights_load(tmp_path):
    """Against the checkpoints' headers only: with the weights gone, the error is still
    the option's, not the missing weights' (nothing was loaded to find it out)."""
    make_tiny_llama(tmp_path)  # 3 layers, a vocabulary of 512
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(TokenmillError, match="draft_layers=5 must be below the model's 3 layers"):
        LLM(str(tmp_path), progress=False, kv_cache_memory="16MiB", speculative="self", draft_layers=5)
    with pytest.raises(TokenmillError, match="vocabulary of 512 tokens but the target's has 49152"):
        LLM(progress=False, kv_cache_memory="16MiB", speculative="draft", draft_model=str(tmp_path))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"speculative": "lookahead"}, "speculative method must be one of ngram, draft, self, eagle, medusa"),
        ({"speculative": "draft"}, "needs a draft model"),
        ({"speculative": "medusa"}, "'medusa' needs a draft model"),
        ({"speculative": "eagle", "spec_tree_width": 0}, "spec_tree_width must be >= 1"),
        ({"speculative": "ngram", "spec_tree_width": 2}, "needs speculative 'eagle' or 'medusa'"),
        ({"speculative": "eagle", "draft_confidence": 1.0}, r"draft_confidence must be in \[0, 1\)"),
        ({"speculative": "self"}, "needs draft_layers >= 1"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"speculative": "self", "draft_layers": 30}, "draft_layers=30 must be below the model's 30 layers"),
    ],
)
def test_bad_speculative_settings_are_clear_errors(kwargs, message):
    with pytest.raises(TokenmillError, match=message):
        LLM(progress=False, kv_cache_memory="16MiB", **kwargs)


def test_an_eagle_head_is_needed_for_a_model_without_a_bundled_one(tmp_path):
    make_tiny_llama(tmp_path)
    with pytest.raises(TokenmillError, match="only the default model has a bundled EAGLE head"):
        LLM(str(tmp_path), progress=False, kv_cache_memory="16MiB", speculative="eagle")
    (tmp_path / "head.bin").write_bytes(b"")
    with pytest.raises(TokenmillError, match="is not a folder"):
        LLM(progress=False, kv_cache_memory="16MiB", speculative="eagle", draft_model=str(tmp_path / "head.bin"))


HELD_OUT = [
    [{"role": "user", "content": "How do airplanes stay up in the air?"}],
    [{"role": "user", "content": "Suggest a simple dinner I can cook with rice, eggs and spinach."}],
]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_default_model_speculates_with_its_bundled_eagle_head(llm, float_llm, tree):
    """No --draft-model: the head train-draft made for SmolLM2 ships with the package; on
    chats it was not trained on, greedy output is unchanged and many drafts are accepted.
    (A token tree is verified with masked attention, whose rounding the int8 arithmetic's
    would turn into other tokens: trees are greedy-identical under the float arithmetic.)"""
    extra = {"spec_tree_width": 2, "num_speculative_tokens": 6, "quant_arithmetic": "float"} if tree else {}
    llm = float_llm if tree else llm
    spec = LLM(
        dtype="float32", progress=False, speculative="eagle", kv_cache_memory="64MiB", spec_auto_pause=False, **extra
    )
    params = SamplingParams(temperature=0, max_tokens=64)
    expected = [o.outputs[0].token_ids for o in llm.chat(HELD_OUT, params)]
    assert [o.outputs[0].token_ids for o in spec.chat(HELD_OUT, params)] == expected
    stats = spec.spec_decode_stats
    assert stats.num_drafts > 10 and stats.mean_accepted_length > 1.5
