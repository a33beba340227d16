"""The engine's step trace and block states: what the live view draws must be what the
engine did (scripted runner, no weights)."""

from __future__ import annotations

import pytest

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.config import SchedulerConfig, SpeculativeConfig
from tokenmill.engine.core.block_pool import CACHED, FREE, HIT, SHARED, USED
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def engine(num_blocks: int = 64, **kw) -> Engine:
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=2000, **kw)
    return Engine.create(ScriptedRunner(4), ToyTokenizer(), config)


def run(e: Engine) -> None:
    while e.has_unfinished():
        e.step()


def test_no_trace_is_kept_until_asked():
    e = engine()
    e.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=4))
    run(e)
    assert e.core.tracer.take() == []


def test_the_trace_gives_each_sequence_its_prefill_chunks_decodes_and_end():
    """A 21-token prompt in chunks of 8 (budget 8), then one token per decode; the tokens
    traced add up to what was computed; the last step says why it ended."""
    e = engine(scheduler=SchedulerConfig(max_num_batched_tokens=8))
    e.core.tracer.start()
    e.add_request("a", list(range(1, 22)), SamplingParams(max_tokens=5))
    run(e)
    steps = e.core.tracer.take()
    seqs = [s["seqs"][0] for s in steps]
    assert [(q.kind, q.tokens) for q in seqs] == [("prefill", 8), ("prefill", 8), ("prefill", 5)] + [("decode", 1)] * 4
    assert [q.request_id for q in seqs] == ["a"] * 7 and [q.finish_reason for q in seqs] == [None] * 6 + ["length"]
    assert [s["step"] for s in steps] == list(range(1, 8)) and all(s["duration"] >= 0 for s in steps)
    assert steps[0]["running"] == 1 and steps[-1]["running"] == 0 and steps[-1]["blocks_used"] == 0
    assert e.core.tracer.take() == []  # taken: each step is handed out once


def test_a_prefix_hit_shows_in_the_trace_and_in_the_block_states():
    e = engine()
    e.core.tracer.start()
    prompt = list(range(1, 14))  # 13 tokens: three full blocks of 4
    e.add_request("a", prompt, SamplingParams(max_tokens=2))
    run(e)
    after_a = e.core.block_states()
    assert after_a.count(CACHED) == 3 and after_a.count(USED) == 0  # the full blocks of 14 computed tokens
    e.core.tracer.take()
    e.add_request("b", prompt + [20], SamplingParams(max_tokens=2))
    e.step()
    first = e.core.tracer.take()[0]["seqs"][0]
    assert first[:3] == ("b", "prefill", 2) and first.cached == 12  # 12 tokens from the cache, 2 computed
    states = e.core.block_states()
    hits = [i for i, s in enumerate(states) if s & HIT]
    assert len(hits) == 3 and all(states[i] & 3 == USED for i in hits)
    assert not any(s & HIT for s in e.core.block_states())  # a hit is shown once
    run(e)


def test_block_states_follow_the_pool():
    """Free, cached, in use and shared (n = 2 sequences share their prompt's blocks)."""
    e = engine()
    e.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=1))
    e.step()
    e.step()  # the second sequence forks from the first once its prompt is computed
    states = e.core.block_states()
    pool = e.core.block_pool
    assert len(states) == pool.num_blocks
    assert states.count(SHARED) >= 2 and states.count(FREE) + states.count(CACHED) == pool.num_free
    assert states.count(USED) + states.count(SHARED) == pool.num_used
    run(e)
    assert e.core.block_states().count(FREE) + e.core.block_states().count(CACHED) == pool.num_blocks


def test_verification_steps_trace_drafts_kept_and_rejected():
    e = engine(speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    e.core.tracer.start()
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=40))
    outputs = []
    while e.has_unfinished():
        outputs += e.step()
    verify = [q for s in e.core.tracer.take() for q in s["seqs"] if q.kind == "verify"]
    assert verify
    assert all(0 <= q.accepted <= q.drafts and q.tokens == 1 + q.accepted for q in verify)  # the target's + accepted
    assert sum(q.accepted for q in verify) == e.core.spec_decode_stats.num_accepted_tokens > 0
    assert sum(q.drafts for q in verify) == e.core.spec_decode_stats.num_draft_tokens


def test_the_trace_is_bounded_when_nobody_reads_it():
    from tokenmill.engine.core.step_trace import STEP_TRACE_KEPT

    e = engine(num_blocks=400)
    e.core.tracer.start()
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=STEP_TRACE_KEPT + 50, ignore_eos=True))
    run(e)
    steps = e.core.tracer.take()
    assert len(steps) == STEP_TRACE_KEPT and steps[-1]["seqs"][0].finish_reason == "length"


def test_tracing_changes_no_token():
    def tokens(trace: bool) -> list[list[int]]:
        e = engine(num_blocks=200, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
        if trace:
            e.core.tracer.start()
        for i in range(4):
            e.add_request(f"q{i}", list(range(1 + i, 30)), SamplingParams(max_tokens=30, temperature=1.0, seed=i))
        outs: dict[str, list[int]] = {}
        while e.has_unfinished():
            for out in e.step():
                outs.setdefault(out.request_id, []).extend(out.delta_token_ids)
        return [outs[k] for k in sorted(outs)]

    assert tokens(True) == tokens(False)


def test_a_prompt_all_but_its_last_token_from_the_cache_is_a_one_token_prefill():
    e = engine()
    e.core.tracer.start()
    prompt = list(range(1, 14))  # 13 tokens: 12 in full blocks, found in the cache the second time
    e.add_request("a", prompt, SamplingParams(max_tokens=2))
    run(e)
    e.core.tracer.take()
    e.add_request("b", prompt, SamplingParams(max_tokens=2))
    e.step()
    assert e.core.tracer.take()[0]["seqs"][0][:6] == ("b", "prefill", 1, 0, 0, 12)
    run(e)


def test_sequences_ended_between_steps_are_traced():
    """An abort and a stop string end sequences outside any step: a record without a batch says so."""
    e = engine()
    e.core.tracer.start()
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    e.add_request("b", [4, 5, 6], SamplingParams(max_tokens=50))
    e.step()
    e.abort("a")
    last = e.core.tracer.take()[-1]
    assert last["seqs"] == [] and last["ended"] == [["a", "abort"]] and last["duration"] == 0
    e.abort("a")  # gone already: nothing more
    assert e.core.tracer.take() == []
    e.core.finish_stopped("b", "x")
    assert e.core.tracer.take()[-1]["ended"] == [["b", "stop"]]
    e.core.tracer.stop()
    e.add_request("c", [7, 8], SamplingParams(max_tokens=3))
    run(e)
    assert e.core.tracer.take() == []  # stopped: nothing recorded
