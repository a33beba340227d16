"""The scheduler: which requests compute how many tokens this step.

One rule (vLLM v1's): there are no prefill and decode phases. Each step every
request is given some of the tokens it has not computed yet, within a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests first, in admission order: a decode takes 1 token, an unfinished
   prompt takes the next chunk that fits the budget (chunked prefill);
2. then waiting requests, first come first served, starting after their cached
   prefix, while budget, sequence slots and KV blocks last.

When a running request cannot get a block, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to recompute its prompt and output so far when readmitted.
``policy="static"`` admits nothing while a batch is running: the baseline.

Speculative decoding fits the same rule: a decode that carries k draft tokens takes
1 + k tokens of the budget (its last token and the drafts, verified in one forward).
Sequences about to sample also get ``num_lookahead_slots`` slots past those tokens,
where a draft model writes K/V while it drafts. After the step, the computed count
grows by the tokens the target kept; slots of rejected drafts are overwritten later,
and whole blocks past the sequence's tokens go back to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "continuous"  # "continuous" | "static"
    num_lookahead_slots: int = 0  # per sampling sequence, for a model proposer's drafts

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.policy!r}")


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # including the draft tokens
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify, after the real tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token."""
        num_real = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + num_real == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot fit the KV pool even with nothing else running: the
    # engine ends them rather than let them wait forever.
    unschedulable: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.policy == "static" and not self.running:
            self._admit_static_batch()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if self.config.policy == "continuous" and not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first, then unfinished prompts, each in admission order."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_real = min(req.num_tokens - req.num_computed_tokens, budget)
            spec = req.spec_token_ids[: budget - num_real] if num_real == 1 else []
            num_new = num_real + len(spec)
            slots = num_new + self._lookahead(req, num_real)
            copies = self.kv.allocate_slots(req, slots)
            while copies is None:  # out of blocks: preempt from the back
                if len(self.running) == 1:  # alone and still too big for the pool
                    self.running.remove(req)
                    out.unschedulable.append(req)
                    break
                victim = self.running[-1]
                budget += self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, slots)
            if copies is None:
                continue
            out.seqs.append(ScheduledSeq(req, num_new, spec))
            out.block_copies.extend(copies)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if not self._try_fork(req, out):
                if req.fork_of is not None:  # its sibling's prompt is not computed yet
                    skipped.append(req)
                    continue
                cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
                num_computed = req.num_computed_tokens + len(cached) * self.kv.block_size
                num_new = min(req.num_tokens - num_computed, budget)
                lookahead = self.config.num_lookahead_slots if num_computed + num_new == req.num_tokens else 0
                copies = self.kv.allocate_slots(req, num_new + lookahead, cached)
                if copies is None:
                    if not self.running:  # nothing to wait for: it can never fit
                        out.unschedulable.append(req)
                        continue
                    self.waiting.appendleft(req)
                    break
                if req.num_computed_tokens == 0:
                    req.num_cached_prompt_tokens = max(req.num_cached_prompt_tokens, len(cached) * self.kv.block_size)
                req.num_computed_tokens = num_computed
                out.block_copies.extend(copies)
            else:
                num_new = 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _lookahead(self, req: Request, num_real: int) -> int:
        """Lookahead slots for a chunk that reaches the request's last token."""
        return self.config.num_lookahead_slots if req.num_computed_tokens + num_real == req.num_tokens else 0

    def _admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs waiting requests as one batch; they
        are then scheduled like running ones, and nothing joins until all have ended."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.num_computed_tokens == 0:
                cached = self.kv.find_cached_prefix(req)
                if cached and self.kv.allocate_slots(req, 0, cached) is not None:
                    req.num_computed_tokens = len(cached) * self.kv.block_size
                    req.num_cached_prompt_tokens = max(req.num_cached_prompt_tokens, req.num_computed_tokens)
            req.fork_of = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _try_fork(self, req: Request, out: SchedulerOutput) -> bool:
        """n > 1: share the sibling's computed prompt blocks and compute only the last
        prompt token (copy-on-write gives this request its own copy of that block)."""
        if req.fork_of is None:
            return False
        src = next((r for r in self.running if r.request_id == req.fork_of), None)
        prompt_len = len(req.prompt_token_ids)
        if src is None or src.num_computed_tokens < prompt_len:
            if src is None and not any(r.request_id == req.fork_of for r in self.waiting):
                req.fork_of = None  # the sibling is gone: compute independently
            return False
        self.kv.fork(src, req, prompt_len)
        req.num_computed_tokens = prompt_len - 1
        copies = self.kv.allocate_slots(req, 1 + self.config.num_lookahead_slots)
        if copies is None:  # no block for the copy: give the shared ones back, retry later
            self.kv.free(req)
            req.num_computed_tokens = 0
            return False
        out.block_copies.extend(copies)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and requeue it; returns budget it gave back."""
        self.running.remove(req)
        given_back = sum(s.num_new_tokens for s in out.seqs if s.request is req)
        out.seqs = [s for s in out.seqs if s.request is not req]
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        return given_back

    def update_after_step(
        self, out: SchedulerOutput, failed: Collection[str] = (), num_rejected: Mapping[str, int] | None = None
    ) -> None:
        """The scheduled tokens are now in the KV cache, except rejected drafts (their
        slots are overwritten later). Sequences whose step failed computed nothing."""
        num_rejected = num_rejected or {}
        for s in out.seqs:
            req = s.request
            req.spec_token_ids = []
            if req.request_id in failed:
                continue
            rejected = num_rejected.get(req.request_id, 0)
            assert 0 <= rejected <= len(s.spec_token_ids)
            req.num_computed_tokens += s.num_new_tokens - rejected

    def cache_and_trim(self, out: SchedulerOutput) -> None:
        """After the step's tokens are appended: full computed blocks join the prefix
        cache (their token ids are known now), and whole blocks past the request's
        tokens (rejected drafts, lookahead) go back to the pool."""
        for s in out.seqs:
            req = s.request
            if req.finished or req.status is not RequestStatus.RUNNING:
                continue
            self.kv.cache_computed_blocks(req)
            self.kv.trim(req, req.num_tokens)

    def finish(self, req: Request) -> None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
