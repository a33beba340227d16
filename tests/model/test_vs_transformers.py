"""Our model against transformers loading the same GGUF: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import all_logits, seq
from tokenmill import SamplingParams

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest, where",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    '    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n    """Return n!."""\n'
    "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n\n\nclass Stack:\n",
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "medium", "long-code"])
def test_logits_match_transformers_prefill_and_16_decode_steps(float_llm, hf_model, prompt):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    ids = llm.tokenizer.encode(prompt)
    runner = llm.engine.core.runner
    blocks = llm.engine.core.block_pool.allocate(-(-(len(ids) + 16) // llm.engine.core.block_size))
    try:
        ours = [all_logits(runner, [seq(ids, blocks)])]  # prefill: every prompt position
        tokens = list(ids)
        for _ in range(16):
            tokens.append(int(ours[-1][-1].argmax()))
            ours.append(all_logits(runner, [seq(tokens[-1:], blocks, num_computed=len(tokens) - 1)]))
    finally:
        llm.engine.core.block_pool.free(blocks)
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]  # [len(tokens), vocab]
    prefill_diff = (ours[0] - ref[: len(ids)]).abs().max().item()
    decode = torch.cat(ours[1:])
    decode_diff = (decode - ref[len(ids) :]).abs().max().item()
    assert prefill_diff < 1e-3, f"prefill logits differ by {prefill_diff}"
    assert decode_diff < 1e-3, f"decode logits differ by {decode_diff}"


def test_greedy_64_tokens_identical_to_transformers_generate(float_llm, hf_model):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    from transformers import GenerationConfig

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    # eos_token_id=-1: never stop early, as ignore_eos does on our side
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=64, pad_token_id=0, eos_token_id=-1)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), generation_config=gen_config)[0, len(ids) :].tolist()
        assert out.token_ids == ref, f"diverged on {prompt[:30]!r}"
        assert len(out.token_ids) == 64


def test_bfloat16_agrees_with_float32(llm):
    """bf16 compute loses precision but must keep the model's predictions."""
    from tokenmill import LLM

    bf16 = LLM(dtype="bfloat16", progress=False, kv_cache_memory="64MiB")
    ids = llm.tokenizer.encode(PROMPTS[2])
    blocks32 = llm.engine.core.block_pool.allocate(-(-len(ids) // 16))
    blocks16 = bf16.engine.core.block_pool.allocate(-(-len(ids) // 16))
    try:
        ref = all_logits(llm.engine.core.runner, [seq(ids, blocks32)])
        got = all_logits(bf16.engine.core.runner, [seq(ids, blocks16)])
    finally:
        llm.engine.core.block_pool.free(blocks32)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert got.dtype == torch.float32 and bf16.model.norm.weight.dtype == torch.bfloat16
    assert agree > 0.9, f"bf16 top-1 agrees with fp32 on only {agree:.0%} of positions"
