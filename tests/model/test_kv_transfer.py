"""Disaggregated prefill/decode's engine side: KV exported by one engine and imported
into another's prefix cache by block hash, so the second decodes the first's prompt
as on a cache hit, token-identical (no Ray here: tests/server/test_replicas_ray.py)."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.replicas.replica_router import prompt_block_hashes
from tokenmill.sampling_params import SamplingParams

PROMPT = (
    "Paged attention keeps the KV cache in fixed-size blocks, so that requests share a system prompt's "
    "blocks and memory is not lost to fragmentation. Prefill computes a prompt's K and V for every layer at "
    "once; decoding then reads them back for each new token. Explain in two sentences why that helps a server:"
)


def run(llm: LLM, ids: list[int]):
    (out,) = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_kv_imported_from_another_engine_decodes_token_identically(kv_cache_dtype):
    prefill = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4, progress=False)
    decode = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4, progress=False)
    ids = prefill.tokenizer.encode(PROMPT)
    reference = run(prefill, ids)  # one engine, prompt computed here: also fills its prefix cache
    hashes = prompt_block_hashes(ids, prefill.engine.core.config.block_size)
    n, data = prefill.engine.core.kv_transfer.export(hashes)
    assert n == len(hashes) >= 3 and data.dtype.is_floating_point is False
    assert decode.engine.core.kv_transfer.load(hashes, data) == n
    assert decode.engine.core.kv_transfer.load(hashes, data) == n  # cached already: nothing taken twice
    pool = decode.engine.core.block_pool
    assert pool.num_free == pool.num_blocks  # imported blocks are idle cached blocks, evictable
    out = run(decode, ids)
    usable = (len(ids) - 1) // prefill.engine.core.config.block_size  # the last token's block is always computed
    assert out.num_cached_tokens == usable * prefill.engine.core.config.block_size
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    prefill.close()
    decode.close()


def test_kv_of_a_different_layout_is_refused_and_a_full_pool_imports_what_fits():
    a = LLM(dtype="float32", progress=False)
    b = LLM(dtype="float32", kv_cache_dtype="int8", progress=False)
    ids = a.tokenizer.encode(PROMPT)
    run(a, ids)
    hashes = prompt_block_hashes(ids, a.engine.core.config.block_size)
    n, data = a.engine.core.kv_transfer.export(hashes)
    with pytest.raises(ValueError, match="do not fit"):
        b.engine.core.kv_transfer.load(hashes, data)
    pool = b.engine.core.block_pool
    assert pool.num_free == pool.num_blocks and not any(pool.lookup(h) is not None for h in hashes)  # nothing half-done
    c = LLM(dtype="float32", progress=False)
    cpool = c.engine.core.block_pool
    held = cpool.allocate(cpool.num_blocks - 2)  # two blocks free: two imported, the rest recomputed later
    assert c.engine.core.kv_transfer.load(hashes, data) == 2
    cpool.free(held[::-1])
    out = run(c, ids)
    assert out.num_cached_tokens == 2 * c.engine.core.config.block_size
    for llm in (a, b, c):
        llm.close()
