"""A checkpoint's non-weight files as a Hugging Face folder: ``config.json``, the tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template and BOS/EOS) and
``generation_config.json``, so that a model loaded from a GGUF can be written back as a
folder other tools read (``tokenmill quantize``).

From a GGUF these are built from our ``ModelConfig`` and the GGUF's tokenizer (already a
``tokenizers.Tokenizer``, saved as it is); only plain Llama files are exported, where every
field of transformers' ``LlamaConfig`` is known. From a folder its own files are copied
(``config.json`` without any earlier ``quantization_config``) for the families whose
tensors keep their names and values through our loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tokenmill.configuration.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.tokenizer import Tokenizer

GGUF_EXPORTABLE = ("llama",)
FOLDER_EXPORTABLE = ("llama", "mistral", "qwen2", "qwen3")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_exportable(config: ModelConfig, source: Path, weight_names: set[str]) -> None:
    """Refuse, by name, what cannot be written back as a folder of the same model."""
    allowed = FOLDER_EXPORTABLE if source.is_dir() else GGUF_EXPORTABLE
    if config.architecture not in allowed:
        kind = "a folder" if source.is_dir() else "a GGUF"
        raise ModelLoadError(
            f"cannot export {config.architecture!r} from {kind} ({source}) as a Hugging Face folder; "
            f"supported: {', '.join(allowed)}"
        )
    if config.num_experts:
        raise ModelLoadError(f"{source}: mixture-of-experts models are not exported (experts are not linears here)")
    if not source.is_dir() and (config.sliding_window is not None or config.qk_norm or config.attention_bias):
        raise ModelLoadError(f"{source}: a GGUF Llama with windows, q/k norms or biases has no plain LlamaConfig")
    if "rope_freqs" in weight_names:
        raise ModelLoadError(f"{source}: RoPE frequency factors (Llama 3.1 scaling) are not exported from a GGUF")


def write_model_files(
    folder: Path, source: Path, config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype
) -> None:
    """config.json (without quantization_config), tokenizer files and generation config."""
    folder.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        _copy_folder_files(source, folder, dtype)
        return
    (folder / "config.json").write_text(json.dumps(llama_config_json(config, tokenizer, dtype), indent=2) + "\n")
    write_tokenizer(folder, tokenizer, config.max_position_embeddings)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": _eos_ids(tokenizer)}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def llama_config_json(config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' LlamaConfig fields for ``config`` (RoPE both as the legacy
    ``rope_theta`` / ``rope_scaling`` and as transformers 5's ``rope_parameters``)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = None
    if config.rope_scaling is not None:
        scaling = {"rope_type": config.rope_scaling.rope_type, "factor": config.rope_scaling.factor}
        rope = {**scaling, "rope_theta": config.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": DTYPE_NAMES[dtype],
        "dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
    }


def write_tokenizer(folder: Path, tokenizer: Tokenizer, max_length: int) -> None:
    """tokenizer.json (the backend as it is: pre-tokenizer, special tokens, BOS post-processor)
    and tokenizer_config.json (BOS/EOS by text, the chat template)."""
    tokenizer.backend.save(str(folder / "tokenizer.json"))

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.token_to_str(token_id)

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tokenizer.bos_token_id),
        "eos_token": text(tokenizer.eos_token_id),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _eos_ids(tokenizer: Tokenizer) -> int | list[int] | None:
    """The EOS id, with the end-of-turn tokens we stop at after it (a chat model's
    ``<|im_end|>`` and the like), as generation_config lists them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += sorted(i for i in tokenizer.stop_token_ids if i not in ids)
    return ids[0] if len(ids) == 1 else ids or None


def _copy_folder_files(source: Path, folder: Path, dtype: torch.dtype) -> None:
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != "config.json":
            shutil.copy2(f, folder / f.name)
    raw = json.loads((source / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw["torch_dtype"] = raw["dtype"] = DTYPE_NAMES[dtype]
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
