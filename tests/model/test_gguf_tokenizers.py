"""GGUF vocabularies of other families encode and decode as transformers reads them.

- SentencePiece (``tokenizer.ggml.model = llama``: Llama 2, Mistral): a vocabulary
  trained here with sentencepiece (BPE, byte fallback), written into a GGUF the way
  llama.cpp's converter writes one (pieces, scores, token types);
- byte-level BPE with Llama 3's and Qwen2's pre-tokenizers and Llama 3's BOS flag
  (SmolLM2's vocabulary and merges under those pre-tokenizer types).

Both go through a whole tiny model file, loaded by ``LLM`` and by transformers'
``AutoTokenizer(gguf_file=...)``, over a multilingual corpus with byte-fallback
characters, digits, whitespace runs and special tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import gguf_tokenizer_metadata, write_gguf
from tokenmill import LLM
from tokenmill.errors import ModelLoadError
from tokenmill.model.tokenizer import tokenizer_from_gguf

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "Hello world! How are you today?",
    "  leading spaces, trailing spaces   ",
    "Numbers: 1, 12, 123, 1234, 12345 and 3.14159; dates 2026-12-01.",
    "Le café était très bon, n'est-ce pas? Ça coûte 5 €.",
    "Über den Wolken muß die Freiheit wohl grenzenlos sein.",
    "Привет, мир! Как дела?",
    "你好，世界。今天天气很好。",
    "こんにちは世界、カタカナとひらがな。",
    "مرحبا بالعالم",
    "Emoji: 🦙🚀✨ and symbols ∑∫√ ≤ ≥",
    "def f(x):\n\treturn x ** 2  # tabs\n\n\nnewlines",
    "I'm sure they'll say it's fine, we've done it, you'd agree.",
    "<s>special tokens inline</s> and <unk> too",
    "",
    " ",
    "\n\n",
]


def _tiny_llama(vocab_size: int, family: str = "llama"):
    torch.manual_seed(0)
    config_cls, model_cls, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 64}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
    }[family]
    cfg = getattr(transformers, config_cls)(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    return getattr(transformers, model_cls)(cfg).eval()


def _compare(path, ours, corpus=CORPUS):
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in corpus:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module", params=["llama", "gemma2", "phi3"])
def sentencepiece_gguf(request, tmp_path_factory):
    """A SentencePiece BPE vocabulary with byte fallback, in a tiny GGUF of each family
    whose tokenizer transformers builds its own way (Llama 2 / Mistral, Gemma, Phi-3)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"spm-{family}")
    text = (CORPUS * 3) + [open(__file__.replace("tests/model/test_gguf_tokenizers.py", "bench/prompt.txt")).read()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(tmp / "sp"),
        vocab_size=700,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<tool>"],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    n = sp.get_piece_size()

    def token_type(i: int) -> int:  # llama.cpp's converter: normal 1, unknown 2, control 3, user 4, byte 6
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) == "<tool>" else 1

    tokenizer = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }
    path = tmp / f"spm-{family}.gguf"
    write_gguf(path, _tiny_llama(n, family), family, tokenizer)
    return path, sp


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf):
    path, sp = sentencepiece_gguf
    with LLM(str(path), dtype="float32", progress=False, kv_cache_memory="16MiB") as llm:
        ours = llm.tokenizer
        _compare(path, ours, CORPUS + ["with a <tool> call"])
        assert ours.encode("Hi")[0] == 1  # BOS, as the file asks
        assert any(sp.is_byte(i) for t in CORPUS for i in ours.encode(t))  # byte fallback was exercised
        assert llm.generate("Hello")[0].outputs[0].token_ids  # and the model runs on it


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False)])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, llm, pre, add_bos):
    tokenizer = gguf_tokenizer_metadata(llm.model_path) | {
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.add_bos_token": add_bos,
    }
    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, _tiny_llama(llm.config.vocab_size), "llama", tokenizer)
    ours = tokenizer_from_gguf(gguf_tokenizer_metadata(path), path)
    _compare(path, ours)
    assert (ours.encode("Hi")[0] == ours.bos_token_id) is add_bos
    # the two splits differ where they should: Llama 3 keeps up to three digits together, Qwen2 one
    assert ours.backend.pre_tokenizer.pre_tokenize_str("12345")[0][0] == ("123" if pre == "llama-bpe" else "1")


def test_unsupported_gguf_tokenizer_is_refused(tmp_path, llm):
    tokenizer = gguf_tokenizer_metadata(llm.model_path) | {"tokenizer.ggml.model": "t5"}
    path = tmp_path / "t5.gguf"
    write_gguf(path, _tiny_llama(llm.config.vocab_size), "llama", tokenizer)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF tokenizer model 't5'.*'gpt2'.*'llama'"):
        LLM(str(path), progress=False)
