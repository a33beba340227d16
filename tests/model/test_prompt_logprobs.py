"""Prompt logprobs, computed during prefill: what one full forward of the prompt gives
(the transformers oracle too), chunked or not, from a warm prefix cache or not."""

from __future__ import annotations

import torch

from tokenmill import LLM, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. " * 30).strip()  # ~300 tokens: chunked at 64


def reference(hf_model, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    chosen = [logprobs[j - 1, ids[j]].item() for j in range(1, len(ids))]
    return chosen, [logprobs[j - 1].topk(k).indices.tolist() for j in range(1, len(ids))]


def test_prompt_logprobs_equal_a_full_forward_chunked_or_not(float_llm, hf_model):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    want, want_top = reference(hf_model, ids, 3)
    got = out.prompt_logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3
    assert (
        sum(t != [i for i, _ in top] for t, top in zip(want_top, out.prompt_top_logprobs[1:], strict=True)) <= 2
    )  # ties
    for j in range(1, len(ids)):  # the rank: 1 + how many tokens were more likely
        top_ids = [i for i, _ in out.prompt_top_logprobs[j]]
        assert out.prompt_ranks[j] == top_ids.index(ids[j]) + 1 if ids[j] in top_ids else out.prompt_ranks[j] > 3
    chunked = LLM(
        dtype="float32", quant_arithmetic="float", progress=False, max_num_batched_tokens=64, kv_cache_memory="64MiB"
    )
    try:
        again = chunked.generate(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
        assert (
            again.prompt_top_logprobs[1:]
            and max(abs(a - b) for a, b in zip(again.prompt_logprobs[1:], got, strict=True)) < 1e-4
        )
        assert again.token_ids == out.token_ids
    finally:
        chunked.close()


def test_a_warm_prefix_cache_still_yields_prompt_logprobs(llm):
    ids = llm.tokenizer.encode(TEXT)
    llm.generate(ids, SamplingParams(max_tokens=1))  # the prompt's blocks are cached now
    hit = llm.generate(ids, SamplingParams(max_tokens=1))[0]
    assert hit.num_cached_tokens > 0
    scored = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    cold = scored.prompt_logprobs
    assert scored.num_cached_tokens == 0 and len(cold) == len(ids) and all(v is not None for v in cold[1:])
    assert scored.prompt_top_logprobs[5] == []  # k = 0: the token's own logprob only
    n2 = llm.generate(ids, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1, prompt_logprobs=1))[0]
    assert n2.prompt_logprobs == cold and len(n2.outputs) == 2


def test_a_one_token_request_leaves_its_prompt_in_the_prefix_cache(llm):
    """A request that ends in its first step (max_tokens 1: lm-eval's scoring, a beam
    search round) registers its prompt's blocks before they are freed."""
    ids = llm.tokenizer.encode("A fresh prompt for the cache test. " * 12)
    first = llm.generate(ids, SamplingParams(max_tokens=1))[0]
    again = llm.generate(ids, SamplingParams(max_tokens=1))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == (len(ids) - 1) // 16 * 16
