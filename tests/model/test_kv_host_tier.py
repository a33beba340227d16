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
