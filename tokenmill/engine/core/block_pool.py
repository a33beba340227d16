"""The pool of KV-cache blocks (ids and bookkeeping, no tensors).

Each block has a reference count and, once full and computed, a content hash. Free
blocks wait in an LRU queue (an ``OrderedDict`` used as an O(1) linked list):

    free queue:  front [ never-cached ... | cached, least recently freed ... most ] back
                   taken first by allocate()                      evicted last

A freed block keeps its hash, so a later request with the same prefix can take it
back out of the queue (a prefix-cache hit); its content is lost only when
``allocate`` reaches it and evicts it. Blocks with no reusable content go to the front,
so that they are reused before any cached block is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

FREE, CACHED, USED, SHARED, HIT = 0, 1, 2, 3, 4  # block_states(): a state, HIT or'ed in


class OutOfBlocksError(RuntimeError):
    """Raised when a caller asks for more blocks than are free."""


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and its K/V computed


class BlockPool:
    """``record_events``: keep a log of the prefix cache's changes, ("stored", hash)
    when a content enters it and ("removed", hash) when it leaves (evicted), for a
    router that sends requests to where their prefix is cached (``take_events``)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._num_cached_free = 0  # free blocks that still hold a hash (kept as we go: read every step)
        self._events: list[tuple[str, bytes]] | None = [] if record_events else None
        self._hits: set[int] | None = None  # blocks taken from the prefix cache since block_states() (start_hit_log)
        # The contents a tier below the pool holds (kv_tiers: the host tier's), a part of this
        # engine's prefix cache for a router: the pool's eviction of one is then no "removed"
        # event, and the tier says when it drops one (dropped_below).
        self.below: Collection[bytes] = ()

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return self._num_cached_free

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by lookup (out of the free queue if idle)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self._free[b]
                self._num_cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def log_hits(self, block_ids: list[int]) -> None:
        """A prefix-cache hit took these blocks (shown by ``block_states`` once ``start_hit_log``)."""
        if self._hits is not None:
            self._hits.update(block_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            block = self.blocks[b]
            if block.block_hash is not None:  # evict its cached content
                self._num_cached_free -= 1
                if self._cached.get(block.block_hash) == b:
                    del self._cached[block.block_hash]
                    if self._events is not None and block.block_hash not in self.below:
                        self._events.append(("removed", block.block_hash))
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(b)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass a sequence's blocks tail first."""
        for b in block_ids:
            block = self.blocks[b]
            assert block.ref_cnt > 0, f"block {b} freed more times than referenced"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[b] = None
                if block.block_hash is None:
                    self._free.move_to_end(b, last=False)
                else:
                    self._num_cached_free += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Record that a full, computed block holds the content named by block_hash."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None
        block.block_hash = block_hash
        if block_hash not in self._cached:  # else an identical block is cached already
            self._cached[block_hash] = block_id
            if self._events is not None:
                self._events.append(("stored", block_hash))

    def start_events(self) -> None:
        """Record from now on, starting with a "stored" event per block cached already, in the
        pool or below it (a router that starts listening late learns the whole cache)."""
        if self._events is None:
            self._events = [("stored", h) for h in self._cached]
            self._events += [("stored", h) for h in self.below if h not in self._cached]

    def dropped_below(self, block_hash: bytes) -> None:
        """A tier below dropped a content: gone from this engine unless the pool holds it."""
        if self._events is not None and block_hash not in self._cached:
            self._events.append(("removed", block_hash))

    def take_events(self) -> list[tuple[str, bytes]]:
        """The prefix cache's changes since the last call, in order (empty unless recorded)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def start_hit_log(self) -> None:
        """Remember the blocks prefix-cache hits take, for ``block_states`` (a live view)."""
        if self._hits is None:
            self._hits = set()

    def stop_hit_log(self) -> None:
        self._hits = None

    def block_states(self) -> bytes:
        """A picture of the pool, one byte per block: FREE, CACHED (free, content kept),
        USED (one reference) or SHARED (several), plus HIT when a prefix-cache hit took the
        block since the last call (``start_hit_log``; bounded: a set of block ids)."""
        states = bytearray(self.num_blocks)
        for block in self.blocks:
            if block.ref_cnt:
                states[block.block_id] = USED if block.ref_cnt == 1 else SHARED
            elif block.block_hash is not None:
                states[block.block_id] = CACHED
        if self._hits:
            for b in self._hits:
                states[b] |= HIT
            self._hits.clear()
        return bytes(states)

    def check_invariants(self, referenced: dict[int, int]) -> None:
        """Tests: ``referenced`` maps block id -> references held by live sequences."""
        for block in self.blocks:
            expected = referenced.get(block.block_id, 0)
            assert block.ref_cnt == expected, f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected}"
            assert (block.block_id in self._free) == (expected == 0), f"block {block.block_id} misplaced"
        for h, b in self._cached.items():
            assert self.blocks[b].block_hash == h, f"cached hash of block {b} is stale"
        cached_free = sum(1 for b in self._free if self.blocks[b].block_hash is not None)
        assert self._num_cached_free == cached_free, f"cached-free count {self._num_cached_free} != {cached_free}"
