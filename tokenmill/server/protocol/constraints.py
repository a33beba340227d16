"""One output constraint from the ways a request can ask for one: OpenAI's
``response_format`` (json_object, json_schema; text asks for none), vLLM's
``structured_outputs`` and its older ``guided_*`` fields; two at once is a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs


def structured_outputs(
    response_format: dict[str, Any] | None,
    structured: dict[str, Any] | None,
    guided: dict[str, Any],
    whitespace_pattern: str | None,
) -> StructuredOutputs | None:
    """One constraint from OpenAI's response_format, vLLM's structured_outputs or the
    guided_* aliases; more than one of them is a 400 naming them."""
    response_format = _constraining(response_format)
    given = [
        name
        for name, v in (("response_format", response_format), ("structured_outputs", structured), *guided.items())
        if v is not None
    ]
    if len(given) > 1:
        raise InvalidRequestError(f"give one constraint, not {' and '.join(given)}", param=given[1])
    if response_format is not None:
        kind = response_format["type"]
        if kind == "json_object":
            return StructuredOutputs(json_object=True, whitespace_pattern=whitespace_pattern)
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise InvalidRequestError(
                "response_format json_schema needs a json_schema object with a schema", param="response_format"
            )
        return StructuredOutputs(json=spec.get("schema", {}), whitespace_pattern=whitespace_pattern)
    if structured is not None:
        body = dict(structured)
        if whitespace_pattern is not None:
            body.setdefault("whitespace_pattern", whitespace_pattern)
        return StructuredOutputs.from_dict(body)
    for name, value in guided.items():
        if value is not None:
            kind = name.removeprefix("guided_")
            extra = {"whitespace_pattern": whitespace_pattern} if kind == "json" else {}
            return StructuredOutputs(**{kind: value}, **extra)
    return None


def _constraining(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """response_format, unless it asks for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise InvalidRequestError(
            f"response_format type must be text, json_object or json_schema, not {kind!r}", param="response_format"
        )
    return response_format
