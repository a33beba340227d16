"""The prefix cache's host-memory tier: which blocks it holds and in which slot, between the
pool and the disk tier (``kv_tiers``).

An accelerator's pool lives in device memory, which is small beside the host's: blocks the
pool evicts are worth keeping where a hit costs one host-to-device copy instead of a
recompute (vLLM's CPU offloading, SGLang's HiCache host tier). The bytes live in the runner's
buffer (``worker/host_kv.HostKVBuffer``: allocated once, ``num_slots`` blocks, pinned for a
CUDA pool); this side keeps the bookkeeping, as the block pool does for the pool's blocks:
each held block's slot, least recently used first, so that a new block takes the slot of the
least recently used one once every slot is taken. On a CPU the pool is host memory already, so
a larger pool serves better than this tier (it is allowed, and says so once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class HostTierStats:
    hits: int = 0  # blocks read back into the pool
    stored: int = 0  # blocks copied in
    evicted: int = 0  # blocks that gave up their slot to newer ones
    bytes: int = 0  # blocks held, in bytes


class HostTier:
    def __init__(self, num_slots: int, block_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier of {num_slots} slots holds no block")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.stats = HostTierStats()
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.on_drop: Callable[[bytes], None] | None = None  # told of each block that gave up its slot

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._slots)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block's slot (a use: now the most recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int:
        """A slot for a block not held (a free one, else the least recently used block's): the
        caller copies the block's rows into it before the next lookup."""
        assert block_hash not in self._slots, "held already"
        if self._free:
            slot = self._free.pop()
            self.stats.bytes += self.block_bytes
        else:
            dropped, slot = self._slots.popitem(last=False)
            self.stats.evicted += 1
            if self.on_drop is not None:
                self.on_drop(dropped)
        self._slots[block_hash] = slot  # (held from now: the pool evicting it is no "removed" event)
        self.stats.stored += 1
        return slot
