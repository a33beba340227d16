"""Reasoning models' answers split in two, as vLLM's ``--reasoning-parser`` splits them:
what the model thinks (``<think>...</think>``) becomes ``reasoning_content`` (a chat
message's, a stream's ``delta.reasoning_content``, a response's ``reasoning`` item), the
rest ``content``.

Two parsers, vLLM's rules:

* ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the answer starts
  inside the reasoning: everything up to ``</think>`` is reasoning (a leading
  ``<think>``, if the model writes one, is dropped), the rest content; no ``</think>``
  (cut short) and all of it is reasoning.
* ``qwen3``: the same, but for a request that turns thinking off
  (``chat_template_kwargs: {"enable_thinking": false}``: the template writes the empty
  ``<think>\\n\\n</think>\\n\\n`` into the prompt itself), whose whole answer is content.

``ReasoningSplitter`` is the one implementation: fed text deltas, it returns each one's
(reasoning, content) parts, holding back a tail that could still become ``</think>``
(or, at the very start, ``<think>``), so a marker split across deltas is never sent as
text; ``Reasoning.split`` is the splitter fed a whole answer. A streamed answer's parts
therefore join to the non-streamed fields. vLLM splits on the markers' token ids, this
on their text: the same wherever the model writes each marker as its one token.

**Structured output and tools apply after the reasoning.** A request's constraint
(``response_format``, ``structured_outputs``, a tool_choice's grammar) must not
constrain the thinking: its ``StructuredOutputs`` gets ``reasoning_end="</think>"``, and
the grammar compiled for it (structured/grammar.py) is "any tokens but ``</think>``,
then ``</think>``, then the constraint". vLLM instead holds each request's matcher
until the end-of-reasoning token is sampled (``reasoning_ended``), which needs the
scheduler, the mask builder and the draft check to know about reasoning; a grammar
with a free prefix needs none of that: the engine still sees one grammar per request
(its layering untouched: it imports nothing of the server's), drafts and rollback
work as for any grammar, and a mask over the thinking costs tens of microseconds a
token. Tool calls are parsed from the content part only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.configuration.serving_config import REASONING_PARSERS
from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.models import ServedModel, Target

logger = logging.getLogger(__name__)

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One answer's text, fed as it grows, split into (reasoning, content) deltas."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # the answer starts inside the reasoning
        self._state = "start" if thinking else "content"  # start -> reasoning -> content
        self._held = ""  # a tail that may still be the start of a marker

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        """The (reasoning, content) of ``delta``; ``finished``: nothing more comes, so
        nothing is held back."""
        text, self._held = self._held + delta, ""
        reasoning = ""
        if self._state == "start":
            if len(text) < len(START) and START.startswith(text) and not finished:  # (a prefix of <think>)
                self._held = text
                return "", ""
            text = text.removeprefix(START)
            self._state = "reasoning"
        if self._state == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = 0 if finished else _partial_suffix(text, END)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END) :]
            self._state = "content"
        return reasoning, text


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning parser: which one, whether its answer starts inside the
    reasoning, and the id of the token that ends it (for reasoning_tokens)."""

    parser: str
    thinking: bool
    end_token_id: int | None = None

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning_content, content), as vLLM's ``extract_reasoning``:
        reasoning None when the answer has none to have (thinking off); content None when
        nothing follows ``</think>`` (or it never came)."""
        reasoning, content = self.splitter().feed(text, finished=True)
        if not self.thinking:
            return None, content
        return reasoning, content or None

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of an answer's tokens are its reasoning: up to ``</think>``, that
        token included; all of them when it never came."""
        if not self.thinking:
            return 0
        if self.end_token_id is not None and self.end_token_id in token_ids:
            return token_ids.index(self.end_token_id) + 1
        return len(token_ids)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its constraint (if any) starting after the reasoning."""
        if not self.thinking or params.structured is None:
            return params
        return replace(params, structured=replace(params.structured, reasoning_end=END))


def reasoning_for(target: Target, body: Any) -> Reasoning | None:
    """The chat request's reasoning parser (None: its model has none). ``body``: a chat
    request (its ``chat_template_kwargs`` say whether Qwen3 thinks)."""
    parser = target.model.reasoning_parser
    if parser is None:
        return None
    kwargs = getattr(body, "chat_template_kwargs", None) or {}
    thinking = parser == "deepseek_r1" or kwargs.get("enable_thinking") is not False  # (the template's own test)
    backend = getattr(target.tokenizer, "backend", None)
    return Reasoning(parser, thinking, backend.token_to_id(END) if backend is not None else None)


def apply_reasoning_parser(models: list[ServedModel], parser: str) -> None:
    """``--reasoning-parser``: each served model whose vocabulary holds ``<think>`` and
    ``</think>`` as tokens gets it; the others serve without one, said once in the log
    (vLLM refuses such a model; a deployment that sets the flag for every model should
    start whatever the model)."""
    if parser not in REASONING_PARSERS:
        raise TokenmillError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, not {parser!r}")
    for m in models:
        if has_think_tokens(m.tokenizer):
            m.reasoning_parser = parser
        else:
            logger.warning(
                "--reasoning-parser %s: model %s has no %s and %s tokens; served without it", parser, m.name, START, END
            )


def has_think_tokens(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend", None)
    return backend is not None and all(backend.token_to_id(t) is not None for t in (START, END))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
