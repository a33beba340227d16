"""KV-cache tensors and their sizing from a memory budget."""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers, K and V."""
    return block_size * cfg.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())


def num_blocks_for_memory(cfg: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    return memory_bytes // block_bytes(cfg, block_size, dtype)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[KVCache]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
