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


@pytest.mark.parametrize(
    ("ev", "repeat"),
    [(KVEviction(window=32, sinks=4), 1), (KVEviction("snapkv", window=40), 3)],
    ids=["streaming", "snapkv"],
)
def test_eviction_survives_preemption_and_recomputes_the_same_tokens(ev, repeat):
    from tokenmill import LLM

    small = LLM(dtype="float32", progress=False, max_model_len=256, kv_cache_memory="9MiB")  # 12 blocks of 720 KiB
    engine = small.engine
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, kv_eviction=ev)
    prompts = [small.tokenizer.encode(f"Story {i}: " + PROMPT * repeat) for i in range(6)]
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


def _snapkv_reference(hf_model, prompt_ids: list[int], num_new: int, window: int) -> list[int]:
    """Greedy tokens of transformers' model after SnapKV as tokenmill chooses: the attention of the
    prompt's last 32 queries (eager attention's own weights, summed over layers, heads and
    queries), max-pooled over 7 tokens, the top ones (ties: the earlier) and the last 32 kept;
    kept keys keep their positions, what follows takes the true ones."""
    from transformers import DynamicCache

    from tokenmill.sampling_params import SNAPKV_OBSERVED, SNAPKV_POOL

    n = len(prompt_ids)
    cache = DynamicCache()
    hf_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        hf_model.set_attn_implementation("sdpa")
    scores = sum(a[0, :, -SNAPKV_OBSERVED:, :].sum(dim=(0, 1)) for a in out.attentions)
    head = n - SNAPKV_OBSERVED
    pooled = torch.nn.functional.max_pool1d(scores[None, None, :head], SNAPKV_POOL, 1, SNAPKV_POOL // 2)[0, 0]
    chosen = torch.argsort(pooled, descending=True, stable=True)[: window - SNAPKV_OBSERVED].sort().values
    keep = torch.cat([chosen, torch.arange(head, n)])
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    tokens = [int(out.logits[0, -1].argmax())]
    with torch.no_grad():
        for i in range(num_new - 1):
            logits = hf_model(
                torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[n + i]])
            ).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens


def test_snapkv_chooses_the_same_tokens_whatever_the_prompt_chunks(float_llm):
    from tokenmill import LLM

    chunked = LLM(
        dtype="float32", quant_arithmetic="float", progress=False, kv_cache_memory="64MiB", max_num_batched_tokens=48
    )
    prompt = " ".join(f"Ship {i} left the harbour at {i + 5} o'clock with {i * 3} crates." for i in range(20))
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, kv_eviction={"policy": "snapkv", "window": 64}
    )
    ids = float_llm.tokenizer.encode(prompt)
    assert len(ids) % 48 < 32, "the observed tokens must straddle two chunks"
    whole = float_llm.generate([ids], params)[0].outputs[0].token_ids
    assert chunked.generate([ids], params)[0].outputs[0].token_ids == whole


def test_snapkv_matches_transformers_keeping_the_same_tokens(float_llm, hf_model):
    llm = float_llm
    prompt = (
        PROMPT + " " + " ".join(f"In {1450 + i} the press at workshop {i} printed {i * 7} pages." for i in range(30))
    )
    ids = llm.tokenizer.encode(prompt)
    assert len(ids) > 300
    window = 96  # 32 observed tokens and the 64 the attention weighs most
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, kv_eviction={"policy": "snapkv", "window": window}
    )
    before = llm.engine.core.kv.evicted_tokens
    out = llm.generate([ids], params)[0].outputs[0]
    assert llm.engine.core.kv.evicted_tokens - before == len(ids) - window
    assert out.token_ids == _snapkv_reference(hf_model, ids, 40, window)
