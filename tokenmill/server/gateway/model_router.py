"""Model routing: a virtual model that sends each request to the small or the large of
two served models (``--router NAME=SMALL,LARGE``).

Rules decide first, before anything runs: a user's classifier (``--router-classifier
MODULE:FUNCTION``), then the request's features (``--router-large-for``: tools, a
constrained response_format, logprobs) and its prompt's length
(``--router-max-prompt-tokens``). Where no rule decides, the router **cascades**
(FrugalGPT's idea): the small model answers, and its answer is kept when its own
confidence, the geometric mean of its tokens' probabilities, reaches
``--router-threshold``; otherwise the large model answers afresh. A streamed answer
starts only once this is decided, so a client never sees a small model's answer that
is then replaced.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import TokenmillError

Classifier = Callable[[dict[str, Any]], str | None]


@dataclass(frozen=True)
class Route:
    """Which model answers, and why (``reason``, in the response's x-tokenmill-route-reason)."""

    model: str  # the served model's name
    reason: str  # classifier | tools | response_format | logprobs | long_prompt | confident | low_confidence
    confidence: float | None = None  # the cascade's: the small model's answer's


def confidence(logprobs: Sequence[float | None]) -> float:
    """The geometric mean of the probabilities of an answer's tokens, in [0, 1]; 0 for an
    empty answer (nothing to trust)."""
    known = [lp for lp in logprobs if lp is not None]
    return math.exp(sum(known) / len(known)) if known else 0.0


@dataclass(frozen=True)
class ModelRouter:
    name: str
    small: str
    large: str
    threshold: float = 0.5
    max_prompt_tokens: int | None = None
    large_for: frozenset[str] = frozenset({"tools", "response_format"})
    classifier: Classifier | None = None

    def pre_route(self, body: dict[str, Any], prompt_tokens: int) -> Route | None:
        """The route the rules choose for a request (its JSON body, its prompt's length in
        the small model's tokens), or None: cascade."""
        if self.classifier is not None:
            choice = self.classifier(body)
            if choice not in (None, "small", "large"):
                raise TokenmillError(
                    f"router {self.name}: the classifier returned {choice!r}, not 'small', 'large' or None"
                )
            if choice is not None:
                return Route(self.small if choice == "small" else self.large, "classifier")
        for feature in ("tools", "response_format", "logprobs"):
            if feature in self.large_for and _has(body, feature):
                return Route(self.large, feature)
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return Route(self.large, "long_prompt")
        return None

    def judge(self, answers: Sequence[Sequence[float | None]]) -> Route:
        """The cascade's decision from the small model's answers' token logprobs (several
        choices: the least confident decides)."""
        least = min((confidence(lps) for lps in answers), default=0.0)
        if least >= self.threshold:
            return Route(self.small, "confident", least)
        return Route(self.large, "low_confidence", least)

    def describe(self) -> str:
        """What a cache key must hold of this router: what it may answer with, and how."""
        rules = ",".join(sorted(self.large_for))
        return f"router:{self.name}:{self.small}:{self.large}:{self.threshold}:{self.max_prompt_tokens}:{rules}"


def _has(body: dict[str, Any], feature: str) -> bool:
    if feature == "tools":
        return bool(body.get("tools")) and body.get("tool_choice") != "none"
    if feature == "response_format":
        fmt = body.get("response_format")
        constrained = isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
        guided = any(
            body.get(k)
            for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        )
        return constrained or guided
    return body.get("logprobs") not in (None, False)


def load_classifier(spec: str) -> Classifier:
    """``MODULE:FUNCTION``, imported now so that a typo fails at start-up."""
    module, _, function = spec.partition(":")
    if not module or not function:
        raise TokenmillError(f"--router-classifier {spec!r}: give MODULE:FUNCTION")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise TokenmillError(f"--router-classifier {spec!r}: {e}") from None
    if not callable(found):
        raise TokenmillError(f"--router-classifier {spec!r} is not callable")
    return found


def parse_routers(
    specs: Sequence[str],
    models: Sequence[str],
    threshold: float,
    max_prompt_tokens: int | None,
    large_for: Sequence[str],
    classifier: str | None,
) -> dict[str, ModelRouter]:
    """``--router NAME=SMALL,LARGE`` values, checked against the served models' names."""
    call = load_classifier(classifier) if classifier else None
    rules = frozenset(large_for) - {"none"}
    routers: dict[str, ModelRouter] = {}
    for spec in specs:
        name, eq, pair = spec.partition("=")
        members = [m.strip() for m in pair.split(",")]
        if not eq or not name or len(members) != 2 or not all(members):
            raise TokenmillError(f"--router {spec!r}: give NAME=SMALL,LARGE (two served models)")
        if name in models or name in routers:
            raise TokenmillError(f"--router {spec!r}: the name {name!r} is already taken")
        for m in members:
            if m not in models:
                raise TokenmillError(f"--router {spec!r}: {m!r} is not a served model ({', '.join(models)})")
        if members[0] == members[1]:
            raise TokenmillError(f"--router {spec!r}: the small and the large model are the same")
        routers[name] = ModelRouter(name, members[0], members[1], threshold, max_prompt_tokens, rules, call)
    return routers
