"""Structured output on the real model: outputs match their schema, regex, choice or
grammar every time, and constraints change nothing else (greedy identity, free
neighbours, speculation, prefix caching, preemption, n > 1, stop strings)."""

from __future__ import annotations

import ast
import json
import re

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "large", "small"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ids": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["tags", "ids"],
        "additionalProperties": False,
    },
    "enums_and_bounds": {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "pending"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 100},
            "ratio": {"type": "number", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["status", "count", "ratio", "ok"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "horror"]},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "nested": "Give a person's name and address as JSON.",
    "array": "Tag this product and list some ids, as JSON.",
    "enums_and_bounds": "Report the job status as JSON.",
    "patterns": "Give a date and a product code as JSON.",
    "optional_fields": "Describe a film as JSON.",
}


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]), False)


@pytest.mark.slow
def test_120_sampled_requests_all_validate(llm):
    prompts, params, schemas = [], [], []
    for i in range(120):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        prompts.append(chat(llm, PROMPTS[name]))
        params.append(
            SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured=StructuredOutputs(json=SCHEMAS[name]))
        )
        schemas.append(SCHEMAS[name])
    outs = llm.generate(prompts, params)
    for out, schema in zip(outs, schemas, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({o.outputs[0].text for o in outs}) > 90  # sampled, not one answer repeated


def test_regex_choice_and_an_arithmetic_grammar(llm):
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    outs = llm.generate(
        ["Call me at"] * 8,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured={"regex": regex}) for s in range(8)],
    )
    assert all(re.fullmatch(regex, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in outs)
    choices = ["positive", "negative", "neutral"]
    outs = llm.generate(
        ["Sentiment of 'I love it':"] * 8,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured={"choice": choices}) for s in range(8)],
    )
    assert all(o.outputs[0].text in choices for o in outs)
    grammar = """
root   ::= expr
expr   ::= term (ws [-+] ws term){0,2}
term   ::= factor (ws [*/] ws factor)?
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]?
ws     ::= " "?
"""
    outs = llm.generate(
        ["An arithmetic expression:"] * 12,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured={"grammar": grammar}) for s in range(12)],
    )
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 8
    for text in stopped:
        tree = ast.parse(text, mode="eval")  # the language is a subset of Python's expressions
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def test_greedy_output_unchanged_where_the_grammar_allows_it(llm):
    prompt = chat(llm, "Write one sentence about the sea.")
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    loose = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, structured={"regex": r"[^\x00]*"}))[0]
    assert loose.outputs[0].token_ids == free.token_ids


def test_free_requests_in_a_mixed_batch_are_unchanged(llm):
    free_prompts = [chat(llm, "List three fruits."), chat(llm, "What is 2 + 2?")]
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, SamplingParams(temperature=0, max_tokens=32))]
    constrained = SamplingParams(temperature=0, max_tokens=60, structured={"json": SCHEMAS["nested"]})
    mixed = llm.generate(
        [free_prompts[0], chat(llm, PROMPTS["nested"]), free_prompts[1]],
        [SamplingParams(temperature=0, max_tokens=32), constrained, SamplingParams(temperature=0, max_tokens=32)],
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["nested"])


def test_logprobs_see_the_masked_distribution(llm):
    prompt = "Is water wet? Answer:"
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured={"choice": [" yes", " no"]})
    c = llm.generate(prompt, params)[0].outputs[0]
    assert c.text in (" yes", " no")
    first = dict(c.top_logprobs[0])  # every alternative starts one of the choices
    assert first and all(any(ch.startswith(llm.tokenizer.decode([t])) for ch in (" yes", " no")) for t in first)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
    raw = dict(free.top_logprobs[0])
    assert set(raw) - set(first)  # the unconstrained distribution has tokens the grammar refuses
    shared = set(first) & set(raw)
    assert shared and all(first[t] > raw[t] for t in shared)  # renormalised over what is allowed


RECORD = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "born", "fields"],
    "additionalProperties": False,
}


def test_prompt_lookup_speculation_gives_the_same_constrained_output(llm):
    prompt = chat(llm, f"Copy this JSON record exactly:\n{RECORD}")
    params = SamplingParams(temperature=0, max_tokens=60, structured={"json": RECORD_SCHEMA})
    plain = llm.generate(prompt, params)[0].outputs[0]
    spec = LLM(dtype="float32", progress=False, kv_cache_memory="64MiB", speculative="ngram")
    out = spec.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    jsonschema.validate(json.loads(out.text), RECORD_SCHEMA)
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    sampled = spec.generate(
        [prompt] * 6,
        [
            SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured={"json": SCHEMAS["nested"]})
            for s in range(6)
        ],
    )
    for o in sampled:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])
    assert spec.engine.core.block_pool.num_free == spec.engine.core.block_pool.num_blocks


