"""Beam search over the engine against a from-scratch reference (every beam recomputed
by a full transformers forward each round), and against greedy."""

from __future__ import annotations

import pytest
import torch

from tokenmill import BeamSearchParams, SamplingParams
from tokenmill.errors import InvalidRequestError

PROMPTS = ["The capital of France is", "My favourite food is"]


def reference(
    hf_model, prompt: list[int], width: int, steps: int, eos: set[int], ignore_eos: bool, length_penalty: float
) -> list[tuple[list[int], float]]:
    live, done = [([], 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = hf_model(torch.tensor([prompt + tokens])).logits[0, -1].float().log_softmax(-1)
            vals, ids = logprobs.topk(2 * width)
            candidates += [(tokens + [t], cum + v) for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        candidates.sort(key=lambda c: c[1], reverse=True)
        live = []
        for c in candidates[:width]:
            (done if not ignore_eos and c[0][-1] in eos else live).append(c)
        if not live:
            break

    def score(c):
        n = len(prompt) + len(c[0]) - (1 if not ignore_eos and c[0][-1] in eos else 0)
        return c[1] / n**length_penalty

    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize(("width", "ignore_eos", "length_penalty"), [(2, True, 1.0), (3, False, 0.5)])
def test_beam_search_equals_the_reference(float_llm, hf_model, width, ignore_eos, length_penalty):
    llm = float_llm  # the exact arithmetic: transformers' numbers
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=ignore_eos, length_penalty=length_penalty)
    outs = llm.beam_search(ids, params)
    eos = set(llm.tokenizer.stop_token_ids)
    for prompt, out in zip(ids, outs, strict=True):
        want = reference(hf_model, prompt, width, 5, eos, ignore_eos, length_penalty)
        assert [b.tokens for b in out.beams] == [t for t, _ in want]
        assert all(abs(b.cum_logprob - c) < 1e-3 for b, (_, c) in zip(out.beams, want, strict=True))
    assert llm.engine.core.snapshot().kv_usage == 0.0


def test_the_best_beam_is_never_below_greedy(llm):
    for prompt in PROMPTS + ["Once upon a time", "def fibonacci(n):"]:
        greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0]
        best = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))[0].beams[0]
        assert best.cum_logprob >= sum(greedy.outputs[0].logprobs) - 1e-4
        assert len(best.tokens) == 8


def test_beam_search_params_are_checked():
    for bad in ({"beam_width": 0}, {"beam_width": 11}, {"max_tokens": 0}, {"length_penalty": float("nan")}):
        with pytest.raises(InvalidRequestError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
