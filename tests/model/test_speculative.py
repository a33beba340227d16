"""Speculative decoding on tiny random models: lossless, greedy-identical, leak-free.

Tiny models make the statistical test affordable: the target's exact distribution of
its first three tokens is computed by enumeration, and thousands of seeded requests
with speculation must reproduce it (chi-square).
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch

from tests.helpers import ToyTokenizer, chi_square_pvalue, exact_first_tokens, run_to_completion, tiny_model
from tokenmill.configuration.config import SpeculativeConfig
from tokenmill.engine.core.scheduler import SchedulerConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.draft import ModelProposer
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
BLOCK = 4


def tiny_engine(
    target,
    method=None,
    draft=None,
    k=3,
    num_blocks=64,
    max_num_seqs=64,
    draft_layers=1,
    caching=True,
    disable_batch_size=10_000,
):
    caches = allocate_kv_cache(target.config, num_blocks, BLOCK, torch.float32, CPU)
    proposer, spec = None, None
    if method is not None:
        spec = SpeculativeConfig(
            method,
            num_speculative_tokens=k,
            draft_model="tiny",
            draft_layers=draft_layers,
            disable_batch_size=disable_batch_size,
            prompt_lookup_max=3,
        )
        if method == "ngram":
            proposer = NgramProposer(3, 1)
        elif method == "self":
            proposer = ModelProposer(target, caches, BLOCK, CPU, draft_layers, catch_up=False)
        else:
            draft_caches = allocate_kv_cache(draft.config, num_blocks, BLOCK, torch.float32, CPU)
            proposer = ModelProposer(draft, draft_caches, BLOCK, CPU)
    runner = ModelRunner(target, caches, BLOCK, CPU, proposer)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=200,
        enable_prefix_caching=caching,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
        speculative=spec,
    )
    return Engine.create(runner, ToyTokenizer(target.config.vocab_size), config)


def run(engine: Engine, prompts, params) -> dict[str, list[int]]:
    done = run_to_completion(engine, prompts, params)
    assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks, "KV blocks leaked"
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def mixed_workload(vocab: int):
    """Repetitive prompts (prompt lookup finds matches), shared prefixes (prefix cache
    hits), varied lengths and max_tokens, stop tokens and penalties on some."""
    shared = [(3 * i) % vocab for i in range(13)]
    prompts, params = [], []
    for i in range(10):
        motif = [(i + j * 5) % vocab for j in range(4)]
        prompt = shared + motif * (1 + i % 3) if i % 2 else motif * 3 + [i % vocab]
        prompts.append(prompt)
        stop = (i % vocab,) if i % 4 == 3 else ()
        penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3} if i % 3 == 1 else {}
        params.append(SamplingParams(temperature=0, max_tokens=6 + 5 * i, stop_token_ids=stop, **penalties))
    return prompts, params


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab=16)


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_output_is_identical_in_a_mixed_batch_with_preemption(target, method):
    prompts, params = mixed_workload(16)
    expected = run(tiny_engine(target), prompts, params)
    draft = tiny_model(1, vocab=16)
    engine = tiny_engine(target, method, draft=draft, num_blocks=24)  # too few blocks for all: preemption
    assert run(engine, prompts, params) == expected
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.kv.stats.hits > 0
    assert engine.core.spec_decode_stats.num_drafts > 0 and engine.core.spec_decode_stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["draft", "self"])
def test_a_draft_identical_to_the_target_is_always_accepted(target, method):
    """A draft model with the target's weights (or self-speculation through all its
    layers) must agree on every token: this holds only if the draft's K/V stay
    exactly in step through chunked prefill, prefix-cache sharing, preemption and
    rejected drafts."""
    prompts, params = mixed_workload(16)
    engine = tiny_engine(
        target, method, draft=copy.deepcopy(target), num_blocks=24, draft_layers=target.config.num_layers
    )
    run(engine, prompts, [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in params])
    stats = engine.core.spec_decode_stats
    assert stats.num_drafts > 20 and stats.acceptance_rate == 1.0
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.kv.stats.hits > 0


@pytest.mark.parametrize(
    "method,temperature,top_k",
    [("draft", 1.0, 0), ("ngram", 0.8, 5), ("self", 1.0, 0)],
    ids=["draft", "ngram-topk", "self"],
)
def test_sampling_with_speculation_reproduces_the_targets_distribution(method, temperature, top_k):
    vocab, draws = 8, 3000
    target = tiny_model(2, vocab=vocab)
    prompt = list(range(vocab)) * 2  # every token occurs: prompt lookup always has a match
    engine = tiny_engine(target, method, draft=tiny_model(3, vocab=vocab), k=2, num_blocks=2000, max_num_seqs=256)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, seed=s, ignore_eos=True)
        for s in range(draws)
    ]
    outputs = run(engine, [prompt] * draws, params).values()
    stats = engine.core.spec_decode_stats
    assert stats.num_drafts >= draws  # every request verified drafts for tokens 2 and 3
    assert 0 < stats.acceptance_rate < 1  # and both acceptance and rejection happened
    p1, p23 = exact_first_tokens(target, prompt, temperature, top_k)
    first = Counter(o[0] for o in outputs)
    pairs = Counter(o[1] * vocab + o[2] for o in outputs)
    assert chi_square_pvalue(first, p1) > 1e-3
    assert chi_square_pvalue(pairs, p23) > 1e-3


def test_seeded_sampling_with_speculation_is_reproducible(target):
    """Same seed, same output: run again, or alone instead of among others. (Which
    positions get drafted decides which random draws a token uses, so a schedule that
    drafts differently, as under preemption, gives another sample of the same
    distribution rather than the same tokens.)"""
    prompts, _ = mixed_workload(16)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=7, repetition_penalty=1.2)
    draft = tiny_model(1, vocab=16)
    a = run(tiny_engine(target, "draft", draft=draft, num_blocks=400), prompts, params)
    b = run(tiny_engine(target, "draft", draft=draft, num_blocks=400), prompts, params)
    alone = run(tiny_engine(target, "draft", draft=draft, num_blocks=400), prompts[3:4], params)
    assert a == b and alone["0"] == a["3"]


def test_speculation_pauses_above_the_disable_batch_size(target):
    prompts, params = mixed_workload(16)
    engine = tiny_engine(target, "ngram", disable_batch_size=2)
    run(engine, prompts[:2], params[:2])
    drafted = engine.core.spec_decode_stats.num_drafts
    assert drafted > 0
    run(engine, prompts, params)  # ten at once: no drafting until at most two remain
    steps_over = [s for s in engine.core.step_stats if s.num_running > 2]
    assert steps_over and engine.core.spec_decode_stats.num_drafts - drafted < len(prompts) * 10


def test_logprobs_of_accepted_tokens_match_plain_decoding(target):
    prompts, _ = mixed_workload(16)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)

    def collect(engine):
        for i, p in enumerate(prompts[:4]):
            engine.add_request(str(i), p, params)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
        return outs

    plain, spec = collect(tiny_engine(target)), collect(tiny_engine(target, "ngram"))
    for rid, a in plain.items():
        b = spec[rid]
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]


def test_all_proposers_leave_no_state_behind_after_aborts(target):
    draft = tiny_model(1, vocab=16)
    for method in ("ngram", "draft", "self"):
        engine = tiny_engine(target, method, draft=draft, num_blocks=32)
        prompts, params = mixed_workload(16)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
        for step in itertools.count():
            engine.step()
            if step == 3:
                for i in range(0, len(prompts), 2):
                    engine.abort(str(i))
            if not engine.has_unfinished():
                break
        engine.step()  # hands the runner the last finished ids
        assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks
        assert not engine.core.runner.requests and not engine.core.runner._parked_generators


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_n_sequences_fork_and_speculate(target, method):
    """n > 1 forks the prompt's blocks; each fork drafts from its first token on."""
    engine = tiny_engine(target, method, draft=tiny_model(1, vocab=16), num_blocks=64)
    prompts, _ = mixed_workload(16)
    engine.add_request("r", prompts[1], SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.outputs[0].index for o in outs) == [0, 1, 2]
    assert all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in outs)
    assert engine.core.spec_decode_stats.num_drafts > 0
    assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks


