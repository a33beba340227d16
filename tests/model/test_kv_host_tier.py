"""The prefix cache's host-memory tier in an engine: blocks the pool evicted come back from
host memory on a hit, answering as before; with the disk tier below, a block read from disk
is kept in host memory for the next hit."""

from __future__ import annotations

from pathlib import Path

from tokenmill import LLM, SamplingParams

TEXT = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
FIRST, OTHER = TEXT[:2400], TEXT[2400:4800]  # ~470 tokens each
GREEDY = SamplingParams(max_tokens=8, temperature=0)
POOL = "26MiB"  # 36 blocks of 720 KiB (135M, float32 K/V): one prompt's blocks, not two


def engine(**options) -> LLM:
    return LLM(dtype="float32", progress=False, kv_cache_memory=POOL, **options)


def answer(llm: LLM, text: str) -> tuple[list[int], int, int]:
    """(greedy tokens, prompt tokens, prefix-cache hits among them)."""
    stats = llm.engine.core.prefix_cache_stats
    before = stats.hits
    out = llm.generate([text], GREEDY)[0]
    return list(out.outputs[0].token_ids), len(out.prompt_token_ids), stats.hits - before


def test_blocks_the_pool_evicted_come_back_from_host_memory():
    with engine() as llm:
        expected, prompt, _ = answer(llm, FIRST)
        answer(llm, OTHER)
        assert answer(llm, FIRST)[2] <= prompt // 2, "the pool kept the first prompt: nothing to test"
    with engine(kv_host_cache="48MiB") as llm:
        core = llm.engine.core
        assert answer(llm, FIRST)[0] == expected
        answer(llm, OTHER)  # its blocks take the pool's
        again, _, hits = answer(llm, FIRST)
        snap = core.snapshot()
        assert again == expected and hits == (prompt - 1) // 16 * 16  # all but the last, partial block
        assert snap.kv_host_hits >= prompt // 32 and snap.kv_host_stored >= 2 * ((prompt - 1) // 16)
        assert snap.kv_host_evicted == 0 and snap.kv_host_bytes == snap.kv_host_stored * core.tiers.host.block_bytes


def test_a_block_read_from_disk_stays_in_host_memory(tmp_path):
    with engine(kv_disk_cache=str(tmp_path)) as llm:
        expected, prompt, _ = answer(llm, FIRST)
    with engine(kv_disk_cache=str(tmp_path), kv_host_cache="48MiB") as llm:
        core = llm.engine.core
        again, _, hits = answer(llm, FIRST)  # a restart: from disk, into host memory too
        reads = core.snapshot().kv_disk_hits
        assert again == expected and hits == (prompt - 1) // 16 * 16 and reads == hits // 16
        answer(llm, OTHER)
        again, _, hits = answer(llm, FIRST)
        snap = core.snapshot()
        assert again == expected and hits == (prompt - 1) // 16 * 16
        assert snap.kv_disk_hits == reads and snap.kv_host_hits >= prompt // 32  # this time from host memory alone


def test_a_host_tier_smaller_than_a_block_is_refused():
    import pytest

    from tokenmill.errors import TokenmillError

    with pytest.raises(TokenmillError, match="kv_host_cache must hold one KV block"):
        engine(kv_host_cache="64KiB")


def test_a_router_counts_the_host_tiers_blocks_as_the_engines():
    """The KV events a replica router reads: a prompt's blocks the pool evicted but the host
    tier holds are still this engine's (no "removed"); without the tier they are gone; once
    the host tier drops them too, they are "removed". The router's view is what the engine holds."""
    from tokenmill.replicas.replica_router import ReplicaState, prompt_block_hashes

    held = {}
    for host in (None, "48MiB", "24MiB"):  # none, room for both prompts, for 34 blocks (one and a bit)
        with engine(**({} if host is None else {"kv_host_cache": host})) as llm:
            core = llm.engine.core
            core.kv_transfer.start_events()
            state = ReplicaState("r")
            ids = llm.generate([FIRST], GREEDY)[0].prompt_token_ids
            first = prompt_block_hashes(ids, 16)[: (len(ids) - 1) // 16]
            state.apply(core.kv_transfer.take_events())
            assert state.matched(first) == len(first)
            answer(llm, OTHER)
            state.apply(core.kv_transfer.take_events())
            below = core.tiers.host if core.tiers is not None else ()
            actual = next(
                (i for i, h in enumerate(first) if core.block_pool.lookup(h) is None and h not in below), None
            )
            held[host] = state.matched(first)
            assert held[host] == (len(first) if actual is None else actual)
    assert held[None] < len(first) // 2 and held["48MiB"] == len(first) and held["24MiB"] == held[None]


def test_a_step_caching_more_blocks_than_the_tier_holds_and_twice_the_same_keeps_it_right():
    """One step caches a prompt's blocks twice (the same prompt twice in a batch) and more of them
    than the host tier has slots: each content takes one slot, the leading ones, and every slot
    holds the K/V of the block its hash names (the pool's copy, bit for bit)."""
    import torch

    from tokenmill.model.layers.kv_cache import read_blocks
    from tokenmill.replicas.replica_router import prompt_block_hashes

    with engine(kv_host_cache="8MiB") as llm:  # 11 slots of 720 KiB; the prompt is ~29 blocks
        core = llm.engine.core
        tier, runner = core.tiers.host, core.runner
        outs = llm.generate([FIRST, FIRST], GREEDY)
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        first = prompt_block_hashes(outs[0].prompt_token_ids + list(outs[0].outputs[0].token_ids), 16)
        assert len(tier) == tier.num_slots == 11 and set(tier) <= set(first)
        for h in list(tier):  # (the pool holds them all still)
            block = core.block_pool.lookup(h)
            assert torch.equal(runner.host_kv.rows[tier.lookup(h)], read_blocks(runner.kv_caches, [block])[0])
