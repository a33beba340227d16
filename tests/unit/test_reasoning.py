"""Reasoning parsers (server/jobs/reasoning.py): a reasoning model's answer split into reasoning
and content as vLLM's qwen3 and deepseek_r1 parsers split it, streamed deltas that join to
the whole answer's fields wherever the deltas are cut, and a constraint that starts after
the reasoning (checked with llguidance on a Qwen3-like vocabulary, token by token)."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.helpers import write_qwen3_tokenizer
from tokenmill.engine.pipe.wire import from_plain, pack, to_plain, unpack
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.jobs.reasoning import END, Reasoning, ReasoningSplitter
from tokenmill.structured.constraint import StructuredOutputs

QWEN3 = Reasoning("qwen3", thinking=True, end_token_id=7)
QWEN3_OFF = Reasoning("qwen3", thinking=False, end_token_id=7)
R1 = Reasoning("deepseek_r1", thinking=True, end_token_id=7)

ANSWERS = [
    "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.",
    "Let me see.</think>It is 4.",  # (the prompt opened <think>: DeepSeek-R1's template)
    "<think>\nStill thinking when cut sho",
    "<think>x</think>",
    "<think></think>Hi",
    "<think>a</think>b<think>c</think>d",  # later markers are content
    "</think>",
    "<thi",  # cut inside the opening marker
    "Hi </think",  # cut inside the closing one
    "",
    "a < b, </ think >, <think, </thinker> and <think in reasoning</think> ok <",
    '<think>\n{"a": 1} is the plan\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
]


def vllm_split(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """vLLM's extract_reasoning (qwen3's, and deepseek_r1's when thinking), for answers
    whose <think>, if any, opens them: the first <think> dropped; no </think> and all of it is
    reasoning (thinking) or content (Qwen3 with thinking off); else split at it."""
    if not thinking:
        return None, text
    parts = text.partition("<think>")
    text = parts[2] if parts[1] else parts[0]
    if "</think>" not in text:
        return text, None
    reasoning, _, content = text.partition("</think>")
    return reasoning, content or None


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("reasoning", [QWEN3, QWEN3_OFF, R1], ids=["qwen3", "qwen3-off", "deepseek_r1"])
def test_whole_answers_split_as_vllm_splits_them(reasoning, text):
    assert reasoning.split(text) == vllm_split(text, reasoning.thinking)


def test_the_common_shapes():
    assert QWEN3.split(ANSWERS[0]) == ("\nLet me see: 2 + 2.\n", "\n\nIt is 4.")
    assert R1.split(ANSWERS[1]) == ("Let me see.", "It is 4.")
    assert QWEN3.split(ANSWERS[2]) == ("\nStill thinking when cut sho", None)  # cut: reasoning, no content
    assert QWEN3_OFF.split("It is 4.") == (None, "It is 4.")  # thinking off: content, no reasoning


def test_a_late_think_is_text():
    """Where this differs from vLLM, which drops everything before the first <think>
    wherever it is: only a <think> that opens the answer is a marker."""
    assert QWEN3.split("So: <think>x</think>y") == ("So: <think>x", "y")
    assert vllm_split("So: <think>x</think>y", True) == ("x", "y")


def test_random_answers_split_as_vllm_splits_them():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "</", "<th", "ink>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        if "<think>" in text[1:] and not text.startswith("<think>"):  # (vLLM drops what comes before a late one)
            continue
        for reasoning in (QWEN3, QWEN3_OFF, R1):
            assert reasoning.split(text) == vllm_split(text, reasoning.thinking), text


def _streamed(reasoning: Reasoning, deltas: list[str]) -> tuple[str, str]:
    splitter = reasoning.splitter()
    parts = [splitter.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("reasoning", [QWEN3, QWEN3_OFF, R1], ids=["qwen3", "qwen3-off", "deepseek_r1"])
def test_streamed_deltas_join_to_the_whole_answer_wherever_they_are_cut(reasoning, text):
    """Every way of cutting the answer into two or three deltas (empty ones too: markers
    split at every character), and one character at a time."""
    whole = tuple(x or "" for x in reasoning.split(text))
    cuts = range(len(text) + 1)
    for i, j in itertools.combinations_with_replacement(cuts, 2):
        assert _streamed(reasoning, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert _streamed(reasoning, list(text) or [""]) == whole


def test_a_marker_split_across_deltas_is_never_sent_as_text():
    splitter = ReasoningSplitter(thinking=True)
    sent = [splitter.feed(d) for d in ["<th", "ink>", "Hm.", "</th", "ink", ">", "Hi"]]
    assert sent == [("", ""), ("", ""), ("Hm.", ""), ("", ""), ("", ""), ("", ""), ("", "Hi")]
    splitter = ReasoningSplitter(thinking=True)
    assert [splitter.feed(d) for d in ["So </", "b> or </th"]] == [("So ", ""), ("</b> or ", "")]
    assert splitter.feed("e end", finished=True) == ("</the end", "")  # not the marker after all


def test_reasoning_tokens_count_up_to_the_end_marker():
    assert QWEN3.reasoning_tokens([5, 1, 2, 7, 3, 4]) == 4  # </think> (id 7) included
    assert QWEN3.reasoning_tokens([5, 1, 2]) == 3  # cut: all of it
    assert QWEN3_OFF.reasoning_tokens([5, 7, 3]) == 0


def test_a_constraint_starts_after_the_reasoning():
    json_object = SamplingParams(structured=StructuredOutputs(json_object=True))
    assert QWEN3.constrain(json_object).structured == StructuredOutputs(json_object=True, reasoning_end=END)
    assert QWEN3_OFF.constrain(json_object) == json_object  # the prompt has closed the reasoning
    assert QWEN3.constrain(SamplingParams()) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="unknown structured_outputs field"):  # a client cannot set it
        StructuredOutputs.from_dict({"json_object": True, "reasoning_end": END})
    sent = QWEN3.constrain(SamplingParams(structured=StructuredOutputs(choice=("a", "b"))))
    assert from_plain(SamplingParams, unpack(pack([to_plain(sent)]))[0]) == sent  # to the engine-core process


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    pytest.importorskip("llguidance")
    from tokenmill.structured.grammar import GrammarCompiler

    tokenizer = write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize(
    "spec,answer",
    [
        (StructuredOutputs(json=SCHEMA), '{"a": 12}'),
        (StructuredOutputs(json_object=True), '{"b": [1, 2]}'),
        (StructuredOutputs(regex=r"\d{3}"), "123"),
        (StructuredOutputs(choice=("yes", "no")), "no"),
        (StructuredOutputs(grammar='start: "x" NUMBER\nNUMBER: /[0-9]+/'), "x42"),
    ],
    ids=lambda v: v.kind if isinstance(v, StructuredOutputs) else None,
)
def test_the_grammar_leaves_the_thinking_free_and_constrains_what_follows(qwen3, spec, answer):
    tokenizer, compiler = qwen3
    after = compiler.compile(StructuredOutputs(**{**spec.__dict__, "reasoning_end": END}))
    thinking = (
        "<think>\nThe user wants <tool_call> and {not json\n</think>"  # anything (special tokens too) but </think>
    )
    m = after.matcher()
    assert m.accept(tokenizer.encode(thinking + answer, add_special_tokens=False))
    assert m.is_accepting and m.error is None
    m = after.matcher()  # the constraint holds after the reasoning
    assert m.accept(tokenizer.encode(thinking, add_special_tokens=False))
    assert not m.accept(tokenizer.encode("oops", add_special_tokens=False))
    m = after.matcher()  # DeepSeek-R1's: the prompt opened the reasoning
    assert m.accept(tokenizer.encode("Plan: x.</think>" + answer, add_special_tokens=False)) and m.is_accepting
    plain = compiler.compile(spec).matcher()  # without reasoning_end the thinking is refused
    assert not plain.accept(tokenizer.encode(thinking, add_special_tokens=False))


def test_a_grammar_past_the_limits_is_refused_after_reasoning_too(qwen3):
    _, compiler = qwen3
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}}
    with pytest.raises(InvalidRequestError, match="cannot be enforced"):
        compiler.compile(StructuredOutputs(json=many))
    with pytest.raises(InvalidRequestError, match="cannot be enforced"):
        compiler.compile(StructuredOutputs(json=many, reasoning_end=END))
    with pytest.raises(InvalidRequestError, match="not a token of this vocabulary"):
        compiler.compile(StructuredOutputs(json_object=True, reasoning_end="<nope>"))