@pytest.mark.parametrize("method", ["draft", "self"])
def test_a_lone_request_that_just_fits_drops_speculation_rather_than_stopping_early(target, method):
    """10 prompt + 10 output tokens in 5 blocks of 4: exactly full. Lookahead slots and
    drafts that do not fit are dropped for the step; the request is never cut short."""
    engine = tiny_engine(target, method, draft=tiny_model(1, vocab=16), num_blocks=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = run(engine, [list(range(10))], params)
    assert got == run(tiny_engine(target), [list(range(10))], params) and len(got["0"]) == 10


def test_a_draft_model_spends_no_forward_on_requests_that_evict_kv(target):
    """Evicting requests never draft and share no blocks, so the draft model's catch-up on
    them is work nobody reads: it reads only the other requests' tokens, and every output
    is plain decoding's."""
    from tokenmill.sampling_params import KVEviction

    prompts, params = mixed_workload(16)
    evicting = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_eviction=KVEviction(window=16, sinks=4))
    prompts, params = prompts[:3] + [[5, 7, 9] * 10], params[:3] + [evicting]
    expected = run(tiny_engine(target), prompts, params)
    draft = tiny_model(1, vocab=16)
    seen = []
    hook = draft.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel()))
    try:
        assert run(tiny_engine(target, "draft", draft=draft), prompts[3:], params[3:]) == {"0": expected["3"]}
        assert seen == [], "the draft model read an evicting request's tokens"
        engine = tiny_engine(target, "draft", draft=draft)
        assert run(engine, prompts, params) == expected
    finally:
        hook.remove()
    assert seen and engine.core.spec_decode_stats.num_drafts > 0, "the others drafted nothing"
