"""The prefix cache's disk tier in an engine: a restarted engine reads back the blocks the
last one computed and answers as it did; another KV dtype, or a corrupt file, is a miss."""

from __future__ import annotations

from pathlib import Path

from tokenmill import LLM, SamplingParams

TEXT = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()[:3000]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def answer(tier: Path, **options) -> tuple[list[int], int, int]:
    """(greedy tokens, prompt tokens, of which prefix-cache hits) of one engine on ``tier``; the
    engine's figures (what /metrics shows) say as many blocks came from the disk."""
    with LLM(dtype="float32", progress=False, kv_cache_memory="64MiB", kv_disk_cache=str(tier), **options) as llm:
        out = llm.generate([TEXT], GREEDY)[0]
        stats, snap = llm.engine.core.prefix_cache_stats, llm.engine.core.snapshot()
        assert snap.kv_disk_hits * 16 == stats.hits and snap.kv_disk_bytes >= snap.kv_disk_hits * 16
        return list(out.outputs[0].token_ids), stats.queries, stats.hits


def test_a_restarted_engine_starts_from_the_blocks_the_last_one_computed(tmp_path):
    first, prompt, hits = answer(tmp_path)
    assert hits == 0 and prompt > 500
    # every full block of the prompt and the answer (the last token's K/V is never computed), by close()
    assert len(list(tmp_path.rglob("*.kv"))) == (prompt + 16 - 1) // 16
    again, _, hits = answer(tmp_path)
    assert again == first and hits == (prompt - 1) // 16 * 16  # all but the last, partial block
    other, _, hits = answer(tmp_path, kv_cache_dtype="int8")  # other K/V bytes: another namespace
    assert hits == 0 and len(other) == 16
    for f in tmp_path.rglob("*.kv"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    torn, _, hits = answer(tmp_path)
    assert torn == first and hits == 0  # every file fails its checksum: recomputed
