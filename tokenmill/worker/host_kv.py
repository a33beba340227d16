"""The bytes of the prefix cache's host-memory tier: one buffer of whole KV blocks in host
memory, allocated once (pinned for a CUDA pool, so that the copies are DMA). Which block sits
in which slot is the engine's bookkeeping (``engine/core/kv_host.HostTier``); this buffer only
copies rows between its slots and the pool's blocks."""

from __future__ import annotations

import torch

from tokenmill.model.layers.kv_cache import KVCacheLayer, block_nbytes, read_blocks, write_blocks


class HostKVBuffer:
    def __init__(self, num_slots: int, kv_caches: list[KVCacheLayer], pin: bool = False) -> None:
        self.rows = torch.empty((num_slots, block_nbytes(kv_caches)), dtype=torch.uint8, pin_memory=pin)

    def save(self, kv_caches: list[KVCacheLayer], block_ids: list[int], slots: list[int]) -> None:
        """The pool's blocks ``block_ids`` into ``slots``."""
        self.rows[torch.tensor(slots, dtype=torch.long)] = read_blocks(kv_caches, block_ids)

    def load(self, kv_caches: list[KVCacheLayer], slots: list[int], block_ids: list[int]) -> None:
        """``slots`` into the pool's blocks ``block_ids``."""
        write_blocks(kv_caches, block_ids, self.rows[torch.tensor(slots, dtype=torch.long)])
