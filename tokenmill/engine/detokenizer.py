"""Incremental detokenisation and stop-string matching for one request.

Byte-level BPE tokens can split a UTF-8 character; decoding them alone yields
U+FFFD. We decode a short window of context plus the new tokens and emit only the
text past the context, holding back while the window ends in U+FFFD (vLLM's
prefix/read offsets). Text that could still be the start of a stop string is held
back too, so a stop string never leaks partially into a stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

_CONTEXT_TOKENS = 5  # tokens of context decoded before the new ones


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class IncrementalDetokenizer:
    tokenizer: Decoder
    prompt_ids: list[int]
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""  # all text decoded so far (truncated at a stop string once matched)
    emitted: int = 0  # characters of `text` already handed out as deltas
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        context = self.prompt_ids[-_CONTEXT_TOKENS:]
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character (or nothing visible) so far
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        return self._match_stop(search_from)

    def _match_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop_str_in_output else self.text[:idx]
        return s

    def flush(self) -> None:
        """At the end of a request: emit whatever was held back as incomplete."""
        tail = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, minus a tail that may begin a stop string."""
        end = len(self.text)
        if not finished:
            end -= _partial_stop_len(self.text, self.stop)
        delta = self.text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
