"""StructuredOutputs: what a request's output must match, as vLLM names it.

One of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (Lark or
GBNF/EBNF text) or ``json_object`` (any JSON object), plus ``whitespace_pattern``
for JSON and ``reasoning_end`` (the constraint starts after a reasoning model's
thinking). Free of torch and of the grammar library, so that ``SamplingParams`` and
the engine can hold it; the grammar is compiled by ``structured.grammar``.

The JSON schema is kept as compact text (key order kept: it is the order the
output writes properties in), so that the value is
hashable, and two requests with the same schema share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema (a dict or its text is accepted; kept as canonical text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance) or GBNF/EBNF (llama.cpp) syntax
    json_object: bool = False
    whitespace_pattern: str | None = None  # JSON only: the whitespace allowed between tokens
    # A reasoning model's end-of-reasoning token (``</think>``): the output may open with
    # any tokens but this one, then this one, and the constraint applies after it. Set by
    # the server's reasoning parser (server/jobs/reasoning.py), never by a client.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _canonical_json(self.json))
        elif isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _canonical_json(json.loads(self.json)))
            except ValueError as e:
                raise InvalidRequestError(
                    f"structured output json: the schema is not valid JSON: {e}", param="json"
                ) from e
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("structured output choice must be a list of strings", param="choice")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise InvalidRequestError("structured output choice must not be empty", param="choice")
        for name in ("regex", "grammar", "whitespace_pattern", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured output {name} must be a non-empty string", param=name)
        if self.json is not None and not isinstance(json.loads(self.json), (dict, bool)):
            raise InvalidRequestError("structured output json must be a JSON schema object", param="json")
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise InvalidRequestError(
                f"structured output needs exactly one of {', '.join(KINDS)} (got {found})", param="structured_outputs"
            )
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise InvalidRequestError(
                "whitespace_pattern applies to json and json_object only", param="whitespace_pattern"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def size_bytes(self) -> int:
        """How big the user's spec is (UTF-8 bytes of the schema, regex, grammar, or of
        the choices together): what ``max_grammar_bytes`` caps."""
        parts = [self.json, self.regex, self.grammar, self.whitespace_pattern, *(self.choice or ())]
        return sum(len(p.encode()) for p in parts if p is not None)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (json_object: any object)."""
        if self.json is not None:
            return json.loads(self.json)
        return {"type": "object"} if self.json_object else None

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> StructuredOutputs:
        """vLLM's ``structured_outputs`` object; unknown keys are an error naming them."""
        fields = set(KINDS) | {"whitespace_pattern"}
        unknown = sorted(
            set(body) - fields - {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
        )
        if unknown:
            raise InvalidRequestError(
                f"unknown structured_outputs field(s): {', '.join(unknown)}", param="structured_outputs"
            )
        return cls(**{k: v for k, v in body.items() if k in fields and v is not None})


def _canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(
            f"structured output json: the schema is not JSON-serialisable: {e}", param="json"
        ) from e
