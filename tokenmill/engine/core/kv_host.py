"""The prefix cache's host-memory tier: full KV blocks kept in one buffer of host memory,
a slot per block, between the pool and the disk tier (``kv_tiers``).

An accelerator's pool lives in device memory, which is small beside the host's: blocks the
pool evicts are worth keeping where a hit costs one host-to-device copy instead of a
recompute (vLLM's CPU offloading, SGLang's HiCache host tier). The buffer is allocated
once, as ``max_bytes // block_bytes`` slots (pinned when the pool is on CUDA, so that the
copies are DMA), and never grows: past it, the least recently used blocks give up their
slots. On a CPU the pool is host memory already, so a larger pool serves better than this
tier (it is allowed, and says so once).

The tier knows hashes and rows only; ``kv_tiers.KVTiers`` pairs it with the block pool and
the runner's rows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class HostTierStats:
    hits: int = 0  # blocks read back into the pool
    stored: int = 0  # blocks copied in
    evicted: int = 0  # blocks that gave up their slot to newer ones
    bytes: int = 0  # blocks held, in bytes


class HostTier:
    def __init__(self, max_bytes: int, block_bytes: int, pin: bool = False) -> None:
        slots = max_bytes // block_bytes
        if slots < 1:
            raise ValueError(f"a host tier of {max_bytes} bytes holds no block of {block_bytes} bytes")
        self.block_bytes = block_bytes
        self.num_slots = slots
        self.stats = HostTierStats()
        self._buffer = torch.empty((slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(slots - 1, -1, -1))

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's row (a view of the buffer: copy it before the next ``put``), or None."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return None
        self._slots.move_to_end(block_hash)
        self.stats.hits += 1
        return self._buffer[slot]

    def put(self, block_hash: bytes, row: torch.Tensor) -> None:
        """Keep the block's row (``block_bytes`` bytes), evicting the least recently used."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if row.shape != (self.block_bytes,) or row.dtype != torch.uint8:
            raise ValueError(f"a KV row of shape {tuple(row.shape)} ({row.dtype}) is not {self.block_bytes} bytes")
        if self._free:
            slot = self._free.pop()
            self.stats.bytes += self.block_bytes
        else:
            _, slot = self._slots.popitem(last=False)
            self.stats.evicted += 1
        self._buffer[slot].copy_(row)
        self._slots[block_hash] = slot
        self.stats.stored += 1
