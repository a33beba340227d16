"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face folder.

A GGUF vocabulary (byte-level BPE, or SentencePiece) becomes a ``tokenizers.Tokenizer``
the way transformers converts it, so both encode alike.
Chat templates are rendered with a sandboxed jinja2 environment configured as
transformers configures it (model/chat_template.py), a request's own template by the
caller's ``render`` (the server's: in a worker process, with limits).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.model.chat_guard import SpecialTextGuard
from tokenmill.model.families import GGUF_FAMILIES

# Tokens that end a turn in common chat formats; generation stops on any present
# in the vocabulary, as llama.cpp's end-of-generation set does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
_GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED = 2, 3, 4
# What a chat template is given by us (and jinja2's own globals, such as namespace): a
# request's chat_template_kwargs may not set these.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
    | {"range", "dict", "lipsum", "cycler", "joiner", "namespace"}
)
# How a template becomes text: ``render(template, variables)`` (chat_template.py's, in process,
# unless the caller gives another).
Render = Callable[[str, dict[str, Any]], str]


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Through ``encode_batch_fast``, which releases the GIL
        (``encode`` holds it: a 2 MB prompt froze every other thread of the server,
        its event loop included, for 1.8 s) and skips the offsets we never read."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; a long list through ``decode_batch``, which releases the GIL
        (the detokenizer's few-token calls keep the cheaper ``decode``)."""
        if len(ids) > 4096:
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        render: Render | None = None,
    ) -> str:
        """Render messages to the prompt text the model was trained on (``tools``: for
        templates that describe tools themselves; ``template_kwargs``: more variables for
        the template, as vLLM's ``chat_template_kwargs``, such as Qwen3's
        ``enable_thinking``; none may set one of the variables given here).
        ``continue_final_message``: the text ends with the last message's content, left
        open for the model to continue (transformers' rule: cut after its last occurrence);
        ``chat_template``: this call's template instead of the model's; ``render``: what
        renders it (default: in this process, without limits)."""
        _validate_messages(messages)
        taken = sorted(set(template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {taken[0]!r}: the server sets it", param="chat_template_kwargs"
            )
        template = chat_template or self.chat_template
        if template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            text = "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        else:
            from tokenmill.model.chat_template import render_chat_template

            variables = {
                **(template_kwargs or {}),
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self._token_text(self.bos_token_id),
                "eos_token": self._token_text(self.eos_token_id),
                **({"tools": tools} if tools else {}),
            }
            text = (render or render_chat_template)(template, variables)
        return open_final_message(text, messages[-1]) if continue_final_message else text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        allow_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        render: Render | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation. Special-token text in the messages, tools or
        template variables is client text and tokenised as such (a user's ``<|im_end|>``
        cannot end its turn and forge a system one; model/chat_guard.py); the template's
        markers stay special. ``allow_special_tokens``: the rendered text tokenised as it
        reads (for clients that are trusted to write special tokens). ``add_special_tokens``:
        the tokenizer's own special tokens (a BOS) around the rendered text, as vLLM's field
        (off by default: the template writes what the model needs). ``render``: as
        ``apply_chat_template``'s."""
        rendering = dict(continue_final_message=continue_final_message, chat_template=chat_template, render=render)
        if allow_special_tokens or not self.special_token_ids:
            text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, **rendering)
            return self.encode(text, add_special_tokens=add_special_tokens)
        (messages, tools, template_kwargs), nonce, found = self._guard.mark(messages, tools, template_kwargs)
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, **rendering)
        if not found:
            return self.encode(text, add_special_tokens=add_special_tokens)
        ids = self._guard.encode(text, nonce)
        if add_special_tokens:
            before, after = self._special_wrap
            ids = before + ids + after
        return ids

    @cached_property
    def _special_wrap(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (a BOS, an EOS)."""
        plain, wrapped = self.encode("x", add_special_tokens=False), self.encode("x", add_special_tokens=True)
        for i in range(len(wrapped) - len(plain) + 1):
            if wrapped[i : i + len(plain)] == plain:
                return wrapped[:i], wrapped[i + len(plain) :]
        return [], []

    @cached_property
    def _guard(self) -> SpecialTextGuard:
        return SpecialTextGuard(self.backend, self.special_token_ids)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_to_str(token_id)


def open_final_message(text: str, final: dict[str, Any]) -> str:
    """``text`` cut right after the final message's content, as transformers' and vLLM's
    ``continue_final_message``: what the template writes to close the turn is dropped."""
    content = final.get("content")
    if isinstance(content, list):
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(content, str):
        raise InvalidRequestError("continue_final_message needs a final message with text", param="messages")
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise InvalidRequestError(
        "continue_final_message is set but the final message does not appear in the rendered chat",
        param="continue_final_message",
    )


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must have a 'role' and a string 'content'")


def _stop_ids(backend: Any, eos: int | None, extra: Sequence[int] = ()) -> frozenset[int]:
    ids = {i for i in (eos, *extra) if i is not None}
    for tok in END_OF_TURN_TOKENS:
        tid = backend.token_to_id(tok)
        if tid is not None:
            ids.add(tid)
    return frozenset(ids)


# How llama.cpp's pre-tokenizer types split text before byte-level BPE (the regexes of
# the models' own tokenizer.json); any other type gets GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece (BPE with byte fallback)


def tokenizer_from_gguf(metadata: dict[str, Any], path: Path) -> Tokenizer:
    """A GGUF vocabulary as a ``tokenizers.Tokenizer``, built as transformers builds it
    from the same file (its GGUF loader is the reference in the tests):

    - ``gpt2``: byte-level BPE from tokens and merges, text split by the pre-tokenizer
      type's regex (``tokenizer.ggml.pre``: Llama 3, Qwen2, Mistral's tekken, else GPT-2's);
    - ``llama``: SentencePiece BPE (Llama 2, Mistral): merges recovered from the scores,
      "▁" for spaces with one prepended to the text, unknown bytes as ``<0xNN>`` tokens;
      Phi-3 prepends through a normalizer, Gemma prepends nothing and orders its merges
      by the tokens' order (transformers' per-architecture builders).

    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` are honoured (a SentencePiece file
    without the flag gets BOS, as llama.cpp does); control tokens are special, user-defined
    ones added whole (the unknown token is special too, as both llama.cpp and transformers
    treat it)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in GGUF_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r} in {path}; supported: "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    family = GGUF_FAMILIES.get(metadata.get("general.architecture"))  # unknown: the plain SentencePiece split
    sentencepiece = family.sentencepiece if family is not None else "metaspace"
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type", [])
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = GGUF_PRE_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
    elif sentencepiece == "gemma":
        # Gemma: runs of spaces are stored as spaces but looked up as "\u2581"s, merges follow the
        # tokens' order (not their scores), no prefix space.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = sentencepiece_merges(tokens, [-float(i) for i in range(len(tokens))])
        unk = metadata.get("tokenizer.ggml.unknown_token_id")
        backend = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=True,
                byte_fallback=True,
                unk_token=tokens[unk] if unk is not None else None,
            )
        )
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = sentencepiece_merges(tokens, scores)
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        if sentencepiece == "prefix":  # the prefix space from a normalizer (Phi-3)
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(content=" ", left=1),
            ]
        )
    special = [i for i, t in enumerate(types) if t in (_GGUF_UNKNOWN, _GGUF_CONTROL)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _GGUF_USER_DEFINED]
    )
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bos is not None and metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = eos is not None and metadata.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        marks = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on]
        single = ([tokens[bos]] if add_bos else []) + ["$A"] + ([tokens[eos]] if add_eos else [])
        backend.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=marks)
    return Tokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=metadata.get("tokenizer.chat_template"),
        stop_token_ids=_stop_ids(backend, eos),
        special_token_ids=frozenset(special),
    )


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens, best merged score first (transformers' ``generate_merges``, so that both
    tokenize alike)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _token_id(backend: Any, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def tokenizer_from_folder(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"no tokenizer.json in model folder {path}")
    backend = HFTokenizer.from_file(str(tok_file))
    cfg: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    extra_eos: list[int] = []
    if (path / "generation_config.json").is_file():
        gen_eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
        extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    eos = _token_id(backend, cfg.get("eos_token"))
    special = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
    return Tokenizer(
        backend=backend,
        bos_token_id=_token_id(backend, cfg.get("bos_token")),
        eos_token_id=eos,
        chat_template=template,
        stop_token_ids=_stop_ids(backend, eos, extra_eos),
        special_token_ids=frozenset(special),
    )


def load_tokenizer(path: Path, metadata: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of a model file or folder; a GGUF's metadata is read here unless
    given (the API process of ``tokenmill serve`` needs the tokenizer, not the weights)."""
    if path.is_dir():
        return tokenizer_from_folder(path)
    if metadata is None:
        from tokenmill.model.gguf_file import read_gguf

        metadata, _ = read_gguf(path)
    return tokenizer_from_gguf(metadata, path)
