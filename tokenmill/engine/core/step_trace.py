"""The step tracer: an observer the engine core notifies of each step, recording what a
live view of the engine draws (server/observe/live.py): who got how many tokens of which kind,
drafts kept and rejected, prompt tokens the prefix cache gave, who ended, the gauges.

It records only between ``start()`` and ``stop()`` (nobody watching costs nothing but one
check a step), keeps at most ``STEP_TRACE_KEPT`` steps not taken yet, and hands them out
once (``take()``, safe from another thread: each step is popped whole). Records are plain
data that msgpack and JSON carry as they are (engine/stats.py's ``StepRecord``, which the pipe
types its reports by): a ``SeqRecord`` travels as a list.
"""

from __future__ import annotations

import time
from collections import deque

from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.stats import SeqRecord, StepRecord

STEP_TRACE_KEPT = 1024  # traced steps not taken yet: a live view that stops reading loses the oldest


def step_kinds(sched: SchedulerOutput) -> list[tuple[str, int]]:
    """Each scheduled sequence's kind of work and, on its first chunk, the prompt tokens
    the prefix cache gave it (read before the step's update moves the counts)."""
    kinds = []
    for s in sched.seqs:
        req = s.request
        if s.spec_token_ids:
            kind = "verify"
        elif req.output_token_ids and req.num_computed_tokens >= req.num_tokens - 1:
            kind = "decode"
        else:  # the prompt (its last token too, after a whole-prefix cache hit), or recomputing after preemption
            kind = "prefill"
        first = req.num_computed_tokens == req.num_cached_prompt_tokens and not req.output_token_ids
        kinds.append((kind, req.num_cached_prompt_tokens if first else 0))
    return kinds


class StepTracer:
    def __init__(self, scheduler: Scheduler, block_pool: BlockPool) -> None:
        self._scheduler, self._pool = scheduler, block_pool
        self._trace: deque[StepRecord] | None = None
        self._num_traced = 0

    @property
    def on(self) -> bool:
        return self._trace is not None

    def start(self) -> None:
        """Record each step's batch from now on, and which blocks prefix-cache hits take
        (``block_pool.block_states``)."""
        if self._trace is None:
            self._trace = deque(maxlen=STEP_TRACE_KEPT)
            self._pool.start_hit_log()

    def stop(self) -> None:
        """Stop recording (nobody watches any more); step numbers go on from where they were."""
        self._trace = None
        self._pool.stop_hit_log()

    def take(self) -> list[StepRecord]:
        """The steps traced since the last call, oldest first."""
        trace = self._trace
        if not trace:
            return []
        return [trace.popleft() for _ in range(len(trace))]

    def stepped(self, sched: SchedulerOutput, kinds: list[tuple[str, int]], updates: list, t0: float) -> None:
        """A step ran (``kinds``: ``step_kinds`` of its schedule, taken before the update)."""
        if self._trace is None or not (sched.seqs or sched.unschedulable):
            return
        sampled = {u.request.request_id: len(u.new_tokens) for u in updates}
        failed = {u.request.request_id for u in updates if u.error is not None}
        seqs = []
        for s, (kind, cached) in zip(sched.seqs, kinds, strict=True):
            req = s.request
            drafts = len(s.spec_token_ids)
            if req.request_id in failed:  # the step failed for it: nothing computed
                seqs.append(SeqRecord(req.request_id, kind, 0, 0, 0, 0, req.lora_name, req.finish_reason))
                continue
            accepted = max(0, min(drafts, sampled.get(req.request_id, 0) - 1)) if drafts else 0
            seqs.append(
                SeqRecord(
                    req.request_id,
                    kind,
                    s.num_new_tokens - drafts + accepted,
                    drafts,
                    accepted,
                    cached,
                    req.lora_name,
                    req.finish_reason,
                )
            )
        ended = [[r.request_id, r.finish_reason] for r in sched.unschedulable]  # ended in schedule(), never run
        self._record(t0, time.perf_counter() - t0, seqs, [r.request_id for r in sched.preempted], ended)

    def ended(self, ended: list[tuple[str, str]]) -> None:
        """Sequences ended between steps (aborted, a stop string): a record of their own,
        with no batch, so that a live view does not show them running on."""
        if self._trace is not None and ended:
            self._record(time.perf_counter(), 0.0, [], [], [list(e) for e in ended])

    def _record(
        self, t0: float, duration: float, seqs: list[SeqRecord], preempted: list[str], ended: list[list[str | None]]
    ) -> None:
        self._num_traced += 1
        self._trace.append(
            StepRecord(
                step=self._num_traced,
                time=t0,
                duration=duration,
                seqs=seqs,
                preempted=preempted,
                ended=ended,
                running=len(self._scheduler.running),
                waiting=len(self._scheduler.waiting),
                blocks_used=self._pool.num_used,
                blocks_cached=self._pool.num_cached_free,
            )
        )
