"""Keeping the runner in step: the block table records what the runner must hear by
itself, and RunnerSync builds every delta and drop from one place."""

from __future__ import annotations

import pytest

from tokenmill.configuration.config import SchedulerConfig
from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.block_table import BlockTable
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.model_input import ModelOutput, SampledToken
from tokenmill.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=True), BS)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 100, frozenset())


def add(s: Scheduler, rid: str, prompt_len: int) -> Request:
    req = Request(rid, [(7 * len(rid) + i) % 50 for i in range(prompt_len)], SamplingParams(max_tokens=50))
    s.add(req)
    return req


def test_a_table_notes_every_change_the_runner_has_not_heard():
    t = BlockTable([5, 6, 7])
    assert t.unsynced() == (0, [5, 6, 7])
    t.mark_synced()
    assert t.unsynced() is None
    t.append(8)  # growth: the tail from the old length
    assert t.unsynced() == (3, [8])
    t.mark_synced()
    t[1] = 9  # a rewrite (copy-on-write): from its index
    assert t.unsynced() == (1, [9, 7, 8])
    t.mark_synced()
    del t[2:]  # a trim: the runner keeps the first two
    assert t.unsynced() is None and t.synced == 2
    t.extend([3])
    t.release(0, 1, -1)  # left a sliding window: never told (attention masks it)
    assert t.unsynced() == (2, [3]) and list(t) == [-1, 9, 3]
    t.clear()
    assert t.synced == 0 and t.unsynced() is None
    with pytest.raises(TypeError, match="by index, slice"):
        t.insert(0, 1)


def test_copy_on_write_and_trim_resend_the_table_from_the_changed_block():
    """A sibling (n > 1) shares its parent's partly filled last block; writing into it takes a
    copy, and the table is sent again from that block on. A trim keeps the rest."""
    kv = KVCacheManager(BlockPool(16, enable_caching=True), BS)
    parent = Request("p", list(range(2 * BS + 2)), SamplingParams())
    assert kv.allocate_slots(parent, parent.num_tokens) == []
    parent.num_computed_tokens = parent.num_tokens
    child = Request("c", list(parent.prompt_token_ids), SamplingParams())
    kv.fork(parent, child, parent.num_tokens)
    child.num_computed_tokens = parent.num_tokens
    child.block_ids.mark_synced()  # the runner got the child's table whole
    child.output_token_ids.append(1)
    copies = kv.allocate_slots(child, BS)  # writes into the shared third block: a copy
    assert len(copies) == 1 and copies[0][0] == parent.block_ids[2]
    assert child.block_ids.unsynced() == (2, list(child.block_ids[2:]))
    child.block_ids.mark_synced()
    kv.trim(child, 2 * BS + 3)
    assert child.block_ids.unsynced() is None and child.block_ids.synced == len(child.block_ids) == 3


def test_drops_are_sent_once_finished_and_preempted_apart():
    s = make(num_blocks=4)
    a = add(s, "a", 2 * BS)
    out = s.schedule()
    s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(1)]}))
    s.finish(a, "abort")
    first = s.schedule().model_input
    assert first.finished_request_ids == ["a"] and first.preempted_request_ids == []
    assert s.runner_sync.drops().finished_request_ids == []  # told once
    b, c = add(s, "b", BS + 1), add(s, "c", BS + 1)
    out = s.schedule()
    s.update_from_output(out, ModelOutput(sampled={"b": [SampledToken(1)], "c": [SampledToken(1)]}))
    for _ in range(2 * BS):  # two blocks each, four in the pool: one of them is preempted
        out = s.schedule()
        if out.preempted:
            break
        s.update_from_output(
            out, ModelOutput(sampled={r.request_id: [SampledToken(1)] for r in (b, c) if r in s.running})
        )
    assert [r.request_id for r in out.preempted] == ["c"]
    assert s.runner_sync.drops().preempted_request_ids == [] and out.model_input.preempted_request_ids == ["c"]
