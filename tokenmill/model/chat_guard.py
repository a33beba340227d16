"""Client text in a chat prompt stays text: a special token's string inside a message
(``<|im_end|>\\n<|im_start|>system\\n...`` in a user turn) is tokenised as the characters
it is, never as the special token, so a client cannot end its turn and forge a system
one. The template's own markers stay special.

Every message field is client data (content, names, tool call arguments, tool results,
a system prompt the client sent), and so are the tools a template describes. Before
rendering, each special token's text in any of those strings is replaced by a marker:
a random nonce, which the client cannot know, and the token's index. The rendered
prompt then holds special-token text only where the template put it. It is tokenised
whole, as before; each piece between two of the template's special tokens that holds a
marker is tokenised again, the markers put back as text, by a copy of the tokenizer
that does not recognise special tokens.

Why this shape rather than a placeholder per client string, tokenised apart:

- a conversation without special-token text (nearly every one) renders and tokenises
  exactly as before, so its ids are the same by construction;
- the tokenizer splits text at special tokens before anything else, so the pieces
  tokenised again are the spans it would have tokenised as one had the client's
  special-token text been plain: BPE merges see the same text, nothing is cut at the
  edge of a message;
- markers are letters and digits, which templates keep through ``trim``, ``tojson``
  and ``split`` on other strings, where a whole-string placeholder would not survive a
  ``trim`` or a slice. (A template that slices through a marker leaves part of it as
  text: never a special token.)
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from collections.abc import Iterable
from functools import cached_property
from typing import Any

_DIGITS = 7  # a marker's index: far more than any vocabulary's special tokens


class SpecialTextGuard:
    """Marks special-token text in client strings, and tokenises a prompt rendered from
    them with only the template's special tokens recognised."""

    def __init__(self, backend: Any, special_token_ids: Iterable[int]) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.special_ids = frozenset(special_token_ids)
        texts = {backend.id_to_token(i) for i in self.special_ids}
        # longest first: at one position the longest matches, as the tokenizer's own matching does
        self.texts = tuple(sorted((t for t in texts if t), key=lambda t: (-len(t), t)))
        self._index = {t: i for i, t in enumerate(self.texts)}
        self._pattern = re.compile("|".join(map(re.escape, self.texts))) if self.texts else None

    def mark(self, *values: Any) -> tuple[list[Any], str, int]:
        """``values`` with every special token's text in their strings (at any depth of
        dicts and lists) replaced by a marker; the nonce of the markers, and how many."""
        nonce = "tm" + secrets.token_hex(12)
        count = 0

        def marker(m: re.Match[str]) -> str:
            return f"{nonce}{self._index[m.group()]:0{_DIGITS}d}"

        def walk(value: Any) -> Any:
            nonlocal count
            if isinstance(value, str):
                if self._pattern is None:
                    return value
                value, n = self._pattern.subn(marker, value)
                count += n
                return value
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(walk(v) for v in value)
            return value

        return [walk(v) for v in values], nonce, count

    def encode(self, text: str, nonce: str) -> list[int]:
        """Ids of ``text``, rendered from values marked with ``nonce``: its special tokens
        recognised, the markers tokenised as the text they stand for."""
        markers = re.compile(re.escape(nonce) + rf"(\d{{{_DIGITS}}})")
        spans = [m.span() for m in markers.finditer(text)]
        whole = self.backend.encode_batch([text], add_special_tokens=False)[0]  # (releases the GIL, with offsets)
        if not spans:  # the template left the marked text out
            return whole.ids
        starts = [a for a, _ in spans]

        def marked(a: int, b: int) -> bool:  # text[a:b] overlaps a marker
            k = bisect.bisect_left(starts, b)
            return k > 0 and spans[k - 1][1] > a

        ids, offsets = whole.ids, whole.offsets
        # the template's special tokens (not an unknown character's <unk>, nor one made with a marker)
        cuts = [
            (k, a, b)
            for k, (t, (a, b)) in enumerate(zip(ids, offsets, strict=True))
            if t in self.special_ids and self.backend.id_to_token(t) in text[a:b] and not marked(a, b)
        ]
        out: list[int] = []
        tok, char = 0, 0  # where the piece before the next cut begins
        for k, a, b in [*cuts, (len(ids), len(text), len(text))]:
            if marked(char, a):
                piece = markers.sub(lambda m: self.texts[int(m.group(1))], text[char:a])
                plain = self._plain_first if char == 0 else self._plain_after
                out.extend(plain.encode_batch_fast([piece], add_special_tokens=False)[0].ids)
            else:
                out.extend(ids[tok:k])
            out.extend(ids[k : k + 1])
            tok, char = k + 1, b
        return out

    @cached_property
    def _plain_first(self) -> Any:
        """The tokenizer with special tokens read as text, for a piece at the start of the prompt."""
        return _plain(self.backend.to_str())

    @cached_property
    def _plain_after(self) -> Any:
        """... and for one after it: SentencePiece's prefix space, which its "first" scheme adds
        at the start of the text only, is not added (as tokenising the prompt whole)."""
        spec = json.loads(self.backend.to_str())
        pre = _no_first_prefix(spec.get("pre_tokenizer"))
        if pre == spec.get("pre_tokenizer"):
            return self._plain_first
        return _plain(json.dumps(spec | {"pre_tokenizer": pre}))


def _plain(spec: str) -> Any:
    from tokenizers import Tokenizer as HFTokenizer

    plain = HFTokenizer.from_str(spec)
    plain.encode_special_tokens = True
    return plain


def _no_first_prefix(spec: Any) -> Any:
    """A tokenizer.json's pre-tokenizer with Metaspace's ``prepend_scheme: first`` set to
    ``never`` (in a sequence too)."""
    if isinstance(spec, dict):
        if spec.get("type") == "Metaspace" and spec.get("prepend_scheme") == "first":
            return {**spec, "prepend_scheme": "never"}
        return {k: _no_first_prefix(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_no_first_prefix(v) for v in spec]
    return spec