def test_prefix_cache_hits_preemption_n_and_stop_strings(llm):
    prompt = chat(llm, PROMPTS["optional_fields"])
    params = SamplingParams(temperature=0, max_tokens=60, structured={"json": SCHEMAS["optional_fields"]})
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # preemption: a cache too small for all of them at once recomputes some; matchers carry on
    prompts = [chat(llm, PROMPTS[name]) for name in SCHEMAS] * 2
    many = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured={"json": SCHEMAS[name]})
        for i, name in enumerate(list(SCHEMAS) * 2)
    ]
    small = LLM(dtype="float32", progress=False, kv_cache_memory="9MiB", max_num_seqs=10)  # 12 blocks
    tight = small.generate(prompts, many)
    assert small.engine.core.scheduler.num_preemptions > 0
    roomy = llm.generate(prompts, many)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    # n > 1: each sequence has its own matcher
    out = llm.generate(
        prompt,
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=80, structured={"json": SCHEMAS["optional_fields"]}),
    )[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["optional_fields"])
    assert len({c.text for c in out.outputs}) > 1
    # a stop string still ends a constrained output
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=60, stop=['", '], structured={"json": SCHEMAS["optional_fields"]}),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '", ' and out.text.startswith('{"title": "')


@pytest.mark.parametrize(
    ("structured", "needle"),
    [
        ({"json": {"type": "strnig"}}, "strnig"),
        ({"json": {"type": "object", "not": {"required": ["a"]}}}, "not"),
        ({"grammar": "root ::= (  "}, "grammar"),
        ({"regex": "[z-a]"}, "regex"),
        ({"regex": "a[^\\x00-\\x{10FFFF}]"}, "matches no text"),
        ({"json": {"type": "object"}, "choice": ["a"]}, "exactly one"),
    ],
)
def test_bad_constraints_are_refused_and_the_engine_lives(llm, structured, needle):
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        llm.generate("x", SamplingParams(max_tokens=4, structured=structured))
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_compiled_grammars_are_cached_by_content(llm):
    compiler = llm.engine.core.structured.compiler
    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}}
    first = compiler.compile(StructuredOutputs(json=schema))
    hits = compiler.stats.hits
    assert compiler.compile(StructuredOutputs(json=json.dumps(schema))) is first  # text or dict: same content
    assert compiler.stats.hits == hits + 1


@pytest.mark.slow
def test_sampling_under_a_grammar_is_distribution_identical_with_speculation(llm):
    """Self-speculation drafts from an unmasked q; the target's p is masked: verification
    must still sample each position from the masked p."""
    scipy_stats = pytest.importorskip("scipy.stats")
    prompt = chat(llm, "Type six random letters from a to e, separated by commas.")
    n, regex = 200, "[a-e](, [a-e]){5}"  # the separators are what the draft gets right (200: CI's time budget)

    def fourth_letters(engine: LLM) -> list[int]:
        outs = engine.generate(
            [prompt] * n,
            [
                SamplingParams(temperature=1.0, seed=10_000 + i, max_tokens=24, structured={"regex": regex})
                for i in range(n)
            ],
        )
        texts = [o.outputs[0].text for o in outs]
        assert all(re.fullmatch(regex, t) for t in texts), [t for t in texts if not re.fullmatch(regex, t)]
        return [sum(t.split(", ")[3] == c for t in texts) for c in "abcde"]

    spec = LLM(
        dtype="float32",
        progress=False,
        speculative="self",
        draft_layers=10,
        num_speculative_tokens=3,
        spec_disable_batch_size=1000,
        max_num_seqs=64,
    )
    with_spec = fourth_letters(spec)
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    plain = fourth_letters(llm)
    table = [[a, b] for a, b in zip(plain, with_spec, strict=True) if a + b > 0]
    assert scipy_stats.chi2_contingency(table).pvalue > 1e-3, (plain, with_spec)


@pytest.mark.parametrize(
    "structured,needle",
    [
        ({"grammar": 'root ::= "a" root'}, "cannot be enforced"),
        ({"regex": "a{1000000}"}, "cannot be enforced"),
        (
            {"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}}},
            "cannot be enforced",
        ),
        ({"choice": [f"option {i}" for i in range(30000)]}, "--max-grammar-bytes"),
    ],
    ids=["right-recursive", "huge-repeat", "700-optional-properties", "30k-choices"],
)
def test_a_grammar_past_the_matchers_limits_is_refused_before_any_token(llm, structured, needle):
    """Issue 24 item 1: a grammar the matcher would give up on mid-output (an Earley row
    or a lexer that explodes) is refused when it is compiled, naming the reason in a
    short message, instead of a cut-off answer; and the engine goes on."""
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["Say a:"], SamplingParams(max_tokens=8, temperature=0, structured=structured))
    assert needle in str(e.value) and len(str(e.value)) < 400
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"
