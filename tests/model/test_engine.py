"""Continuous batching on the real model: every request's greedy output is the
same alone, in a batch of 32, with small prefill chunks, with prefix-cache hits,
and under preemption; nothing leaks; impossible requests are refused at once."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

STEMS = [
    "The history of the printing press",
    "Write a short poem about the sea:",
    "def quicksort(arr):",
    "Les trois couleurs du drapeau français sont",
    "Q: What is 17 times 3?\nA:",
    "Once upon a time in a small village,",
    "The mitochondria is",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\n",
]
SHARED = "You are a helpful assistant. Answer carefully and concisely. " * 3


def workload(n=32):
    prompts, params = [], []
    for i in range(n):
        stem = STEMS[i % len(STEMS)]
        prompt = (SHARED if i % 3 == 0 else "") + stem + " " * (i % 4) + ("more context " * (i % 5))
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=4 + (i * 7) % 13, ignore_eos=i % 2 == 0))
    return prompts, params


@pytest.fixture(scope="module")
def alone(llm):
    prompts, params = workload()
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def engine_llm(**kw):
    return LLM(dtype="float32", progress=False, **kw)


def run(llm, **_):
    prompts, params = workload()
    outs = llm.generate(prompts, params)
    pool = llm.engine.core.block_pool
    assert pool.num_free == pool.num_blocks, "KV blocks leaked"
    return [o.token_ids for o in outs]


def test_continuous_batch_of_32_matches_alone(llm, alone):
    assert run(llm) == alone
    stats = list(llm.engine.core.step_stats)[-40:]
    assert max(s.num_seqs for s in stats) > 8  # it really batched


def test_small_prefill_chunks_and_no_prefix_cache_match_alone(alone):
    llm = engine_llm(max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_memory="64MiB")
    assert run(llm) == alone
    assert any(0 < s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.core.step_stats)  # mixed steps
    assert llm.prefix_cache_stats.hits == 0


def test_float_arithmetic_matches_alone_in_small_prefill_chunks_and_batched():
    """The tests above run the default (int8) arithmetic; the exact one (a GGUF's weights widened,
    multiplied in float) gives each request the same greedy tokens alone, in a batch of 32 and cut
    into prefill chunks of 32 tokens, too."""
    llm = engine_llm(quant_arithmetic="float", kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompts, params = workload()
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    chunked = engine_llm(
        quant_arithmetic="float", max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_memory="64MiB"
    )
    assert run(llm) == alone and run(chunked) == alone
    assert any(0 < s.num_prefill_tokens and s.num_decode_tokens for s in chunked.engine.core.step_stats)


def test_prefix_cache_hits_match_alone(llm, alone):
    before = llm.prefix_cache_stats.hits
    assert run(llm) == alone  # second time round: the shared system prefix is cached
    assert llm.prefix_cache_stats.hits > before


def test_preemption_under_a_tiny_kv_pool_matches_alone(alone):
    # 24 blocks of 16 tokens: far less than 32 requests need at once
    llm = engine_llm(kv_cache_memory=24 * 16 * 46080, max_num_batched_tokens=64)
    assert llm.num_blocks == 24
    assert run(llm) == alone
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_static_scheduling_matches_alone(alone):
    llm = engine_llm(scheduling="static", max_num_seqs=8, kv_cache_memory="64MiB")
    assert run(llm) == alone


def test_parallel_sampling_shares_prompt_blocks(llm):
    """n = 4 completions hold the prompt's blocks once (the same block ids in every table,
    far fewer blocks than four copies) and sample as four seeded single requests would."""
    prompt = SHARED + "Name a fruit:"
    engine, pool = llm.engine, llm.engine.core.block_pool
    engine.add_request("share", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8))
    try:
        seqs = []
        for _ in range(3):  # the prompt computed once (first sequence), then its siblings fork from it
            engine.step()
            seqs = [r for r in engine.core.scheduler.running if r.parent_id == "share"]
            if len(seqs) == 4:
                break
        prompt_blocks = len(llm.tokenizer.encode(prompt)) // engine.core.config.block_size
        assert len(seqs) == 4 and prompt_blocks >= 2
        assert all(list(r.block_ids[:prompt_blocks]) == list(seqs[0].block_ids[:prompt_blocks]) for r in seqs)
        assert pool.num_blocks - pool.num_free <= prompt_blocks + 4 * 2  # the prompt once, a tail each
    finally:
        engine.abort("share")
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8))[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    single = [
        llm.generate(prompt, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=8))[0].token_ids for i in range(4)
    ]
    assert [c.token_ids for c in out.outputs] == single


def test_request_larger_than_the_kv_pool_is_refused_at_once():
    llm = engine_llm(kv_cache_memory=4 * 16 * 46080)
    assert llm.max_model_len == 64  # clamped to what the pool holds, so a longer request is a 400, not a cut-off
    with pytest.raises(InvalidRequestError, match="context window is 64 tokens"):  # max_model_len fits the pool
        llm.generate([[7] * 70], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished() and llm.engine.core.block_pool.num_free == 4


def test_abort_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=50))
    engine.add_request("b", "Count to one hundred:", SamplingParams(max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    assert engine.core.block_pool.num_used > 0
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_unfinished()
    assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks
