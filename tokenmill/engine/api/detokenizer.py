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
    """Text of one sequence, built a piece per token: appending costs O(piece), and
    the whole text is joined only when asked for (``text``)."""

    tokenizer: Decoder
    prompt_ids: list[int]
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_chars: int = 0  # characters decoded so far (after truncation at a stop string, once matched)
    _pieces: list[str] = field(default_factory=list)
    _tail: str = ""  # the last characters of the text, enough to match a stop string across pieces
    _unemitted: str = ""  # text past what take_delta has handed out
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        context = self.prompt_ids[-_CONTEXT_TOKENS:]
        self._ids = list(context)
        self._read_offset = len(context)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def text(self) -> str:
        """All text so far (truncated at the stop string once one matched)."""
        return self.text_prefix(self.num_chars)

    def text_prefix(self, num_chars: int) -> str:
        return "".join(self._pieces)[:num_chars]

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; return the stop string it completed, if any (none is looked
        for while ``check_stop`` is false: min_tokens not reached)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character (or nothing visible) so far
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(full[len(prefix) :], check_stop)

    def _append(self, new_text: str, check_stop: bool = True) -> str | None:
        window = self._tail + new_text  # a stop string may begin in the tail, and must end in the new text
        old_len = len(self._tail)
        window_start = self.num_chars - len(self._tail)
        self._pieces.append(new_text)
        self.num_chars += len(new_text)
        self._unemitted += new_text
        self._tail = window[-self._max_stop :] if self._max_stop else ""
        if not check_stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = window.find(
                s, max(0, old_len - len(s) + 1)
            )  # (one wholly in the tail was not looked for: min_tokens)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        cut = window_start + idx + (len(s) if self.include_stop_str_in_output else 0)
        dropped = self.num_chars - cut
        self.num_chars = cut
        self._unemitted = self._unemitted[: len(self._unemitted) - dropped] if dropped else self._unemitted
        return s

    def flush(self) -> None:
        """At the end of a request: emit whatever was held back as incomplete."""
        tail = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(prefix):
            self._prefix_offset = self._read_offset = len(self._ids)
            self._append_plain(tail[len(prefix) :])

    def _append_plain(self, new_text: str) -> None:
        self._pieces.append(new_text)
        self.num_chars += len(new_text)
        self._unemitted += new_text

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, minus a tail that may begin a stop string."""
        keep = 0 if finished else _partial_stop_len(self._unemitted, self.stop)
        delta = self._unemitted[: len(self._unemitted) - keep]
        self._unemitted = self._unemitted[len(delta) :]
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
