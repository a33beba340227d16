"""Scheduler policy, step by step on the real Scheduler and KV manager (no model):
who is preempted, what goes first, when lookahead is reserved, what the runner is
sent, and that update_from_output alone applies a step's results."""

from __future__ import annotations

from tokenmill.configuration.config import SchedulerConfig, SpeculativeConfig
from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.model_input import ModelOutput, SampledToken
from tokenmill.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, budget=64, max_seqs=8, spec=None, max_model_len=100, caching=True, policy="fcfs") -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=caching), BS)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduling_policy=policy)
    return Scheduler(config, kv, max_model_len, frozenset(), spec)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 50, **params) -> Request:
    req = Request(
        rid,
        [(7 * len(rid) + i) % 50 for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, temperature=0, **params),
    )
    s.add(req)
    return req


def step(s: Scheduler, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """Schedule, then 'sample' token 1 for every sequence that reached its end (and
    accept none of its drafts), offering the given drafts."""
    out = s.schedule()
    sampled = {}
    for x in out.seqs:
        real = x.num_new_tokens - len(x.spec_token_ids)
        if x.request.num_computed_tokens + real == x.request.num_tokens:
            sampled[x.request.request_id] = [SampledToken(1)]
    s.update_from_output(out, ModelOutput(sampled=sampled, draft_token_ids=drafts or {}))
    return out


def ids(out: SchedulerOutput) -> list[str]:
    return [x.request.request_id for x in out.seqs]


def test_under_the_priority_policy_lower_priority_values_are_admitted_first_then_arrival():
    s = make(max_seqs=2, policy="priority")
    add(s, "late", 4, priority=5), add(s, "first", 4, priority=-1), add(s, "tie1", 4), add(s, "tie2", 4)
    assert ids(step(s)) == ["first", "tie1"]  # two slots: -1, then the earlier of the two 0s
    assert [r.request_id for r in s.waiting] == ["tie2", "late"]


def test_under_the_priority_policy_preemption_takes_the_lowest_priority_and_requeues_it_in_order():
    s = make(num_blocks=4, policy="priority")
    a, b, c = add(s, "a", 4, priority=1), add(s, "b", 4, priority=9), add(s, "c", 4, priority=1)
    assert ids(step(s)) == ["a", "c", "b"]  # admitted in priority order; one block each, each needs a second
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["b"]  # the highest value, not the last admitted
    add(s, "d", 4, priority=3)
    assert [r.request_id for r in s.waiting] == ["d", "b"]  # b waits behind a more urgent newcomer
    assert b.status is RequestStatus.WAITING and a.num_computed_tokens == 5 and c.num_computed_tokens == 5


def test_a_priority_under_fcfs_is_refused_by_name():
    """As vLLM: a priority is refused unless the policy is on, never silently served in arrival order."""
    import pytest

    from tests.helpers import ScriptedRunner, ToyTokenizer
    from tokenmill.engine.core.engine_core import EngineConfig, EngineCore
    from tokenmill.errors import InvalidRequestError

    core = EngineCore(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as e:
        core.add_request("p", [1, 2, 3], SamplingParams(priority=2))
    assert e.value.param == "priority" and not core.has_unfinished()


def test_the_most_recently_admitted_request_is_preempted():
    s = make(num_blocks=4)
    a, b, c = add(s, "a", 4), add(s, "b", 4), add(s, "c", 4)
    assert ids(step(s)) == ["a", "b", "c"]  # one block each; each now needs a second
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert ids(out) == ["a", "b"]
    assert s.waiting[0] is c and c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert not c.block_ids and a.num_computed_tokens == 5 and b.num_computed_tokens == 5
    assert s.kv.pool.num_free == 0
    assert out.model_input.preempted_request_ids == ["c"]  # the runner drops it (keeping its generator)


def test_decodes_go_before_prompt_chunks_and_chunks_fill_the_budget():
    s = make(budget=8)
    add(s, "d", 3)
    step(s)  # d decodes from now on
    add(s, "long", 40)
    first = step(s)
    assert ids(first) == ["d", "long"] and [x.num_new_tokens for x in first.seqs] == [1, 7]
    add(s, "late", 2)
    out = step(s)
    assert ids(out) == ["d", "long"]  # the running chunk takes the rest; 'late' waits for budget
    assert [x.num_new_tokens for x in out.seqs] == [1, 7]


def ngram(**kw) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", num_speculative_tokens=3, **kw)


def draft_model(**kw) -> SpeculativeConfig:
    return SpeculativeConfig("draft", num_speculative_tokens=3, draft_model="x", **kw)


def test_lookahead_only_for_sequences_that_draft_this_step():
    s = make(spec=draft_model(disable_batch_size=1))
    a = add(s, "a", 3)
    out = s.schedule()
    assert out.seqs[0].num_lookahead == 3 and len(a.block_ids) == 2  # 3 tokens + 3 draft slots
    s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(1)]}))
    assert len(a.block_ids) == 1  # the unused lookahead block went back


