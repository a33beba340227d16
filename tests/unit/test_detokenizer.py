"""Stop strings and streaming hold-back, on a character-level toy tokenizer."""

from __future__ import annotations

from tokenmill.engine.api.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def feed(detok, text):
    deltas, stop = [], None
    for ch in text:
        stop = detok.add_token(ord(ch))
        deltas.append(detok.take_delta(finished=stop is not None))
        if stop:
            break
    return deltas, stop


def test_stop_string_truncates_and_never_leaks_partially():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=("END",))
    deltas, stop = feed(detok, "abc ENxEND tail")
    assert stop == "END"
    assert detok.text == "abc ENx"
    assert "".join(deltas) == "abc ENx"
    assert all("END" not in d for d in deltas)
    assert deltas[:6] == ["a", "b", "c", " ", "", ""]  # "E", "EN" could begin "END": held back
    assert deltas[6] == "ENx"  # "ENx" cannot: released at once


def test_include_stop_string():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=("!", "xyz"), include_stop_str_in_output=True)
    _, stop = feed(detok, "hi xyz!")
    assert stop == "xyz" and detok.text == "hi xyz"


def test_earliest_stop_string_wins():
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop=("bc", "abcd"))
    _, stop = feed(detok, "xabcd")
    assert stop == "bc" and detok.text == "xa"
