"""KV-cache tensors and their sizing from a memory budget.

``kv_cache_dtype`` picks how K and V are stored: ``auto`` (the model's dtype),
a float dtype, or quantised ``int8`` / ``fp8`` with a bfloat16 scale per token and
head. The number of blocks a budget buys follows the bytes per token of that choice.
"""

from __future__ import annotations

import torch

from tokenmill.configuration.config import ModelConfig
from tokenmill.model.layers.kv_cache import KVCacheLayer
from tokenmill.quant.kv import KV_CACHE_DTYPES, QUANTIZED_KV, SCALE_DTYPE

KVCache = KVCacheLayer
FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V (and their scales) stored per token across all layers."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in QUANTIZED_KV:
        per_head = cfg.head_dim * 1 + SCALE_DTYPE.itemsize
        return 2 * cfg.num_layers * cfg.num_kv_heads * per_head
    storage = dtype if kv_cache_dtype == "auto" else FLOAT_KV[kv_cache_dtype]
    return cfg.kv_bytes_per_token(storage.itemsize)


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block occupies across all layers, K and V."""
    return block_size * kv_bytes_per_token(cfg, dtype, kv_cache_dtype)


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
) -> list[KVCacheLayer]:
    """One KVCacheLayer per layer, K and V each [num_blocks, block_size, kv_heads, head_dim]."""
    check_kv_cache_dtype(kv_cache_dtype)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layers = []
    for _ in range(cfg.num_layers):
        if kv_cache_dtype in QUANTIZED_KV:
            storage = QUANTIZED_KV[kv_cache_dtype][0]
            layers.append(
                KVCacheLayer(
                    torch.zeros(shape, dtype=storage, device=device),
                    torch.zeros(shape, dtype=storage, device=device),
                    dtype,
                    kv_cache_dtype,
                    torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device),
                    torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device),
                )
            )
        else:
            storage = dtype if kv_cache_dtype == "auto" else FLOAT_KV[kv_cache_dtype]
            layers.append(
                KVCacheLayer(
                    torch.zeros(shape, dtype=storage, device=device),
                    torch.zeros(shape, dtype=storage, device=device),
                    dtype,
                )
            )
    return layers