def test_paused_speculation_reserves_no_lookahead():
    """Two running > disable_batch_size=1: nobody drafts, so each decode holds exactly
    the block its one token needs (3 lookahead slots would need a second block)."""
    s = make(spec=draft_model(disable_batch_size=1))
    a, b = add(s, "a", 3), add(s, "b", 3)
    step(s)
    out = s.schedule()
    assert [x.num_lookahead for x in out.seqs] == [0, 0]
    assert len(a.block_ids) == 1 and len(b.block_ids) == 1


def test_drafting_stops_near_max_model_len_and_max_tokens():
    s = make(spec=ngram(), max_model_len=12)
    a = add(s, "a", 8, max_tokens=100)
    assert step(s, drafts={"a": [5, 6, 7]}).seqs[0].num_lookahead == 3  # 9 tokens + 3 drafts stay below 12
    assert a.spec_token_ids == [5, 6, 7]
    out = step(s)  # verifying 3 drafts at positions 9..11: no room for more
    assert out.seqs[0].spec_token_ids == [5, 6, 7] and out.seqs[0].num_lookahead == 0
    assert a.num_tokens == 10 and a.num_computed_tokens == 9  # all three rejected
    assert s.schedule().seqs[0].num_lookahead == 1
    s2 = make(spec=ngram())
    b = add(s2, "b", 4, max_tokens=3)
    assert step(s2, drafts={"b": [9, 9, 9]}).seqs[0].num_lookahead == 1  # 2 tokens left: 1 draft + the bonus
    assert b.spec_token_ids == [9]  # capped at what max_tokens leaves


def test_update_from_output_is_the_whole_post_step():
    """Computed counts, appended tokens, stop by token id, cached blocks and freed
    requests all follow from the one call."""
    s = make()
    a = add(s, "a", 8, stop_token_ids=(3,))
    out = s.schedule()
    s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(2)]}))
    assert a.num_computed_tokens == 8 and a.output_token_ids == [2] and a.num_cached_blocks == 2
    out = s.schedule()
    updates = s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(3)]}))
    assert a.finished and a.finish_reason == "stop" and a.stop_reason == 3
    assert [u.request for u in updates] == [a] and s.kv.pool.num_free == s.kv.pool.num_blocks
    drops = s.runner_sync.drops()  # the runner is told to drop it, once
    assert (drops.finished_request_ids, drops.preempted_request_ids) == (["a"], [])
    assert s.runner_sync.drops().finished_request_ids == []


def test_the_runner_is_sent_deltas_only():
    """A decoding request's record carries no tokens and, between block boundaries, no
    block ids: nothing per step grows with its length."""
    s = make()
    add(s, "a", 6)
    out = s.schedule()
    assert [r.request_id for r in out.model_input.new_requests] == ["a"]
    assert out.model_input.new_requests[0].block_ids == s.running[0].block_ids
    s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(1)]}))
    sizes = []
    for _ in range(12):
        out = s.schedule()
        assert not out.model_input.new_requests
        sizes.append(sum(len(c.new_block_ids) for c in out.model_input.cached_requests))
        s.update_from_output(out, ModelOutput(sampled={"a": [SampledToken(1)]}))
    assert max(sizes) == 1 and sum(sizes) == 3  # one new block id every BS tokens


def test_a_prompt_whose_next_block_another_computes_this_step_waits_a_step_and_then_hits_the_cache():
    """Two prompts sharing 16 tokens (4 blocks) arrive together: the second is not admitted beside
    the first (it would compute the same blocks again), but next step, with those 4 blocks cached;
    a prompt sharing nothing is admitted beside the first all the same. Without caching nobody waits."""
    shared = [(5 * i + 3) % 50 for i in range(16)]
    for caching in (True, False):
        s = make(budget=64, caching=caching)
        a = Request("a", shared + [1, 2], SamplingParams(max_tokens=5, temperature=0))
        b = Request("b", shared + [3, 4, 5], SamplingParams(max_tokens=5, temperature=0))
        c = Request("c", [9, 8, 7, 6, 5, 4, 3, 2, 1], SamplingParams(max_tokens=5, temperature=0))
        for r in (a, b, c):
            s.add(r)
        first = step(s)
        if not caching:
            assert ids(first) == ["a", "b", "c"]
            continue
        assert ids(first) == ["a", "c"] and list(s.waiting) == [b]
        second = step(s)
        assert "b" in ids(second) and b.num_cached_prompt_tokens == 16
        assert [x.num_new_tokens for x in second.seqs if x.request is b] == [3]
