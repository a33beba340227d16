"""The scheduler: which requests compute how many tokens this step, and what follows.

One rule (vLLM v1's): there are no prefill and decode phases. Each step every
request is given some of the tokens it has not computed yet, within a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests first: decodes, then unfinished prompts (chunked prefill), each
   in admission order;
2. then waiting requests, first come first served, starting after their cached
   prefix, while budget, sequence slots and KV blocks last; none after a preemption
   in the same step (blocks are short). With prefix caching, a waiting request whose
   next uncached block another request computes in this very step waits a step (SGLang's
   in-batch prefix caching): it then finds that block cached instead of computing it
   again (32 prompts sharing a ~1,000-token system prompt, arriving at once, computed it
   four times in the first 4,096-token step).

When a running request cannot get a block, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to recompute its prompt and output so far when readmitted.
``scheduling_policy="priority"`` (vLLM's) orders the waiting queue by each request's
``priority`` (lower first), then arrival, and preempts the running request that comes
last in that order; but it cannot starve a request: one that arrived
``priority_aging_steps`` steps ago goes ahead of all that arrived since, oldest first,
whatever their priorities, and once running is preempted only after them. Aging, not
a share of each step kept for lower classes: it bounds the wait itself (in steps: the
same schedule whatever the machine's speed) whatever the gap between priorities
(-1000 against 0 is no worse than -1 against 0), and one order serves admission and
preemption, so a request let in by age is not thrown out again by priority (no thrash).
Between clients the unit of fairness is the token: while several have prompt tokens to
compute, one client's prompt chunks take at most its share of the step (fairness.py).
``scheduling="static"`` admits nothing while a batch is running: the baseline.

Speculative decoding fits the same rule: a decode that carries k draft tokens takes
1 + k tokens of the budget. A sequence *drafts* this step when speculation is on,
no more than ``disable_batch_size`` requests run, its chunk reaches its last token and
there is room left under max_tokens and the context window; only then does it get
lookahead slots (for a model proposer's K/V) past its tokens.

A request with ``KVEviction`` computes at most what keeps its cache within its budget
each step (its prompt in chunks of about a stride), evicts after the step, and may run
past the context window: its cache, not its length, is what the window bounds.

``update_from_output`` is the one place where a step's results land: drafts kept
or rejected, computed counts, appended tokens, stop by token id or length, full
blocks cached, unused lookahead blocks trimmed, finished requests freed. What the
runner is told each step is ``RunnerSync``'s (engine/core/runner_sync.py).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from tokenmill.configuration.config import SchedulerConfig, SpeculativeConfig
from tokenmill.engine.core.fairness import TokenShares
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.runner_sync import RunnerSync
from tokenmill.engine.model_input import ModelInput, ModelOutput, SampledToken
from tokenmill.engine.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # including the draft tokens
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify, after the real tokens
    num_lookahead: int = 0  # drafts to propose after this step (0: it does not draft)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot fit the KV pool even with nothing else running: ended
    # now ("length") rather than left to wait forever.
    unschedulable: list[Request] = field(default_factory=list)
    model_input: ModelInput = field(default_factory=ModelInput)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass
class SeqUpdate:
    """What one step did to one sequence, for the output processor."""

    request: Request
    new_tokens: list[SampledToken]
    error: str | None = None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 1 << 30,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.speculative = speculative
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests, at most
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self.runner_sync = RunnerSync()  # what the runner holds; each step's deltas
        self.by_priority = config.scheduling_policy == "priority"
        self._arrivals = itertools.count()
        self._step = 0  # steps scheduled so far (the priority policy's clock)

    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        req.arrival_step = self._step
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue: at the back (fcfs), or in ``_order``."""
        if not self.by_priority:
            self.waiting.append(req)
            return
        keys = [self._order(r) for r in self.waiting]  # the queue is kept sorted by this key
        self.waiting.insert(bisect.bisect(keys, self._order(req)), req)

    def _order(self, req: Request) -> tuple[int, int, int]:
        """A request's place under the priority policy: those that arrived ``priority_aging_steps``
        ago or more first, oldest first; then the others by priority (lower first), then arrival."""
        if self._step - req.arrival_step >= self.config.priority_aging_steps:
            return (0, 0, req.arrival)
        return (1, req.params.priority, req.arrival)

    def _age(self) -> None:
        """A new step: waiting requests that have just come of age move ahead (sorted by ``_order``)."""
        self._step += 1
        of_age = self._step - self.config.priority_aging_steps
        if self.by_priority and any(r.arrival_step == of_age for r in self.waiting):
            ordered = sorted(self.waiting, key=self._order)
            self.waiting.clear()
            self.waiting.extend(ordered)

    def _shares(self) -> TokenShares:
        """This step's prompt-token share of each client with prompt tokens to compute."""
        prompts = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1] + list(self.waiting)
        level = (lambda r: self._order(r)[:2]) if self.by_priority else (lambda r: 0)
        return TokenShares(self.config.max_num_batched_tokens, prompts, level)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._age()
        if self.config.scheduling == "static" and not self.running:
            self._admit_static_batch()
        shares = self._shares()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, shares)
        if self.config.scheduling == "continuous" and not out.preempted:
            self._schedule_waiting(out, budget, shares)
        for req in out.unschedulable:
            self.finish(req, "length")
        scheduled = [(s.request, s.num_new_tokens, s.spec_token_ids, s.num_lookahead) for s in out.seqs]
        out.model_input = self.runner_sync.model_input(scheduled, out.block_copies, self.kv.runner_table)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, shares: TokenShares) -> int:
        """Decodes first, then unfinished prompts (each within its client's share), each
        in admission order."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            prompt = req.num_tokens - req.num_computed_tokens > 1
            num_real = min(
                req.num_tokens - req.num_computed_tokens,
                budget,
                shares.left(req.client) if prompt else 1,
                self._kv_room(req),
            )
            if num_real == 0:  # its client has had its share of this step
                continue
            spec = req.spec_token_ids[: budget - num_real] if num_real == 1 else []
            lookahead = self._num_lookahead(req, num_real, len(spec))
            copies = self.kv.allocate_slots(req, num_real + len(spec) + self._lookahead_slots(lookahead))
            if copies is None and (spec or lookahead):  # speculation is optional: drop it before preempting
                spec, lookahead = [], 0
                copies = self.kv.allocate_slots(req, num_real)
            num_new = num_real + len(spec)
            while copies is None:  # out of blocks: preempt from the back
                if len(self.running) == 1:  # alone and still too big for the pool
                    self.running.remove(req)
                    out.unschedulable.append(req)
                    break
                victim = max(self.running, key=self._order) if self.by_priority else self.running[-1]
                budget += self._preempt(victim, out)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, num_new)
            if copies is None:
                continue
            out.seqs.append(ScheduledSeq(req, num_new, spec, lookahead))
            out.block_copies.extend(copies)
            if prompt:
                shares.take(req.client, num_real)
            budget -= num_new
        return budget

    def _prompt_blocks_computed(self, req: Request, num_new: int) -> list[bytes]:
        """Hashes of the full prompt blocks that ``num_new`` more tokens of ``req`` compute (with
        prefix caching; none for a decode)."""
        if not self.kv.pool.enable_caching or req.evicts or req.num_computed_tokens >= len(req.prompt_token_ids):
            return []  # (an evicting request caches nothing: no one waits for its blocks)
        bs = self.kv.block_size
        end = min((req.num_computed_tokens + num_new) // bs, len(req.prompt_token_ids) // bs)
        return self.kv.block_hashes(req, req.num_computed_tokens // bs, end)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, shares: TokenShares) -> None:
        skipped: list[Request] = []
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        pending = (
            {h for s in out.seqs for h in self._prompt_blocks_computed(s.request, s.num_new_tokens)}
            if self.waiting
            else set()
        )
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.lora_name is not None and req.lora_name not in adapters and len(adapters) >= self.max_loras:
                skipped.append(req)  # every adapter slot is taken this step: wait for one to free up
                continue
            if shares.left(req.client) == 0:  # its client has had its share of this step
                skipped.append(req)
                continue
            forked = self._try_fork(req, out) if req.fork_of is not None else None
            if forked is None and req.fork_of is not None:  # its sibling's prompt is not computed yet
                skipped.append(req)
                continue
            if forked is not None:  # computes only its last prompt token
                num_new, lookahead = 1, forked
            else:
                cached = (
                    self.kv.find_cached_prefix(req)
                    if req.num_computed_tokens == 0 and not req.computes_whole_prompt
                    else []
                )
                num_computed = req.num_computed_tokens + len(cached) * self.kv.block_size
                nxt = num_computed // self.kv.block_size
                if pending and not req.computes_whole_prompt and (nxt + 1) * self.kv.block_size < req.num_tokens:
                    if self.kv.block_hashes(req, nxt, nxt + 1)[0] in pending:
                        skipped.append(req)  # another sequence computes its next block now: cached next step
                        continue
                num_new = min(req.num_tokens - num_computed, budget, shares.left(req.client), self._kv_room(req))
                lookahead = self._num_lookahead(req, num_new, 0, num_computed)
                copies = self.kv.allocate_slots(req, num_new + self._lookahead_slots(lookahead), cached)
                if copies is None and lookahead:  # admit it without drafting rather than not at all
                    lookahead = 0
                    copies = self.kv.allocate_slots(req, num_new, cached)
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
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            out.seqs.append(ScheduledSeq(req, num_new, [], lookahead))
            pending.update(self._prompt_blocks_computed(req, num_new))
            shares.take(req.client, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _kv_room(self, req: Request) -> int:
        """Tokens a request may compute this step: those that keep a streaming request's cache
        within its budget (``KVEviction``; it evicts after the step), those up to a SnapKV
        request's prompt's end, else any number."""
        ev = req.params.kv_eviction
        if ev is None:
            return self.max_model_len
        if ev.streams:
            return ev.budget(self.kv.block_size) - req.num_kv_tokens
        prompt = len(req.prompt_token_ids)  # SnapKV: compressed at the prompt's end, so a chunk stops there
        return prompt - req.num_computed_tokens if req.num_computed_tokens < prompt else self.max_model_len

    def _num_lookahead(self, req: Request, num_real: int, num_spec: int, num_computed: int | None = None) -> int:
        """Drafts to propose after this step: 0 unless this chunk reaches the request's
        last token, speculation is on and not paused, and there is room to use them."""
        spec = self.speculative
        computed = req.num_computed_tokens if num_computed is None else num_computed
        if (
            spec is None
            or req.pooling is not None
            or req.evicts
            or computed + num_real != req.num_tokens
            or len(self.running) > spec.disable_batch_size
        ):
            return 0
        room = min(
            req.params.max_tokens - len(req.output_token_ids) - 2,  # this step adds >= 1 token, the next <= k + 1
            self.max_model_len - req.num_tokens - num_spec - 1,  # drafted positions stay in the window
        )
        return max(0, min(spec.num_speculative_tokens, room))

    def _lookahead_slots(self, num_lookahead: int) -> int:
        """KV slots past the step's tokens that drafting writes (a model proposer's K/V)."""
        spec = self.speculative
        return num_lookahead if spec is not None and spec.num_lookahead_slots else 0

    def _admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs waiting requests as one batch; they
        are then scheduled like running ones, and nothing joins until all have ended."""
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.lora_name is not None and req.lora_name not in adapters and len(adapters) >= self.max_loras:
                skipped.append(req)
                continue
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            if req.num_computed_tokens == 0 and not req.computes_whole_prompt:
                cached = self.kv.find_cached_prefix(req)
                if cached and self.kv.allocate_slots(req, 0, cached) is not None:
                    req.num_computed_tokens = len(cached) * self.kv.block_size
                    req.num_cached_prompt_tokens = max(req.num_cached_prompt_tokens, req.num_computed_tokens)
            req.fork_of = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        self.waiting.extendleft(reversed(skipped))

    def _try_fork(self, req: Request, out: SchedulerOutput) -> int | None:
        """n > 1: share the sibling's computed prompt blocks and compute only the last
        prompt token (copy-on-write gives this request its own copy of that block).
        Returns the drafts it may propose after this step, or None when it did not fork."""
        assert req.fork_of is not None
        src = next((r for r in self.running if r.request_id == req.fork_of), None)
        prompt_len = len(req.prompt_token_ids)
        if src is None or src.num_computed_tokens < prompt_len:
            if src is None and not any(r.request_id == req.fork_of for r in self.waiting):
                req.fork_of = None  # the sibling is gone: compute independently
            return None
        self.kv.fork(src, req, prompt_len)
        req.num_computed_tokens = prompt_len - 1
        lookahead = self._num_lookahead(req, 1, 0)
        copies = self.kv.allocate_slots(req, 1 + self._lookahead_slots(lookahead))
        if copies is None and lookahead:
            lookahead = 0
            copies = self.kv.allocate_slots(req, 1)
        if copies is None:  # no block for the copy: give the shared ones back, retry later
            self.kv.free(req)
            req.num_computed_tokens = 0
            return None
        out.block_copies.extend(copies)
        return lookahead

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and requeue it; returns budget it gave back."""
        self.running.remove(req)
        given_back = sum(s.num_new_tokens for s in out.seqs if s.request is req)
        out.seqs = [s for s in out.seqs if s.request is not req]
        self.kv.free(req)
        self.runner_sync.forget(req, preempted=True)
        req.num_computed_tokens = req.num_evicted_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._enqueue(req)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req)
        return given_back

    # ------------------------------------------------------------- after a step

    def update_from_output(self, out: SchedulerOutput, result: ModelOutput) -> list[SeqUpdate]:
        """Everything that follows a forward, in one place (the caller knows no order)."""
        updates = [SeqUpdate(req, []) for req in out.unschedulable]
        for s in out.seqs:
            req = s.request
            rid = req.request_id
            req.spec_token_ids = []
            if rid in result.failed:  # computed nothing: nothing to cache either
                self.finish(req, "error")
                updates.append(SeqUpdate(req, [], error=result.failed[rid]))
                continue
            lost = self._lost_prompt_work(req, s, result)
            if lost is not None:  # never a silently short answer: the request fails, and says why
                self.finish(req, "error")
                updates.append(SeqUpdate(req, [], error=lost))
                continue
            sampled = result.sampled.get(rid, [])
            accepted = len(sampled) - 1 if s.spec_token_ids and sampled else 0
            if s.spec_token_ids:
                self.spec_stats.record(len(s.spec_token_ids), accepted)
            req.num_computed_tokens += s.num_new_tokens - (len(s.spec_token_ids) - accepted)
            if not s.spec_token_ids:  # before a token can end it: a one-token request's prompt is cached too
                self.kv.cache_computed_blocks(req)
            new_tokens = self._append(req, sampled)
            if req.status is RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(req)
                self.kv.trim(req, req.num_tokens)  # blocks that held only rejected drafts or lookahead
                self.kv.free_outside_window(req)
                self.kv.evict(req)
                draft = result.draft_token_ids.get(rid, [])
                req.spec_token_ids = draft[: self._max_drafts(req)]
                if req.grammar is not None and req.spec_token_ids:  # cut at the first the grammar refuses
                    del req.spec_token_ids[req.grammar.num_valid(req.spec_token_ids) :]
            if rid in result.embeddings:  # an embedding request: its prompt is done (its blocks cached), and so is it
                req.embedding = result.embeddings[rid]
                self.finish(req, "stop")
            if new_tokens or req.finished:  # a request ended by a refused token gains none
                updates.append(SeqUpdate(req, new_tokens))
        return updates

    @staticmethod
    def _lost_prompt_work(req: Request, s: ScheduledSeq, result: ModelOutput) -> str | None:
        """Take the step's prompt scores; what is missing that this chunk should have
        produced (an embedding at the end of the prompt, contiguous prompt scores)."""
        rid = req.request_id
        if rid in result.prompt_logprobs and not req.add_prompt_logprobs(*result.prompt_logprobs[rid]):
            return "prompt logprobs of a chunk were lost"
        done = req.num_computed_tokens + s.num_new_tokens >= len(req.prompt_token_ids)
        if req.pooling is not None and done and rid not in result.embeddings:
            return "the embedding was not computed"
        return None

    def _append(self, req: Request, sampled: list[SampledToken]) -> list[SampledToken]:
        """Append tokens one by one, up to the first that ends the request (a stop token,
        the end of its grammar, max_tokens or the context window).

        A token its grammar's matcher cannot take (it was allowed by the mask, but the
        matcher hit one of its limits taking it: a right-recursive grammar, thousands of
        alternatives) is dropped and the request ends as a cut-off ("length"): the output
        stays a valid prefix of the constraint, as at max_tokens, never an invalid whole."""
        for i, t in enumerate(sampled):
            p = req.params
            stop_token = t.token_id in p.stop_token_ids or (not p.ignore_eos and t.token_id in self.eos_token_ids)
            if not stop_token and req.grammar is not None and not req.grammar.accept([t.token_id]):
                logger.warning(
                    "request %s: structured output cut off after %d tokens: the grammar matcher stopped (%s)",
                    req.request_id,
                    len(req.output_token_ids),
                    req.grammar.error or "refused",
                )
                self.finish(req, "length")
                return sampled[:i]
            req.output_token_ids.append(t.token_id)
            if stop_token:  # the token id (the output processor leaves it out of the text; the API says None for EOS)
                self.finish(req, "stop", t.token_id)
            elif req.grammar is not None and req.grammar.is_terminated:
                self.finish(req, "stop")  # the output is complete: nothing but end-of-sequence may follow
            elif len(req.output_token_ids) >= p.max_tokens or (
                req.num_tokens >= self.max_model_len and not req.streams
            ):
                self.finish(req, "length")
            else:
                continue
            return sampled[: i + 1]
        return sampled

    def _max_drafts(self, req: Request) -> int:
        """Drafts worth verifying: accepting all and the bonus token stays within
        max_tokens, and every verified position within the context window."""
        return max(0, min(req.params.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens))

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a request (finished, stopped by a string, aborted or failed): free its blocks now."""
        if req.status is RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.runner_sync.forget(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
