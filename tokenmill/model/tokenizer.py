"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face folder.

A GGUF ``gpt2``-type vocabulary (byte-level BPE: tokens + merges) becomes a
``tokenizers.Tokenizer`` the way transformers converts it, so both encode alike.
Chat templates are rendered with a sandboxed jinja2 environment configured as
transformers configures it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidRequestError, ModelLoadError

# Tokens that end a turn in common chat formats; generation stops on any present
# in the vocabulary, as llama.cpp's end-of-generation set does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


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
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Render messages to the prompt text the model was trained on (``tools``: for
        templates that describe tools themselves)."""
        _validate_messages(messages)
        if self.chat_template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return _render_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            **({"tools": tools} if tools else {}),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.token_to_str(token_id)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must have a 'role' and a string 'content'")


def _render_template(template: str, **context: Any) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(**context)
    except TemplateError as e:
        raise InvalidRequestError(f"chat template error: {e}") from e


def _stop_ids(backend: Any, eos: int | None, extra: Sequence[int] = ()) -> frozenset[int]:
    ids = {i for i in (eos, *extra) if i is not None}
    for tok in END_OF_TURN_TOKENS:
        tid = backend.token_to_id(tok)
        if tid is not None:
            ids.add(tid)
    return frozenset(ids)


def tokenizer_from_gguf(metadata: dict[str, Any], path: Path) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r} in {path}: tokenmill reads byte-level BPE "
            "('gpt2') vocabularies from GGUF; use a Hugging Face folder with tokenizer.json instead"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type", [])
    special = [i for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        backend=backend,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        chat_template=metadata.get("tokenizer.chat_template"),
        stop_token_ids=_stop_ids(backend, eos),
        special_token_ids=frozenset(special),
    )


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
    return tokenizer_from_folder(path) if path.is_dir() else tokenizer_from_gguf(metadata or {}, path)
