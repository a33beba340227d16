"""Model routers' decisions, from given request features and given token logprobs."""

from __future__ import annotations

import math

import pytest

from tokenmill.errors import TokenmillError
from tokenmill.server.gateway.model_router import ModelRouter, confidence, parse_routers

ROUTER = ModelRouter("auto", "small", "large", threshold=0.5, max_prompt_tokens=100)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_confidence_is_the_geometric_mean_of_the_token_probabilities():
    assert confidence([math.log(0.5), math.log(0.5)]) == pytest.approx(0.5)
    assert confidence([math.log(0.9), math.log(0.1)]) == pytest.approx(0.3)
    assert confidence([None, math.log(0.8)]) == pytest.approx(0.8)  # unknown logprobs are left out
    assert confidence([]) == 0.0  # an empty answer is not trusted


def test_the_cascade_keeps_the_small_answer_at_or_above_the_threshold():
    assert ROUTER.judge([[math.log(0.5)] * 3]).model == "small"
    route = ROUTER.judge([[math.log(0.49)] * 3])
    assert (route.model, route.reason) == ("large", "low_confidence") and route.confidence == pytest.approx(0.49)
    # several choices: the least confident decides
    assert ROUTER.judge([[math.log(0.9)], [math.log(0.2)]]).model == "large"


@pytest.mark.parametrize(
    "body,prompt_tokens,expected",
    [
        ({"messages": []}, 10, None),
        ({"tools": [TOOL]}, 10, ("large", "tools")),
        ({"tools": [TOOL], "tool_choice": "none"}, 10, None),  # tools offered but not to be called
        ({"response_format": {"type": "json_object"}}, 10, ("large", "response_format")),
        ({"response_format": {"type": "text"}}, 10, None),
        ({"guided_regex": "a+"}, 10, ("large", "response_format")),
        ({"logprobs": True}, 10, None),  # not a rule unless asked for
        ({}, 101, ("large", "long_prompt")),
        ({}, 100, None),
    ],
)
def test_rules_decide_from_the_request_features(body, prompt_tokens, expected):
    route = ROUTER.pre_route(body, prompt_tokens)
    assert (route.model, route.reason) == expected if expected else route is None


def test_a_classifier_decides_first_and_may_abstain():
    router = ModelRouter("auto", "small", "large", classifier=lambda b: b.get("hint"))
    assert router.pre_route({"hint": "small", "tools": [TOOL]}, 5).model == "small"
    assert router.pre_route({"hint": None, "tools": [TOOL]}, 5).reason == "tools"
    with pytest.raises(TokenmillError, match="classifier returned 'medium'"):
        router.pre_route({"hint": "medium"}, 5)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("auto=small", "NAME=SMALL,LARGE"),
        ("auto=small,nope", "not a served model"),
        ("small=small,large", "already taken"),
        ("auto=small,small", "the same"),
    ],
)
def test_bad_routers_are_refused_with_the_reason(spec, words):
    with pytest.raises(TokenmillError, match=words):
        parse_routers([spec], ["small", "large"], 0.5, None, ["tools"], None)
    with pytest.raises(TokenmillError, match="MODULE:FUNCTION"):
        parse_routers(["auto=small,large"], ["small", "large"], 0.5, None, [], "nocolon")
