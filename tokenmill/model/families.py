"""Model families in one place: everything that differs between the checkpoints we read.

One decoder (model/llama.py) serves every family through ``ModelConfig`` switches; a
``Family`` says how a family's checkpoints set them and what else is peculiar to it:
its names in config.json and in GGUF files, llama.cpp's Q/K row permutation, norms
stored as ``w - 1``, GGUF tensor names that differ from Llama's, the config fields
only it has (Gemma's soft-caps and local layers, Mixtral's experts), and how its GGUF
SentencePiece vocabulary splits text. The loader and the tokenizer ask the family;
none of them tests an architecture's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError

Fields = dict[str, Any]  # ModelConfig fields a family sets
GGUFKey = Callable[..., Any]  # key(name, default=None): the GGUF metadata field "{arch}.{name}"


def window_if_shorter(window: Any, context: int) -> int | None:
    """A sliding window that matters (shorter than the context), or None."""
    return int(window) if window is not None and int(window) < context else None


def _no_fields(*_: Any) -> Fields:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]  # config.json's model_type
    gguf_archs: tuple[str, ...]  # a GGUF's general.architecture (Mixtral's files say "llama")
    permuted_qk: bool = False  # llama.cpp reorders Q and K rows when it writes this family's GGUF
    norm_offset: float = 0.0  # HF norm weights stored as w - offset (Gemma: the model multiplies by 1 + w)
    hf_window: bool = False  # config.json's sliding_window applies to every layer
    hf_attention_bias: bool = False  # q/k/v biases whatever the config says (Qwen2)
    hf_qk_norm: bool = False  # RMSNorm on queries and keys (GGUF: read from the tensors present)
    hf_experts: bool = False  # a mixture of experts (GGUF: read from expert_count)
    hf_tied_by_default: bool = False  # tie_word_embeddings when config.json does not say
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)  # GGUF kinds named otherwise than Llama's
    # How the GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama") splits text:
    # "metaspace" (Llama 2, Mistral), "prefix" (a normaliser adds the prefix space: Phi-3),
    # "gemma" (spaces looked up as runs of U+2581, merges in token order, no prefix space).
    sentencepiece: str = "metaspace"
    hf_fields: Callable[[dict[str, Any], int], Fields] = _no_fields  # (config.json, context) -> fields
    gguf_fields: Callable[[str, GGUFKey, int, int, int], Fields] = _no_fields  # (arch, key, hidden, heads, context)


# --------------------------------------------------------------------------- Gemma


def _gemma_hf(raw: dict[str, Any], context: int) -> Fields:
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(int(raw["num_hidden_layers"]))
    ]
    scalar = raw.get("query_pre_attn_scalar")
    return dict(
        hidden_act="gelu_tanh",
        embedding_scale=float(raw["hidden_size"]) ** 0.5,
        sandwich_norms=True,
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        query_scale=float(scalar) ** -0.5 if scalar else None,
        layer_windows=tuple(
            window_if_shorter(raw.get("sliding_window"), context) if t == "sliding_attention" else None for t in types
        ),
        sliding_window=None,
    )


def _gemma_gguf(arch: str, key: GGUFKey, hidden: int, heads: int, context: int) -> Fields:
    """Gemma 2/3 settings a GGUF states, or llama.cpp's defaults where it does not: local
    layers every other one (Gemma 2) or five in six (Gemma 3), the local RoPE base 10000,
    and the attention scale 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden/heads)
    (46 layers for Gemma 2, 62 for Gemma 3, as llama.cpp tells them apart)."""
    layers = int(key("block_count"))
    window = window_if_shorter(key("attention.sliding_window"), context)
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        local = [bool(p) for p in pattern]
    else:
        period = int(pattern or (2 if arch == "gemma2" else 6))
        local = [bool((i + 1) % period) for i in range(layers)]
    head_dim = int(key("attention.key_length") or hidden // heads)
    big = layers == (46 if arch == "gemma2" else 62)
    return dict(
        hidden_act="gelu_tanh",
        embedding_scale=float(hidden) ** 0.5,
        sandwich_norms=True,
        attn_softcap=key("attn_logit_softcapping"),
        final_softcap=key("final_logit_softcapping"),
        query_scale=(hidden / heads if big else head_dim) ** -0.5,
        layer_windows=tuple(window if is_local else None for is_local in local),
        rope_local_theta=float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        sliding_window=None,
    )


_GEMMA_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = dict(
    norm_offset=1.0,
    hf_tied_by_default=True,
    gguf_layer_names=_GEMMA_GGUF_NAMES,
    sentencepiece="gemma",
    hf_fields=_gemma_hf,
    gguf_fields=_gemma_gguf,
)

FAMILIES = (
    Family("llama", ("llama",), ("llama",), permuted_qk=True),
    Family("mistral", ("mistral",), ("mistral",), permuted_qk=True, hf_window=True),
    Family("mixtral", ("mixtral",), (), permuted_qk=True, hf_window=True, hf_experts=True),
    # Phi-3's GGUF holds the fused projections (and "ffn_up" is gate and up together).
    Family(
        "phi3",
        ("phi3",),
        ("phi3",),
        hf_window=True,
        sentencepiece="prefix",
        gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    Family("qwen2", ("qwen2",), ("qwen2",), hf_attention_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), hf_qk_norm=True),
    Family("gemma2", ("gemma2",), ("gemma2",), **_GEMMA),
    Family("gemma3", ("gemma3_text",), ("gemma3",), hf_qk_norm=True, **_GEMMA),
)
HF_FAMILIES: Mapping[str, Family] = {t: f for f in FAMILIES for t in f.hf_model_types}
GGUF_FAMILIES: Mapping[str, Family] = {a: f for f in FAMILIES for a in f.gguf_archs}


def hf_family(model_type: Any, path: Path) -> Family:
    family = HF_FAMILIES.get(model_type)
    if family is None:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {path / 'config.json'}; "
            f"supported: {', '.join(sorted(HF_FAMILIES))}"
        )
    return family


def gguf_family(arch: Any, path: Path) -> Family:
    family = GGUF_FAMILIES.get(arch)
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {path}; supported: {', '.join(sorted(GGUF_FAMILIES))}"
        )
    return family


def family_named(architecture: str) -> Family:
    """The family of a ``ModelConfig.architecture`` (a model_type or a GGUF architecture)."""
    family = HF_FAMILIES.get(architecture) or GGUF_FAMILIES.get(architecture)
    if family is None:
        raise ModelLoadError(f"unknown architecture {architecture!r}")
    return family
