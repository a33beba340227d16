"""Perplexity of a text under an LLM's model, through the paged KV cache.

The text is fed in chunks, so every chunk after the first attends to K/V read back
from the cache: a quantised KV cache affects the result exactly as it affects
generation. Blocks come from (and go back to) the engine's own pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput


@torch.inference_mode()
def perplexity(llm, token_ids: list[int], chunk: int = 64) -> float:
    """exp(mean negative log-likelihood of token_ids[1:] given the tokens before)."""
    return score(llm, token_ids, chunk)[0]


@torch.inference_mode()
def score(llm, token_ids: list[int], chunk: int = 64) -> tuple[float, list[int]]:
    """Perplexity of token_ids[1:] given the tokens before, and the model's top-1 token at
    each of those positions (teacher-forced greedy predictions: compare two models' lists
    for their top-1 agreement)."""
    nll, count, top1 = 0.0, 0, []
    for targets, logprobs in chunk_logprobs(llm, token_ids, chunk):
        top1 += logprobs.argmax(dim=-1).tolist()
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count), top1


@torch.inference_mode()
def chunk_logprobs(llm, token_ids: list[int], chunk: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Teacher-forced, ``chunk`` positions at a time: the next tokens ([n]) and the model's
    log-probabilities over the vocabulary at those positions ([n, vocab], float32), for
    every position of token_ids but the last (what perplexity and a KL divergence against
    another model's distributions read)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if len(token_ids) > llm.max_model_len:
        raise ValueError(f"text of {len(token_ids)} tokens is longer than the context window ({llm.max_model_len})")
    runner, engine = llm.parts.runner, llm.engine
    with engine.core.borrow_blocks(-(-len(token_ids) // engine.core.block_size)) as blocks:
        for start in range(0, len(token_ids) - 1, chunk):
            piece = token_ids[start : start + chunk]
            s = SeqInput("perplexity", piece, start, blocks, False, SamplingParams(), [], [])
            targets = token_ids[start + 1 : start + 1 + len(piece)]
            logits = runner.all_logits([s])[: len(targets)]
            yield torch.tensor(targets, device=logits.device), logits.float().log_softmax(dim=-1)
