"""Checkpoint loading: a GGUF file or a Hugging Face folder -> ModelConfig + weights.

Weights come back as a flat dict in our module names (those of Hugging Face's Llama
without the leading ``model.``), already in the compute dtype. GGUF tensors are
dequantised here, once, at load, unless ``keep_quantized``: then the linear weights and
the token embedding of the types the native kernels serve stay in their blocks, repacked
(``PackedWeight``, quant/packed.py), and F16/BF16 ones keep their 16 bits (the kernels
convert them in registers) whatever the compute dtype. GGUF's Q/K row permutation (llama.cpp reorders Q
and K rows so that its RoPE rotates adjacent pairs) is undone so that one RoPE
implementation serves both formats.

A folder quantised by AWQ (GEMM), GPTQ (v1) (quant/hf_quant.py), compressed-tensors or FP8
(quant/hf_compressed.py) has its linears decoded: int4 / int8 kept as the kernels' blocks under the
same ``keep_quantized``, otherwise (and for act order) dequantised to the compute dtype; FP8
weights kept in their scale's 16 bits (the 16-bit kernels) or dequantised; other quantisations
are refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.configuration.config import ModelConfig, RopeScaling
from tokenmill.errors import ModelLoadError
from tokenmill.model.families import Family, family_named, gguf_family, hf_family, window_if_shorter
from tokenmill.model.gguf_file import read_gguf
from tokenmill.model.paths import resolve_model_path
from tokenmill.quant.blocks import BLOCK_TYPES, BlockWeight
from tokenmill.quant.hf_quant import FolderQuant, hf_quantization
from tokenmill.quant.packed import NATIVE_GGUF_TYPES, PackedWeight
from tokenmill.quant.weights import packed_weight

logger = logging.getLogger(__name__)

# GGML tensor types we dequantise at load (gguf.quants implements each).
SUPPORTED_GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router, and the stacked experts
    "ffn_gate_exps": "mlp.w1_exps",
    "ffn_up_exps": "mlp.w3_exps",
    "ffn_down_exps": "mlp.w2_exps",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


@dataclass
class Checkpoint:
    """What a checkpoint holds: config, weights (compute dtype), tokenizer source."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | PackedWeight]  # PackedWeight: quantised blocks kept (keep_quantized)
    path: Path
    # GGUF: its metadata fields (tokenizer.*); HF folder: empty, read tokenizer.json.
    metadata: dict[str, Any] = field(default_factory=dict)


def read_config(model: str | Path | None) -> tuple[Path, ModelConfig]:
    """A checkpoint's path and configuration, without its weights (a GGUF's header, or
    config.json): what the options can be checked against before anything loads."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path, hf_config(_read_config_json(path), path)
    metadata, tensors = read_gguf(path)
    return path, gguf_config(metadata, {t.name for t in tensors}, path)


def _read_config_json(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in model folder {path}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"invalid JSON in {config_file}: {e}") from e


def load_checkpoint(
    model: str | Path | None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    keep_quantized: bool = False,
    int8_blocks: bool = False,
) -> Checkpoint:
    """Load a .gguf file or a Hugging Face folder (config.json + *.safetensors).
    ``keep_quantized``: a GGUF's quantised linear weights and embedding stay quantised (an
    AWQ / GPTQ folder's int4 linears too, as the kernels' blocks; otherwise dequantised);
    ``int8_blocks``: those of the types quant/blocks.py serves stay in the file's blocks
    (``BlockWeight``, int8 arithmetic), the others are widened (``PackedWeight``)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_folder(path, dtype, progress, keep_quantized)
    return _load_gguf(path, dtype, progress, keep_quantized, int8_blocks)


# ----------------------------------------------------------------------------- GGUF


def gguf_config(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    family = gguf_family(arch, path)

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = key("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor", 1.0)))
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported RoPE scaling type {scaling_type!r} in {path}")
    context = int(key("context_length", 2048))
    fields = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        architecture=str(arch),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=window_if_shorter(key("attention.sliding_window"), context),
        num_experts=int(key("expert_count", 0)),
        num_experts_per_tok=int(key("expert_used_count", 0)),
    )
    return ModelConfig(**{**fields, **family.gguf_fields(str(arch), key, hidden, heads, context)})


