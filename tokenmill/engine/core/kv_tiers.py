"""The prefix cache's tiers below the pool, fastest first: host memory (``kv_host``), then
disk (``kv_disk``); either may be absent.

    pool  --cached blocks, as computed-->  host tier  -->  disk tier
          <--a prefix-cache miss: host first, then disk (a disk hit kept in host too)--

Blocks are copied down as they are cached in the pool, so the pool never waits for a copy
when it evicts, and a block the pool evicts is already below. A miss in the pool reads the
leading blocks the tiers hold into free pool blocks and caches them there, as the pool's own
hits. The engine side keeps which block is where; the runner holds the bytes and copies them
(``TierRows``), as for KV moving between replicas (``kv_transfer``).

A router of replicas learns what each holds from its KV events (``BlockPool.take_events``):
a block in the host tier is held, so the pool's eviction of it says nothing, and the host tier
dropping it says "removed" (unless the pool holds it again). The disk tier is left out: replicas
on one machine share its directory, so it holds the same blocks for all of them.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.kv_disk import DiskTier
from tokenmill.engine.core.kv_host import HostTier
from tokenmill.engine.core.kv_transfer import BlockRows


class TierRows(BlockRows, Protocol):
    """The runner's side: its blocks' rows out and in, and to and from its host buffer's slots."""

    def save_to_host(self, block_ids: list[int], slots: list[int]) -> None: ...
    def load_from_host(self, slots: list[int], block_ids: list[int]) -> None: ...


class KVTiers:
    def __init__(self, pool: BlockPool, runner: TierRows, host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None, "no tier"
        self.host, self.disk = host, disk
        self._pool, self._runner = pool, runner
        if host is not None:  # what it holds is this engine's too, for a router (the pool's KV events)
            pool.below = host
            host.on_drop = pool.dropped_below

    def store(self, blocks: list[tuple[int, bytes]]) -> None:
        """Blocks just cached in the pool (id, hash): copied now (the next step may reuse a
        block) into host slots, and their rows handed to the disk tier's writer."""
        if self.host is not None:
            self._store_host(blocks)
        disk = self.disk
        if disk is not None:
            down = _first_of_each([(b, h) for b, h in blocks if h not in disk])
            if down:
                rows = self._runner.export_blocks([b for b, _ in down])
                for (_, h), row in zip(down, rows, strict=True):
                    disk.put(h, row.numpy().tobytes())

    def load(self, hashes: list[bytes], held: list[int]) -> int:
        """The leading ``hashes`` the tiers hold, read into free pool blocks and cached there
        (never evicting ``held``, the prefix found in the pool already; idle again after, the
        most recently used), no more read than the pool has free blocks (a miss costs one
        lookup a tier). Returns how many."""
        pool = self._pool
        pool.touch(held)  # held while allocating, so that none of them is the block evicted
        ids: list[int] = []
        try:
            hashes = hashes[: pool.num_free]
            slots: list[int] = []  # the leading run in host memory
            while self.host is not None and len(slots) < len(hashes):
                slot = self.host.lookup(hashes[len(slots)])
                if slot is None:
                    break
                slots.append(slot)
            payloads: list[memoryview] = []  # then the run on disk
            while self.disk is not None and len(slots) + len(payloads) < len(hashes):
                data = self.disk.get(hashes[len(slots) + len(payloads)])
                if data is None:
                    break
                payloads.append(data)
            ids = pool.allocate(len(slots) + len(payloads))
            if slots:
                self._runner.load_from_host(slots, ids[: len(slots)])
                self.host.stats.hits += len(slots)  # type: ignore[union-attr]
            if payloads:
                self._runner.import_blocks(ids[len(slots) :], bytearray().join(payloads))  # (one copy, writable)
                if self.host is not None:  # the next hit on them costs no disk read
                    self._store_host(list(zip(ids[len(slots) :], hashes[len(slots) : len(ids)], strict=True)))
            for b, h in zip(ids, hashes, strict=False):
                pool.cache(b, h)
        finally:
            pool.free((held + ids)[::-1])
        return len(ids)

    def _store_host(self, blocks: list[tuple[int, bytes]]) -> None:
        """Slots reserved (the least recently used blocks' once all are taken), then filled: each
        content once (two requests may cache the same one in a step), and no more than the tier
        holds, the leading ones (a chain's first blocks are what any hit needs), so that no two
        of them are given the same slot."""
        host = self.host
        assert host is not None
        up = _first_of_each([(b, h) for b, h in blocks if h not in host])[: host.num_slots]
        if up:
            self._runner.save_to_host([b for b, _ in up], [host.reserve(h) for _, h in up])

    def close(self) -> None:
        """Write what the disk tier has queued (the next engine on its directory starts with it)."""
        if self.disk is not None:
            self.disk.close()


def _first_of_each(blocks: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """(block, hash) pairs, the first block of each hash (the others hold the same K/V)."""
    seen: set[bytes] = set()
    return [(b, h) for b, h in blocks if not (h in seen or seen.add(h))]
