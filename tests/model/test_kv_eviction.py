"""KV eviction (``KVEviction``, StreamingLLM): against transformers keeping the same cache,
past the context window, within its blocks, and refused where it cannot hold."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_to_completion
from tokenmill import SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import KVEviction

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _rotate(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., seq, head_dim] rotated at p, rotated at p + delta instead (rotate-half RoPE)."""
    angles = delta * inv_freq.double()
    cos, sin = torch.cat((angles, angles)).cos().float(), torch.cat((angles, angles)).sin().float()
    half = k.shape[-1] // 2
    return k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin


def _streaming_reference(hf_model, prompt_ids: list[int], num_new: int, ev: KVEviction, block_size: int) -> list[int]:
    """Greedy tokens of transformers' model whose cache is kept as StreamingLLM keeps it: past the
    budget, whole blocks after the sink blocks dropped and the kept keys after them re-rotated
    to the positions they now hold (positions are cache indices, transformers' default)."""
    from transformers import DynamicCache

    inv_freq = hf_model.model.rotary_emb.inv_freq
    sinks, budget = ev.sink_tokens(block_size), ev.budget(block_size)
    cache = DynamicCache()
    tokens, feed = [], list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_new):
            logits = hf_model(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
            feed = tokens[-1:]
            held = cache.get_seq_length()
            if held >= budget:
                drop = (held - sinks - ev.window) // block_size * block_size
                for layer in cache.layers:
                    kept = _rotate(layer.keys[:, :, sinks + drop :], -drop, inv_freq)
                    layer.keys = torch.cat([layer.keys[:, :, :sinks], kept], dim=2)
                    layer.values = torch.cat([layer.values[:, :, :sinks], layer.values[:, :, sinks + drop :]], dim=2)
    return tokens


def test_streaming_eviction_matches_transformers_keeping_the_same_cache(float_llm, hf_model):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    bs = llm.engine.core.config.block_size
    ev = KVEviction(window=32, sinks=4)  # sinks: one block; budget 16 + 32 + 16 = 64 tokens
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, kv_eviction=ev)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    ref = _streaming_reference(hf_model, ids, 120, ev, bs)
    assert out.token_ids == ref
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0].outputs[0]
    assert full.token_ids != out.token_ids, "120 tokens past a 32-token window changed nothing: no eviction?"


def test_a_streaming_request_generates_past_the_context_within_its_blocks():
    from tokenmill import LLM

    small = LLM(dtype="float32", progress=False, max_model_len=128, kv_cache_memory="32MiB")
    engine, core = small.engine, small.engine.core
    ev = KVEviction(window=48, sinks=4)  # budget 16 + 48 + 16 = 80 tokens: 5 blocks, 6 with the next token's
    prompt = small.tokenizer.encode(PROMPT * 12)  # ~170 tokens: longer than the context, read in strides
    assert len(prompt) > 128
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, kv_eviction=ev)
    engine.add_request("long", prompt, params)
    most = 0
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        for req in core.scheduler.running:
            most = max(most, len(req.block_ids))
            assert req.num_kv_tokens <= ev.budget(16)
    assert done["long"].outputs[0].finish_reason == "length" and len(done["long"].outputs[0].token_ids) == 300
    assert most <= 6, f"an evicting request held {most} blocks"
    assert core.kv.evicted_tokens >= len(prompt) + 300 - 128
    assert core.block_pool.num_used == 0


def test_eviction_survives_preemption_and_recomputes_the_same_tokens():
    from tokenmill import LLM

    small = LLM(dtype="float32", progress=False, max_model_len=256, kv_cache_memory="9MiB")  # 12 blocks of 720 KiB
    engine = small.engine
    ev = KVEviction(window=32, sinks=4)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, kv_eviction=ev)
    prompts = [small.tokenizer.encode(f"Story {i}: " + PROMPT) for i in range(6)]
    alone = {i: run_to_completion(engine, [p], params)["0"].outputs[0].token_ids for i, p in enumerate(prompts)}
    before = engine.core.scheduler.num_preemptions
    together = run_to_completion(engine, prompts, params)
    assert engine.core.scheduler.num_preemptions > before, "the pool was large enough: nothing was preempted"
    assert {int(k): v.outputs[0].token_ids for k, v in together.items()} == alone


def test_eviction_is_refused_where_it_cannot_hold(llm):
    engine = llm.engine.core
    too_big = KVEviction(window=engine.config.max_model_len)
    with pytest.raises(InvalidRequestError, match="kv_eviction keeps up to"):
        engine.add_request("big", [1, 2, 3], SamplingParams(kv_eviction=too_big))
    with pytest.raises(InvalidRequestError, match="kv_eviction policy"):
        SamplingParams(kv_eviction={"policy": "h2o"})
    with pytest.raises(InvalidRequestError, match="unknown kv_eviction field"):
        SamplingParams(kv_eviction={"windw": 8})
    assert not engine.has_unfinished()
