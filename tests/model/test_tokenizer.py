"""Our GGUF-built tokenizer against transformers' tokenizer of the same file."""

from __future__ import annotations

import pytest

from tokenmill.engine.api.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nand blank lines   \n",
    "Unicode: naïve café, Ünïcödé, 日本語のテキスト, 한국어, العربية, emoji 🤖🚀👩‍💻 and ∑∫√∞.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    'if (a != b && c >= 0x1F) { printf("%d\\n", a); }',
    "Numbers 1234567890 and 3.14159, dates 2026-11-29, money $1,000.00",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with a special token <|endoftext|> in the middle",
    "                    many spaces",
    "CamelCaseIdentifiers and snake_case_names and SCREAMING_CASE",
    "",
]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(llm, hf_tokenizer, text):
    ours = llm.tokenizer.encode(text)
    ref = hf_tokenizer(text).input_ids
    assert ours == ref
    assert llm.tokenizer.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(ref, skip_special_tokens=False)
    assert llm.tokenizer.decode(ours) == hf_tokenizer.decode(ref, skip_special_tokens=True)


def test_chat_template_matches_transformers(llm, hf_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    for msgs in (messages, messages[1:2]):
        ours = llm.tokenizer.apply_chat_template(msgs)
        ref = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours == ref
    assert "<|im_start|>assistant\n" in ours


def test_stop_tokens_include_end_of_turn(llm):
    tok = llm.tokenizer
    assert tok.backend.token_to_id("<|im_end|>") in tok.stop_token_ids
    assert tok.eos_token_id in tok.stop_token_ids


def test_incremental_decoding_never_emits_broken_utf8(llm):
    text = "emoji 🤖🚀👩‍💻, CJK 日本語のテキスト, accents ÅÉÎÕÜ, math ∑∫√∞ end"
    ids = llm.tokenizer.encode(text)
    # byte-level BPE splits these characters over several tokens
    assert any("\ufffd" in llm.tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids=[])
    pieces = []
    for i in ids:
        detok.add_token(i)
        piece = detok.take_delta(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    detok.flush()
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == text


def _ticks_while(fn) -> tuple[int, object]:
    """How many times another thread got to run (and sleep 1 ms) while ``fn`` ran."""
    import threading
    import time

    ticks, done = [0], threading.Event()

    def ticker() -> None:
        while not done.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    t = threading.Thread(target=ticker)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    return ticks[0], result


def test_long_encode_and_decode_let_other_threads_run(llm, hf_tokenizer):
    """The server tokenises in a worker thread so that its event loop keeps answering;
    that only helps if the tokenizer releases the GIL (tokenizers' ``encode`` holds it
    for the whole call: a 2 MB prompt froze the server for seconds)."""
    text = "".join(CORPUS) * 2000  # 1 MB: held, the GIL lets 3 ticks through; released, 400
    ticks, ids = _ticks_while(lambda: llm.tokenizer.encode(text))
    assert ids == hf_tokenizer(text).input_ids  # still the same tokens
    assert ticks >= 50, f"the event loop's thread ran {ticks} times during a long encode"
    ticks, back = _ticks_while(lambda: llm.tokenizer.decode(ids, skip_special_tokens=False))
    assert back == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert ticks >= 10, f"the event loop's thread ran {ticks} times during a long decode"
