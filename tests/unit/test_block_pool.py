"""The block pool and KV manager against scripted ref counts, hits and evictions."""

from __future__ import annotations

import pytest

from tokenmill.engine.core.block_pool import BlockPool, OutOfBlocksError
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request
from tokenmill.sampling_params import KVEviction, SamplingParams

BS = 4


def req(tokens, rid="r"):
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams())


def computed(kv, r, n):
    """As the scheduler does after a step: n tokens are now in the cache."""
    r.num_computed_tokens = n
    kv.cache_computed_blocks(r)


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free of 4"):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4


def test_prefix_hit_reuses_blocks_and_skips_their_tokens():
    kv = KVCacheManager(BlockPool(8), BS)
    a = req(range(10), "a")
    assert kv.find_cached_prefix(a) == []
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)  # blocks 0,1 full and cached; block 2 partial
    b = req([*range(8), 99, 98, 97], "b")  # same first two blocks
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    kv.allocate_slots(b, 3, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a.block_ids] == [2, 2, 1]
    assert kv.stats.hits == 8 and kv.stats.queries == 10 + 11


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(BlockPool(8), BS)
    a = req(range(8), "a")
    kv.allocate_slots(a, 8)
    computed(kv, a, 8)
    b = req(range(8), "b")
    assert len(kv.find_cached_prefix(b)) == 1  # not both: the last token's block is recomputed


def test_freed_cached_blocks_survive_until_evicted_lru_first():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    a = req(range(9), "a")
    kv.allocate_slots(a, 9)
    computed(kv, a, 9)
    head, tail, partial = a.block_ids
    kv.free(a)
    assert pool.num_free == 4 and pool.num_cached_free == 2
    hashes = kv._hashes(req(range(9)), 2)
    assert [pool.lookup(h) is not None for h in hashes] == [True, True]
    # the partial (uncached) block is reused first; then the tail block of the chain
    x = pool.allocate(1)
    assert pool.num_cached_free == 2
    y = pool.allocate(1)
    assert sorted(x + y) == sorted({0, 1, 2, 3} - {head, tail})  # the never-cached blocks go first
    z = pool.allocate(1)
    assert z == [tail] and pool.num_cached_free == 1  # then the chain's tail is evicted
    assert pool.lookup(hashes[1]) is None
    assert pool.lookup(hashes[0]) == head  # the head survives longest


def test_copy_on_write_for_shared_partial_block():
    kv = KVCacheManager(BlockPool(8, enable_caching=False), BS)
    a = req(range(6), "a")
    kv.allocate_slots(a, 6)
    computed(kv, a, 6)
    b = req(range(6), "b")
    kv.fork(a, b, 6)
    b.num_computed_tokens = 5  # b recomputes the last prompt token into the shared block 1
    copies = kv.allocate_slots(b, 1)
    assert copies == [(a.block_ids[1], b.block_ids[1])]
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert kv.pool.blocks[a.block_ids[1]].ref_cnt == 1
    assert kv.allocate_slots(a, 1) == []  # a's block is its own again: no copy


def test_allocation_failure_changes_nothing():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    a = req(range(20), "a")
    assert kv.allocate_slots(a, 20) is None
    assert a.block_ids == [] and pool.num_free == 3


def test_streaming_eviction_frees_the_blocks_between_sinks_and_window():
    kv = KVCacheManager(BlockPool(16), BS)
    ev = KVEviction(window=8, sinks=1)  # sinks: one block (4 tokens); stride: one block; budget 4 + 8 + 4 = 16
    assert (ev.sink_tokens(BS), ev.stride(BS), ev.budget(BS)) == (4, 4, 16)
    r = Request(request_id="r", prompt_token_ids=list(range(15)), params=SamplingParams(kv_eviction=ev))
    kv.allocate_slots(r, 15)
    r.num_computed_tokens = 15
    kv.cache_computed_blocks(r)
    kv.evict(r)  # 15 held: under the budget
    assert r.num_evicted_tokens == 0 and len(r.block_ids) == 4
    assert all(kv.pool.blocks[b].block_hash is None for b in r.block_ids), "evicting: never in the prefix cache"
    r.output_token_ids.append(7)
    kv.allocate_slots(r, 1)
    r.num_computed_tokens = 16
    sink, dropped, *kept = list(r.block_ids)
    kv.evict(r)  # 16 held: the block after the sink goes, the last 8 tokens stay (and the sink)
    assert r.num_evicted_tokens == 4 and r.num_kv_tokens == 12
    assert list(r.block_ids) == [sink, *kept] and r.block_ids.synced == 0
    assert kv.pool.num_free == 16 - 3 and kv.evicted_tokens == 4
    r.output_token_ids.append(8)
    kv.allocate_slots(r, 1)  # the next token's slot: the cache's 13th, in a fourth block
    assert len(r.block_ids) == 4
    kv.free(r)
    assert kv.pool.num_free == 16
