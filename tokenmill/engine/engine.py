"""The engine: add_request / abort / step.

Each step: the scheduler picks how many tokens each request computes; the engine
hands the model runner a ModelInput of ids and counts; the runner returns sampled
tokens; the engine appends them, checks stops, frees what finished and returns
per-request outputs. A failure inside the model step is pinned on the request that
causes it (by retrying the batch one sequence at a time): that request ends with
finish_reason "error", the others go on.

With speculative decoding the runner also returns draft tokens for each sampling
request; the engine keeps them on the request for the scheduler to verify next step
(capped so that they cannot run past max_tokens or the context window), and each
step may then add several tokens to a request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.model_input import ModelInput, ModelOutput, SampledToken, SeqInput
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.stats import SpecDecodeStats, StepStats
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STEP_STATS_KEPT = 100_000


class Runner(Protocol):
    def execute(self, batch: ModelInput) -> ModelOutput: ...


class TextTokenizer(Protocol):
    stop_token_ids: frozenset[int]

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None


class Engine:
    def __init__(self, runner: Runner, tokenizer: TextTokenizer, config: EngineConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, config.block_size)
        spec = config.speculative
        lookahead = spec.num_lookahead_slots if spec is not None else 0
        self.scheduler = Scheduler(replace(config.scheduler, num_lookahead_slots=lookahead), self.kv)
        self.spec_stats = SpecDecodeStats()
        self.requests: dict[str, Request] = {}  # live sequences, by sequence id
        self.groups: dict[str, list[str]] = {}  # request id -> its sequence ids (n of them)
        # The most recent steps' stats (bounded: a server runs for days).
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._finished_ids: list[str] = []

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, add_special_tokens: bool = True
    ) -> list[Request]:
        """Queue a request; n > 1 becomes n sequences sharing the prompt's KV blocks."""
        if request_id in self.groups:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, ids = None, list(prompt)
        self._validate_prompt(ids)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        reqs = []
        for i, sid in enumerate(seq_ids):
            seed = None if params.seed is None else params.seed + i
            req = Request(
                request_id=sid,
                prompt=text,
                prompt_token_ids=ids,
                params=replace(params, n=1, seed=seed) if params.n > 1 else params,
                parent_id=request_id,
                index=i,
                fork_of=seq_ids[0] if i > 0 else None,
            )
            self.requests[sid] = req
            self._detok[sid] = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            self.scheduler.add(req)
            reqs.append(req)
        self.groups[request_id] = seq_ids
        return reqs

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed", param="prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens but the context window is {self.max_model_len} tokens "
                "(it must leave room for at least one generated token)",
                param="prompt",
            )
        needed = self.kv.blocks_for(len(ids) + 1)
        if needed > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache has only "
                f"{self.block_pool.num_blocks}; raise kv_cache_memory",
                param="prompt",
            )

    def abort(self, request_id: str) -> None:
        """End a request (all its n sequences) now and free everything it holds."""
        for sid in self.groups.pop(request_id, []):
            req = self.requests.pop(sid, None)
            if req is not None and not req.finished:
                self._finish(req, "abort")
            self._detok.pop(sid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs = [self._end_unschedulable(r) for r in sched.unschedulable]
        batch = self._model_input(sched)
        if not sched.seqs:
            if batch.finished_request_ids:
                self.runner.execute(batch)
            return outputs
        for s in sched.seqs:
            s.request.timings.first_scheduled = s.request.timings.first_scheduled or t0
        result, failed = self._execute(batch)
        self.scheduler.update_after_step(sched, failed, self._count_rejected(sched, result, failed))
        for sid, err in failed.items():
            req = self.requests[sid]
            self._finish(req, "error")
            outputs.append(self._output(req, [], error=err))
        for s in batch.seqs:
            sampled = result.sampled.get(s.request_id)
            if sampled and s.request_id not in failed:
                outputs.append(self._append_tokens(self.requests[s.request_id], sampled))
        self.scheduler.cache_and_trim(sched)
        for rid, draft in result.draft_token_ids.items():
            req = self.requests.get(rid)
            if req is not None and not req.finished and rid not in failed:
                req.spec_token_ids = draft[: self._max_drafts(req)]
        self.step_stats.append(self._stats(sched, t0))
        return outputs

    def _count_rejected(self, sched: SchedulerOutput, result: ModelOutput, failed: dict[str, str]) -> dict[str, int]:
        """Drafts the target rejected, per verifying sequence (and the acceptance stats)."""
        rejected = {}
        for s in sched.seqs:
            rid = s.request.request_id
            if not s.spec_token_ids or rid in failed or rid not in result.sampled:
                continue
            accepted = len(result.sampled[rid]) - 1
            rejected[rid] = len(s.spec_token_ids) - accepted
            self.spec_stats.record(len(s.spec_token_ids), accepted)
        return rejected

    def _max_drafts(self, req: Request) -> int:
        """Drafts worth verifying: accepting all and the bonus token stays within
        max_tokens, and every verified position within the context window."""
        return max(0, min(req.params.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens))

    def _num_lookahead(self, req: Request, spec_len: int) -> int:
        """How many drafts to ask for after this step (0: this step does not propose)."""
        spec = self.config.speculative
        if spec is None or len(self.scheduler.running) > spec.disable_batch_size:
            return 0
        room = min(
            req.params.max_tokens - len(req.output_token_ids) - 2,  # this step adds >= 1 token, the next <= k + 1
            self.max_model_len - req.num_tokens - spec_len - 1,  # drafted positions stay in the window
        )
        return max(0, min(spec.num_speculative_tokens, room))

    def _model_input(self, sched: SchedulerOutput) -> ModelInput:
        seqs = []
        for s in sched.seqs:
            req = s.request
            start = req.num_computed_tokens
            num_real = s.num_new_tokens - len(s.spec_token_ids)
            seqs.append(
                SeqInput(
                    request_id=req.request_id,
                    token_ids=req.token_ids_slice(start, start + num_real) + s.spec_token_ids,
                    num_computed_tokens=start,
                    block_table=req.block_ids,
                    sample=s.samples,
                    params=req.params,
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
                    spec_token_ids=s.spec_token_ids,
                    num_lookahead=self._num_lookahead(req, len(s.spec_token_ids)) if s.samples else 0,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        return ModelInput(seqs=seqs, block_copies=sched.block_copies, finished_request_ids=finished)

    def _execute(self, batch: ModelInput) -> tuple[ModelOutput, dict[str, str]]:
        """Run the batch; on failure, run it one sequence at a time to find the culprit.

        Retrying is safe: K/V written for the same positions are the same values, and
        block copies read blocks that no step has written since.
        """
        try:
            return self.runner.execute(batch), {}
        except Exception as e:
            if len(batch.seqs) == 1:
                logger.exception("model step failed for %s", batch.seqs[0].request_id)
                return ModelOutput(sampled={}), {batch.seqs[0].request_id: f"{type(e).__name__}: {e}"}
        merged, failed = ModelOutput(sampled={}), {}
        for s in batch.seqs:
            alone = ModelInput(seqs=[s], block_copies=batch.block_copies)
            try:
                out = self.runner.execute(alone)
            except Exception as e:
                logger.exception("model step failed for %s", s.request_id)
                failed[s.request_id] = f"{type(e).__name__}: {e}"
                continue
            merged.sampled.update(out.sampled)
            merged.draft_token_ids.update(out.draft_token_ids)
        return merged, failed

    def _stats(self, sched: SchedulerOutput, t0: float) -> StepStats:
        decode = sum(
            s.num_new_tokens for s in sched.seqs if s.spec_token_ids or (s.num_new_tokens == 1 and s.request.output_token_ids)
        )
        return StepStats(
            time=t0,
            duration=time.perf_counter() - t0,
            num_seqs=len(sched.seqs),
            num_decode_tokens=decode,
            num_prefill_tokens=sched.num_tokens - decode,
            num_preempted=len(sched.preempted),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_pool.num_used,
            kv_blocks_free=self.block_pool.num_free,
            kv_blocks_cached=self.block_pool.num_cached_free,
            kv_tokens_held=sum(r.num_computed_tokens for r in self.scheduler.running),
            kv_slots_held=sum(len(r.block_ids) for r in self.scheduler.running) * self.block_size,
        )

    # -------------------------------------------------------------------- output

    def _append_tokens(self, req: Request, tokens: list[SampledToken]) -> RequestOutput:
        """Append the step's tokens one by one, stopping at the first that ends the request."""
        now = time.perf_counter()
        new_ids = []
        for t in tokens:
            req.output_token_ids.append(t.token_id)
            new_ids.append(t.token_id)
            req.timings.token_times.append(now)
            req.timings.first_token = req.timings.first_token or now
            if req.params.logprobs is not None:
                req.logprobs.append(t.logprob)
                req.top_logprobs.append(t.top_logprobs)
            reason, stop_reason = self._check_stop(req, t.token_id)
            if reason is not None:
                self._finish(req, reason, stop_reason)
                break
        return self._output(req, new_ids)

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, str | int | None]:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.stop_token_ids):
            return "stop", token
        stop_str = self._detok[req.request_id].add_token(token)
        if stop_str is not None:
            return "stop", stop_str
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _end_unschedulable(self, req: Request) -> RequestOutput:
        logger.warning("%s needs more KV blocks than the cache has; ending it", req.request_id)
        self._finish(req, "length")
        return self._output(req, [])

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.timings.finished = time.perf_counter()
        detok = self._detok.get(req.request_id)
        if detok is not None and not isinstance(stop_reason, str):  # a stop string truncated it already
            detok.flush()
        self._finished_ids.append(req.request_id)

    def _output(self, req: Request, new_ids: list[int], error: str | None = None) -> RequestOutput:
        detok = self._detok[req.request_id]
        delta = detok.take_delta(req.finished)
        has_logprobs = req.params.logprobs is not None
        completion = CompletionOutput(
            index=req.index,
            text=detok.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if has_logprobs else None,
            top_logprobs=list(req.top_logprobs) if has_logprobs else None,
        )
        if req.finished:
            self._forget(req)
        return RequestOutput(
            request_id=req.parent_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.finished,
            timings=[req.timings],
            delta_text=delta,
            delta_token_ids=new_ids,
            error=error,
            num_cached_tokens=req.num_cached_prompt_tokens,
        )

    def _forget(self, req: Request) -> None:
        del self._detok[req.request_id], self.requests[req.request_id]
        group = self.groups.get(req.parent_id)
        if group is not None and all(sid not in self.requests for sid in group):
            del self.groups[req.parent_id]
