"""KV-cache bookkeeping per request: prefix lookup, slot allocation, copy-on-write, free.

Works in block ids only. Block hashes chain: a full block's hash covers its
parent's hash and its own token ids, so equal hashes mean equal whole prefixes.

    tokens:  [ b0: 16 tokens ][ b1: 16 tokens ][ b2: 7 tokens ...
    hashes:   h0 = H(-, b0)    h1 = H(h0, b1)    (partial: no hash)

With a sliding window (Mistral), a block whose every position is before the
window of any query still to come goes back to the pool (``free_outside_window``);
its entry in the request's table becomes ``FREED`` (the runner keeps reading a
stale id there, masked out by attention, so it is never told: ``BlockTable.release``).
Every other change to a table is the runner's to hear about, which the table records
by itself (engine/core/block_table.py).

A request with ``KVEviction`` (StreamingLLM) drops blocks instead: past its budget the
blocks after its sink blocks leave the table, ``num_evicted_tokens`` grows by their tokens,
and the runner, told that count with each step, re-rotates the kept keys to their new
places (``evict``). Its table then holds the cache, not the token stream: slot i holds the
i-th kept token, at position i. With SnapKV the runner compresses a long prompt once read
(the chosen tokens moved to its first slots, their positions kept): the slots past them go.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.request import Request

FREED = -1  # a block-table entry whose block left the sliding window and went back to the pool


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.stats = PrefixCacheStats()
        self.evicted_tokens = 0  # tokens whose K/V requests evicted (``KVEviction``), in all
        # The tiers below the pool (kv_tiers.KVTiers): ``lower(hashes, held)`` caches in the pool
        # the leading blocks of ``hashes`` it holds and says how many; the blocks cached since
        # ``take_newly_cached`` are what it stores. None: the pool alone.
        self.lower: Callable[[list[bytes], list[int]], int] | None = None
        self._newly_cached: list[tuple[int, bytes]] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first num_blocks full blocks (computed once, kept)."""
        return self.block_hashes(req, 0, num_blocks)

    def block_hashes(self, req: Request, first: int, end: int) -> list[bytes]:
        """Hashes of the request's full blocks [first, end) (computed once, kept)."""
        if len(req.block_hashes) < end:
            tokens = req.all_token_ids
            bs = self.block_size
            for i in range(len(req.block_hashes), end):
                parent = req.block_hashes[-1] if req.block_hashes else req.hash_root
                req.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return req.block_hashes[first:end]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering the longest run of full blocks of the request's tokens.

        Stops before the block holding the last token: that token is always computed
        (its logits are needed), and a shared cached block is never written to.
        """
        if not self.pool.enable_caching or req.evicts:
            return []
        hits: list[int] = []
        hashes = self._hashes(req, (req.num_tokens - 1) // self.block_size)
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if self.lower is not None and len(hits) < len(hashes) and self.lower(hashes[len(hits) :], hits):
            for h in hashes[len(hits) :]:
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def take_newly_cached(self) -> list[tuple[int, bytes]]:
        """The (block, hash) pairs cached since the last call (recorded only with a ``lower`` tier)."""
        taken, self._newly_cached = self._newly_cached, []
        return taken

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached_prefix: list[int] | None = None
    ) -> list[tuple[int, int]] | None:
        """Make room for num_new_tokens after the computed ones (and after cached_prefix,
        which is adopted). Returns the (src, dst) block copies that copy-on-write needs,
        or None, changing nothing, when too few blocks are free."""
        cached_prefix = cached_prefix or []
        assert not cached_prefix or not req.block_ids, "a cached prefix is adopted only at admission"
        bs = self.block_size
        num_computed = req.num_kv_tokens + len(cached_prefix) * bs
        have = len(req.block_ids) + len(cached_prefix)
        num_new_blocks = max(0, self.blocks_for(num_computed + num_new_tokens) - have)
        shared = [
            i for i in range(num_computed // bs, len(req.block_ids)) if self.pool.blocks[req.block_ids[i]].ref_cnt > 1
        ]
        idle_hits = sum(1 for b in cached_prefix if self.pool.blocks[b].ref_cnt == 0)
        if num_new_blocks + len(shared) > self.pool.num_free - idle_hits:
            return None
        if req.num_computed_tokens == 0 and not req.block_ids and self.pool.enable_caching:
            self.stats.queries += req.num_tokens  # counted once per admission
            self.stats.hits += len(cached_prefix) * bs
        if cached_prefix:
            self.pool.touch(cached_prefix)
            self.pool.log_hits(cached_prefix)
            req.block_ids.extend(cached_prefix)
            req.num_cached_blocks = len(cached_prefix)
        copies = []
        for i in shared:  # copy-on-write: this request is about to write into block i
            src = req.block_ids[i]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            req.block_ids[i] = dst
            copies.append((src, dst))
            req.num_cached_blocks = min(req.num_cached_blocks, i)
        req.block_ids.extend(self.pool.allocate(num_new_blocks))
        return copies

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly full and computed blocks in the prefix cache."""
        if not self.pool.enable_caching or req.evicts:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= req.num_cached_blocks:
            return
        hashes = self._hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            if self.pool.blocks[req.block_ids[i]].block_hash is None:
                self.pool.cache(req.block_ids[i], hashes[i])
                if self.lower is not None:
                    self._newly_cached.append((req.block_ids[i], hashes[i]))
        req.num_cached_blocks = num_full

    def free_outside_window(self, req: Request) -> None:
        """Give back the blocks no later query of the request can see: the next query
        is at position num_computed_tokens or later and sees back to that position minus
        window - 1. (Registered in the prefix cache first, they stay reusable until
        evicted.)"""
        if self.sliding_window is None:
            return
        first_seen = req.num_computed_tokens - self.sliding_window + 1
        n = min(max(0, first_seen) // self.block_size, len(req.block_ids))
        if n <= req.num_freed_blocks:
            return
        self.pool.free([b for b in req.block_ids[req.num_freed_blocks : n] if b != FREED][::-1])
        req.block_ids.release(req.num_freed_blocks, n, FREED)
        req.num_freed_blocks = n

    def evict(self, req: Request) -> None:
        """After a step (``KVEviction``). StreamingLLM: once the request holds its budget
        (sinks, window and a stride), the whole blocks between its sink blocks and its last
        ``window`` computed tokens go back to the pool and out of its table; the runner
        re-rotates the kept keys when it next sees ``num_evicted_tokens``. SnapKV: the slots
        past a compressed prompt's window (``_compressed``)."""
        ev = req.params.kv_eviction
        bs = self.block_size
        if ev is not None and not ev.streams:
            self._compressed(req, ev.window)
            return
        if ev is None or req.num_kv_tokens < ev.budget(bs):
            return
        sinks = ev.sink_tokens(bs) // bs
        n = (req.num_kv_tokens - sinks * bs - ev.window) // bs
        self.pool.free(req.block_ids[sinks : sinks + n][::-1])
        del req.block_ids[sinks : sinks + n]
        req.num_evicted_tokens += n * bs
        self.evicted_tokens += n * bs

    def _compressed(self, req: Request, window: int) -> None:
        """SnapKV: the step that read a prompt longer than ``window`` to its end left only
        ``window`` of its tokens' K/V, in its first slots (the runner chose and moved them
        in that step): the slots after them go back to the pool."""
        prompt = len(req.prompt_token_ids)
        if req.num_evicted_tokens or req.num_computed_tokens != prompt or prompt <= window:
            return
        req.num_evicted_tokens = prompt - window
        self.evicted_tokens += prompt - window
        self.trim(req, req.num_tokens)

    @staticmethod
    def runner_table(req: Request) -> list[int]:
        """The table as the runner receives it whole (a new or resumed request): freed
        entries as block 0, a valid index attention masks out."""
        return [max(b, 0) for b in req.block_ids] if req.num_freed_blocks else list(req.block_ids)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first num_tokens tokens (never computed
        ones: the blocks freed hold only draft or lookahead slots)."""
        keep = self.blocks_for(num_tokens - req.num_evicted_tokens)
        if len(req.block_ids) > keep:
            assert req.num_kv_tokens <= keep * self.block_size
            self.pool.free(req.block_ids[keep:][::-1])
            del req.block_ids[keep:]

    def fork(self, src: Request, dst: Request, num_tokens: int) -> None:
        """dst shares src's blocks holding the first num_tokens tokens (copy-on-write later)."""
        assert not dst.block_ids
        shared = src.block_ids[: self.blocks_for(num_tokens)]
        self.pool.touch([b for b in shared if b != FREED])
        dst.block_ids.extend(shared)
        dst.num_freed_blocks = src.num_freed_blocks
        dst.num_cached_blocks = min(src.num_cached_blocks, num_tokens // self.block_size)

    def free(self, req: Request) -> None:
        held = req.block_ids[req.num_freed_blocks :]
        self.pool.free(held[::-1])  # tail first: evicted before the shared head
        req.block_ids.clear()
        req.num_freed_blocks = 0
        req.num_cached_blocks = 0
