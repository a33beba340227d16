"""KV transfer: the part of an engine that engine replicas attach to (replicas/). It
reports the prefix cache's changes ("stored" / "removed", block hash: what a replica's
router follows, ``replicas.replica_router``) and moves cached KV between engines: a prefill
replica exports the blocks of a prompt, a decode replica imports them into its own
prefix cache, so that the request starts there as on a cache hit.

The core owns the blocks and the runner the tensors; this only pairs them (block ids
from the pool, rows from the runner) and never schedules anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenmill.engine.core.block_pool import BlockPool


class BlockRows(Protocol):
    """The runner's side: KV rows of blocks, out and in."""

    def export_blocks(self, ids: list[int]) -> Any: ...
    def import_blocks(self, ids: list[int], data: Any, first_row: int = 0) -> None: ...


class KVTransfer:
    def __init__(self, block_pool: BlockPool, runner: BlockRows) -> None:
        self._pool, self._runner = block_pool, runner

    def start_events(self) -> None:
        """Turn on ``take_events`` (an engine built without ``record_kv_events``)."""
        self._pool.start_events()

    def take_events(self) -> list[tuple[str, bytes]]:
        """The prefix cache's changes since the last call, in order."""
        return self._pool.take_events()

    def export(self, hashes: Sequence[bytes]) -> tuple[int, Any]:
        """The KV of the leading blocks of ``hashes`` this engine's prefix cache holds, as
        (how many, the runner's raw rows)."""
        ids = []
        for h in hashes:
            b = self._pool.lookup(h)
            if b is None:
                break
            ids.append(b)
        return len(ids), (self._runner.export_blocks(ids) if ids else None)

    def load(self, hashes: Sequence[bytes], data: Any) -> int:
        """Put KV exported by ``export`` (row i: the block of ``hashes[i]``; a tensor or its
        raw bytes) into this engine's prefix cache. Blocks cached already are kept; the
        others take free blocks (evicting the least recently used cached ones) while there
        are some. Returns the leading blocks now cached."""
        pool = self._pool
        if not pool.enable_caching:
            return 0
        found: list[int] = []
        for h in hashes:
            b = pool.lookup(h)
            if b is None:
                break
            found.append(b)
        return len(found) + cache_rows(pool, self._runner, found, hashes[len(found) :], data, len(found))


def cache_rows(
    pool: BlockPool, runner: BlockRows, held: list[int], hashes: Sequence[bytes], data: Any, first_row: int = 0
) -> int:
    """KV rows of the blocks of ``hashes`` (``data`` from row ``first_row`` on: an export's tensor
    or raw bytes) put into free pool blocks and cached there, as many as are free: the least
    recently used cached blocks evicted for them, never ``held`` (blocks the caller found cached
    already; idle again after, the most recently used). Returns how many were cached."""
    pool.touch(held)  # held while allocating, so that none of them is the block evicted
    ids: list[int] = []
    try:
        ids = pool.allocate(min(len(hashes), pool.num_free))
        if ids:
            runner.import_blocks(ids, data, first_row=first_row)
            for b, h in zip(ids, hashes, strict=False):
                pool.cache(b, h)
    finally:
        pool.free((held + ids)[::-1])
    return len(ids)
