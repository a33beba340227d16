"""Issue 57, on the real Scheduler and KV manager (no model): the priority policy orders
the queue but cannot starve it, and a client's prompt chunks take at most its share of
a step's token budget while another client has prompt tokens to compute."""

from __future__ import annotations

from tests.unit.test_scheduler_policy import add, ids, make, step
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def test_a_steady_stream_of_urgent_requests_cannot_starve_a_default_priority_request():
    """One sequence at a time and a new priority -1000 request every step (they arrive
    faster than they are served): the priority-0 request waits while they go first, but
    once it has waited priority_aging_steps it is next, and it is not preempted after."""
    s = make(max_seqs=1, policy="priority")
    aging = s.config.priority_aging_steps
    zero = add(s, "zero", 4, max_tokens=3)
    first_served = None
    for n in range(3 * aging):
        add(s, f"urgent{n}", 4, max_tokens=2, priority=-1000)
        out = step(s)
        if first_served is None and "zero" in ids(out):
            first_served = n + 1
        if n + 1 == aging // 2:  # priority still orders the queue
            assert zero.status is RequestStatus.WAITING
    assert first_served is not None, f"the priority-0 request was never served in {3 * aging} steps"
    assert aging <= first_served <= aging + 2  # behind the urgent ones, but only so long
    assert zero.finished and zero.num_preemptions == 0


def test_a_request_let_in_by_age_is_not_preempted_for_more_urgent_ones():
    """Blocks for about two sequences; urgent requests keep coming. The old request,
    admitted by age, keeps its blocks: an urgent one is preempted instead, each time
    (preempting it would throw its work away, readmit it by age, and start over)."""
    s = make(num_blocks=6, max_seqs=4, policy="priority")
    aging = s.config.priority_aging_steps
    old = add(s, "old", 4, max_tokens=12)
    n = 0
    while not old.finished and n < 4 * aging:
        add(s, f"urgent{n}", 4, max_tokens=12, priority=-1000)
        step(s)
        n += 1
    assert old.finished and old.finish_reason == "length" and old.num_preemptions <= 1
    assert s.num_preemptions > 1  # there was contention: urgent requests were the ones preempted


def add_for(s: Scheduler, client: str, rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    """A request for ``client`` (the engine core sets it from the request's parameters)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority)
    req = Request(rid, [(7 * len(rid) + i) % 50 for i in range(prompt_len)], params, client=client)
    s.add(req)
    return req


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.seqs]


def test_a_clients_prompt_chunks_take_at_most_its_share_while_an_as_urgent_client_has_prompts():
    """One client's long prompts fill the budget while it is alone; once another
    client's prompt waits, each gets half of a step's budget for prompts, so the other
    client's prompt is computed at once rather than after the queue ahead of it. Under
    the priority policy a client competes only with clients as urgent or more: an urgent
    one takes the whole budget while a default one waits."""
    s = make(num_blocks=256, budget=64, max_seqs=8, caching=False)  # (the heavy prompts are alike)
    heavy = [add_for(s, "key:heavy", f"heavy{i}", 60, max_tokens=1) for i in range(6)]
    assert chunks(step(s)) == [("heavy0", 60), ("heavy1", 4)]  # alone: the whole budget
    light = add_for(s, "addr:10.0.0.2", "light", 40, max_tokens=4)
    assert chunks(step(s)) == [("heavy1", 32), ("light", 32)]  # the heavy client's queue waits its turn
    assert chunks(step(s)) == [("heavy1", 24), ("light", 8), ("heavy2", 8)]
    assert light.output_token_ids and sum(r.num_computed_tokens for r in heavy) == 60 + 60 + 8

    s = make(num_blocks=256, budget=64, max_seqs=8, policy="priority")
    add_for(s, "key:urgent", "urgent", 100, max_tokens=2, priority=-5)
    add_for(s, "addr:10.0.0.2", "later", 100, max_tokens=2)
    assert chunks(step(s)) == [("urgent", 64)]
    add_for(s, "key:urgent", "urgent2", 20, max_tokens=2, priority=-5)
    assert chunks(step(s)) == [("urgent", 36), ("urgent2", 20), ("later", 8)]
