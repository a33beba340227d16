"""Property-based: random arrivals, lengths, shared prefixes and aborts through the
real Engine, Scheduler and KV manager (a scripted runner stands in for the model).
After every step the block accounting must be exact and the budget respected."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers import TOY_VOCAB as VOCAB
from tests.helpers import ScriptedRunner, ToyTokenizer, expected_output
from tokenmill.configuration.config import SchedulerConfig, SpeculativeConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.model_input import ModelInput
from tokenmill.sampling_params import SamplingParams


def check_invariants(engine: Engine, cfg: SchedulerConfig, batch: ModelInput | None) -> None:
    refs = Counter(b for r in engine.core.scheduler.running for b in r.block_ids)
    for r in engine.core.scheduler.waiting:
        assert not r.block_ids or r.fork_of is None
        refs.update(r.block_ids)
    engine.core.block_pool.check_invariants(dict(refs))
    for r in engine.core.scheduler.running:
        assert len(r.block_ids) * engine.core.block_size >= r.num_computed_tokens
        assert len(r.block_ids) <= engine.core.kv.blocks_for(r.num_tokens), "blocks held past the request's tokens"
        assert len(set(r.block_ids)) == len(r.block_ids), "a block twice in one table"
    if batch is not None:
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        if batch.preempted_request_ids and cfg.scheduling == "continuous":  # blocks are short: nobody joins
            assert not batch.new_requests, "a request was admitted in the step that preempted another"
        assert len(batch.scheduled) <= cfg.max_num_seqs
    assert len(engine.core.scheduler.running) <= cfg.max_num_seqs


request_st = st.tuples(
    st.integers(0, 3),  # which shared prefix
    st.integers(1, 40),  # own prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 8),  # arrival step
    st.one_of(st.none(), st.integers(0, 15)),  # abort at step
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=14),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    policy=st.sampled_from(["continuous", "static"]),
    speculative=st.sampled_from([None, "ngram", "draft"]),
)
@example(  # always asked: a long prompt alone drafts, and its drafts are verified
    requests=[(2, 20, 8, 1, 0, None)],
    num_blocks=40,
    budget=8,
    max_seqs=2,
    caching=True,
    policy="continuous",
    speculative="ngram",
)
def test_random_workloads_keep_blocks_exact(requests, num_blocks, budget, max_seqs, caching, policy, speculative):
    bs = 4
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduling=policy)
    spec = None
    if speculative is not None:  # "draft" also reserves lookahead slots
        spec = SpeculativeConfig(speculative, num_speculative_tokens=3, draft_model="scripted", disable_batch_size=6)
    runner = ScriptedRunner(bs, lookahead=spec.num_lookahead_slots if spec else 0)
    engine = Engine.create(
        runner,
        ToyTokenizer(),
        EngineConfig(
            num_blocks=num_blocks,
            block_size=bs,
            max_model_len=200,
            enable_prefix_caching=caching,
            scheduler=cfg,
            speculative=spec,
        ),
    )
    prefixes = [list(range(k * 7, k * 7 + 9 * k)) for k in range(4)]
    finished: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    step = 0
    while step < 20_000:  # budget 1 with preemption can need thousands of steps
        for i, (pre, length, max_tokens, n, arrival, _) in enumerate(requests):
            if arrival == step:
                prompt = (prefixes[pre] + [(i * 13 + j) % VOCAB for j in range(length)])[:100]
                try:
                    engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=0))
                    prompts[str(i)] = prompt
                except ValueError as e:
                    assert "KV blocks" in str(e)  # too big for this pool: refused at once
        for i, (*_, abort_at) in enumerate(requests):
            if abort_at == step:
                engine.abort(str(i))
        before = len(runner.batches)
        for out in engine.step():
            c = out.outputs[0]
            assert c.finish_reason != "error", out.error  # the runner's checks failed: a scheduling bug
            if out.finished and c.finish_reason == "length" and len(c.token_ids) == requests[int(out.request_id)][2]:
                finished[out.request_id] = c.token_ids
        check_invariants(engine, cfg, runner.batches[-1] if len(runner.batches) > before else None)
        step += 1
        if step > 10 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "requests stuck"
    assert engine.core.block_pool.num_free == num_blocks, "blocks leaked"
    assert engine.core.num_unfinished_requests == 0
    assert not runner.requests and not runner.parked, "the runner holds state of finished requests"
    for rid, tokens in finished.items():  # preemption, chunking, caching, speculation change no output
        assert tokens == expected_output(prompts[rid], len(tokens))
    # a request drafts only where the pool holds its tokens and the lookahead slots (8 blocks of 4 cannot
    # speculate for a 27-token prompt and 6 tokens: it decodes plainly, as it should), and drafts are
    # dropped for a step whose blocks other requests hold (speculation is optional): asked only of a
    # pool that holds every request's whole sequences, each sequence with its lookahead slots
    lookahead = spec.num_lookahead_slots if spec else 0
    room = num_blocks * bs - lookahead
    drafting = [t for rid, t in finished.items() if len(t) >= 4 and len(prompts[rid]) + len(t) <= room]
    wanted = sum(
        requests[int(rid)][3] * -(-(len(p) + requests[int(rid)][2] + lookahead) // bs) for rid, p in prompts.items()
    )
    if speculative is not None and max_seqs <= 6 and budget > 4 and drafting and wanted <= num_blocks:
        assert engine.core.spec_decode_stats.num_drafts > 0  # the drafts were verified, not silently dropped
