"""Embeddings through the generation engine: the final hidden state (as transformers
computes it), pooled and normalised; a batch equals each text alone; chat traffic
and embeddings share steps; nothing is left held."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import PoolingParams, SamplingParams

TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "A completely different sentence, longer than the others.",
]


def hf_embedding(hf_model, ids: list[int], pooling: str) -> list[float]:
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0).tolist()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_the_pooled_final_hidden_state(float_llm, hf_model, pooling):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    got = llm.embed(TEXTS, pooling=pooling)
    for text, vec in zip(TEXTS, got, strict=True):
        want = hf_embedding(hf_model, llm.tokenizer.encode(text), pooling)
        assert len(vec) == len(want) and abs(math.hypot(*vec) - 1) < 1e-5
        assert sum(a * b for a, b in zip(vec, want, strict=True)) > 0.9999  # cosine
    alone = [llm.embed(t, pooling=pooling)[0] for t in TEXTS]
    assert all(max(abs(a - b) for a, b in zip(x, y, strict=True)) < 1e-5 for x, y in zip(got, alone, strict=True))
    assert llm.engine.core.snapshot().kv_usage == 0.0


def test_embeddings_share_steps_with_generation_and_use_the_prefix_cache(llm):
    ids = llm.tokenizer.encode(TEXTS[2] * 8)
    greedy = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0))[0].token_ids  # caches the prompt's blocks
    before = llm.engine.core.snapshot()
    mixed = llm.generate([ids, ids], [SamplingParams(max_tokens=8, temperature=0), PoolingParams("last")])
    assert mixed[0].token_ids == greedy and mixed[1].token_ids == [] and mixed[1].finish_reason == "stop"
    assert mixed[1].num_cached_tokens > 0 and llm.engine.core.snapshot().prefix_cache_hits > before.prefix_cache_hits
    assert max(abs(a - b) for a, b in zip(mixed[1].embedding, llm.embed([ids])[0], strict=True)) < 1e-5
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams("max")