def _gguf_name(name: str, family: Family) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    layer_names = _GGUF_LAYER_NAMES | dict(family.gguf_layer_names)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs, 2) -> (2, pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Our names of the tensors that may stay quantised: the linear layers' weights and the embedding.
_PACKABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
_SIXTEEN_BITS = {"F16": torch.float16, "BF16": torch.bfloat16}
# GGUF's float types as numpy reads their bytes (bfloat16 as int16: numpy has none) and as torch names them
_STORED = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16)}


def _tensor(arr: np.ndarray, stored: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """A weight of our own in `dtype` from `arr` (a view of the mapped file, or an array made from
    it) holding `stored` values: one pass, the conversion and the copy together (a 1B F16 file's
    load went through numpy's float32 in three passes: 9.7 s)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        src = torch.from_numpy(np.ascontiguousarray(arr))
    return src.view(stored).to(dtype, copy=True)


def _load_gguf(
    path: Path, dtype: torch.dtype, progress: bool, keep_quantized: bool = False, int8_blocks: bool = False
) -> Checkpoint:
    from gguf import GGMLQuantizationType, dequantize

    metadata, tensors = read_gguf(path)
    config = gguf_config(metadata, {t.name for t in tensors}, path)
    family = family_named(config.architecture)
    for t in tensors:  # fail before spending time dequantising
        if t.type_name not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(
                f"unsupported GGUF tensor type {t.type_name} (tensor {t.name}) in {path}; "
                f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
            )
    weights: dict[str, torch.Tensor] = {}
    reporter = _Progress("loading weights", len(tensors), progress)
    for t in tensors:
        name = _gguf_name(t.name, family)
        if name is None:
            if t.name.startswith("rope_factors_"):
                raise ModelLoadError(
                    f"{path} uses LongRoPE factors ({t.name}), not supported from GGUF yet; "
                    "load the Hugging Face folder instead"
                )
            raise ModelLoadError(f"unexpected tensor {t.name} in {path}")
        if keep_quantized and t.type_name in NATIVE_GGUF_TYPES and len(t.shape) == 2 and name.endswith(_PACKABLE):
            weights[name] = _packed(t.type_name, t.data, t.shape, name, config, family, int8_blocks)
            reporter.step()
            continue
        stored = _STORED.get(t.type_name)  # float types: the file's values as they are, not through numpy's float32
        arr = (
            t.data.view(stored[0]).reshape(t.shape)
            if stored
            else dequantize(t.data, GGMLQuantizationType[t.type_name]).reshape(t.shape)
        )
        if family.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, config.num_heads)
        elif family.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, config.num_kv_heads)
        keep16 = keep_quantized and t.type_name in _SIXTEEN_BITS and len(t.shape) == 2 and name.endswith(_PACKABLE)
        weights[name] = _tensor(
            arr, stored[1] if stored else torch.float32, _SIXTEEN_BITS[t.type_name] if keep16 else dtype
        )
        reporter.step()
    reporter.done()
    tokenizer_metadata = {
        k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"
    }
    return Checkpoint(config=config, weights=weights, path=path, metadata=tokenizer_metadata)


def _packed(
    type_name: str,
    data: np.ndarray,
    shape: tuple[int, ...],
    name: str,
    config: ModelConfig,
    family: Family,
    int8_blocks: bool = False,
) -> PackedWeight:
    """A quantised GGUF weight for the kernels (its own blocks, or repacked), with llama.cpp's
    Q/K row order undone."""
    kind = BlockWeight if int8_blocks and type_name in BLOCK_TYPES else PackedWeight
    packed = kind.from_gguf(type_name, data, (shape[0], shape[1]))
    if family.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
        packed = packed.rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads)))
    return packed


# ------------------------------------------------------------------ Hugging Face folder


def hf_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    family = hf_family(model_type, path)
    heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in rope:  # per layer type (Gemma 3): global layers' RoPE, and the local layers' base
        local_theta = float(rope.get("sliding_attention", {}).get("rope_theta", 10000.0))
        rope = rope["full_attention"]
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(rope["factor"]))
    elif rope_type == "llama3":
        scaling = RopeScaling(
            rope_type="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "longrope":
        scaling = _longrope(rope, raw, path)
    elif rope_type != "default":
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r} in {path / 'config.json'}")
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(f"{path / 'config.json'}: partial rotary embeddings are not supported yet")
    context = int(raw.get("max_position_embeddings", 2048))
    window = window_if_shorter(raw.get("sliding_window"), context) if family.hf_window else None
    if raw.get("use_sliding_window") and not family.hf_window:  # Qwen2: a window on some layers only
        raise ModelLoadError(
            f"{path / 'config.json'}: use_sliding_window (a window on layers from "
            f"max_window_layers on) is not supported yet"
        )
    fields = dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.hf_tied_by_default)),
        rope_scaling=scaling,
        architecture=str(model_type),
        attention_bias=family.hf_attention_bias or bool(raw.get("attention_bias", False)),
        qk_norm=family.hf_qk_norm,
        sliding_window=window,
        num_experts=int(raw.get("num_local_experts", 0)) if family.hf_experts else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if family.hf_experts else 0,
        rope_local_theta=local_theta,
    )
    return ModelConfig(**{**fields, **family.hf_fields(raw, context)})


def _longrope(rope: dict[str, Any], raw: dict[str, Any], path: Path) -> RopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults for the factor and attention factor."""
    original = int(
        rope.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw["max_position_embeddings"]
    )
    factor = float(rope.get("factor") or raw["max_position_embeddings"] / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=tuple(map(float, rope["short_factor"])),
        long_factor=tuple(map(float, rope["long_factor"])),
        attention_factor=float(attention),
    )


def _load_hf_folder(path: Path, dtype: torch.dtype, progress: bool, keep_quantized: bool = False) -> Checkpoint:
    from safetensors.torch import load_file

    raw = _read_config_json(path)
    config = hf_config(raw, path)
    quant = hf_quantization(raw, path)  # AWQ / GPTQ / compressed-tensors / FP8: checked before any weights are read
    offset = family_named(config.architecture).norm_offset
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model folder {path}")
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # layer (its stored name) -> its quantised tensors
    reporter = _Progress("loading weights", len(files), progress)
    for name in files:
        try:
            shard = load_file(str(path / name))
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {path / name}: {e}") from e
        for k, v in shard.items():
            if "rotary_emb" in k:
                continue
            layer, _, part = k.rpartition(".")
            if quant is not None and quant.takes(part, v):
                quantized.setdefault(layer, {})[part] = v  # the stored name: what config groups target
                continue
            k = k.removeprefix("model.")
            if offset and k.endswith("norm.weight"):
                v = v.float() + offset  # stored as w - offset (Gemma's norms multiply by 1 + w)
            weights[k] = v.to(dtype)
        reporter.step()
    reporter.done()
    if quant is not None:
        weights.update(_quantized_weights(quant, quantized, dtype, keep_quantized))
    return Checkpoint(config=config, weights=weights, path=path)


def _quantized_weights(
    quant: FolderQuant, layers: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype, keep_quantized: bool
) -> dict[str, torch.Tensor | PackedWeight]:
    """A quantised folder's linear weights: int4 / int8 kept as the native kernels' blocks
    (``keep_quantized``, groups that are runs of 32s), FP8 in its scale's 16 bits; otherwise
    dequantised to ``dtype``."""
    out: dict[str, torch.Tensor | PackedWeight] = {}
    act_order = []
    for layer, parts in layers.items():
        decoded = quant.decode(parts, layer)
        name = f"{layer.removeprefix('model.')}.weight"
        if isinstance(decoded, torch.Tensor):  # FP8: the float weight, in its scale's dtype
            sixteen = keep_quantized and decoded.dtype in (torch.float16, torch.bfloat16)
            out[name] = decoded if sixteen else decoded.to(dtype)
            continue
        packed = (
            packed_weight(decoded.q, decoded.scale, decoded.minv, decoded.bits, decoded.group, quant.method)
            if keep_quantized
            else None
        )
        if keep_quantized and decoded.group == 1:
            act_order.append(layer)
        out[name] = packed if packed is not None else decoded.dequantize().to(dtype)
    if act_order:
        logger.info(
            "%s act order: %d layers' groups are not runs of their inputs; "
            "those weights are dequantised to %s (e.g. %s)",
            quant.method,
            len(act_order),
            dtype,
            act_order[0],
        )
    for note in quant.notes():
        logger.warning("%s checkpoint with %s", quant.method, note)
    return out


class _Progress:
    """A one-line progress counter on stderr, shown only on a terminal."""

    def __init__(self, what: str, total: int, enabled: bool) -> None:
        self.what, self.total, self.n = what, total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self) -> None:
        self.n += 1
        if self.enabled and (self.n % 16 == 0 or self.n == self.total):
            print(f"\r{self.what}: {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled:
            print(f"\r{self.what}: {self.total}/{self.total} in {time.perf_counter() - self.t0:.1f}s", file=sys.stderr)
