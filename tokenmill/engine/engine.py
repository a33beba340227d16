"""The engine: add_request / abort / step.

Each step: the scheduler picks how many tokens each request computes; the engine
hands the model runner a ModelInput of ids and counts; the runner returns sampled
tokens; the engine appends them, checks stops, frees what finished and returns
per-request outputs. A failure inside the model step is pinned on the request that
causes it (by retrying the batch one sequence at a time): that request ends with
finish_reason "error", the others go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.model_input import ModelInput, ModelOutput, SeqInput
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.stats import StepStats
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


class Engine:
    def __init__(self, runner: Runner, tokenizer: TextTokenizer, config: EngineConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
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
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens but the context window is {self.max_model_len} tokens "
                "(it must leave room for at least one generated token)"
            )
        needed = self.kv.blocks_for(len(ids) + 1)
        if needed > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache has only "
                f"{self.block_pool.num_blocks}; raise kv_cache_memory"
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
        self.scheduler.update_after_step(sched, failed)
        for sid, err in failed.items():
            req = self.requests[sid]
            self._finish(req, "error")
            outputs.append(self._output(req, [], error=err))
        for s in batch.seqs:
            sampled = result.sampled.get(s.request_id)
            if sampled is not None and s.request_id not in failed:
                req = self.requests[s.request_id]
                outputs.append(self._append_token(req, sampled.token_id, sampled.logprob, sampled.top_logprobs))
        self.step_stats.append(self._stats(sched, t0))
        return outputs

    def _model_input(self, sched: SchedulerOutput) -> ModelInput:
        seqs = []
        for s in sched.seqs:
            req = s.request
            start = req.num_computed_tokens
            seqs.append(
                SeqInput(
                    request_id=req.request_id,
                    token_ids=req.token_ids_slice(start, start + s.num_new_tokens),
                    num_computed_tokens=start,
                    block_table=req.block_ids,
                    sample=s.samples,
                    params=req.params,
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
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
        sampled, failed = {}, {}
        for s in batch.seqs:
            alone = ModelInput(seqs=[s], block_copies=batch.block_copies)
            try:
                sampled.update(self.runner.execute(alone).sampled)
            except Exception as e:
                logger.exception("model step failed for %s", s.request_id)
                failed[s.request_id] = f"{type(e).__name__}: {e}"
        return ModelOutput(sampled=sampled), failed

    def _stats(self, sched: SchedulerOutput, t0: float) -> StepStats:
        decode = sum(1 for s in sched.seqs if s.num_new_tokens == 1 and s.request.output_token_ids)
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

    def _append_token(self, req: Request, token: int, logprob: float | None, top: list) -> RequestOutput:
        now = time.perf_counter()
        req.output_token_ids.append(token)
        req.timings.token_times.append(now)
        req.timings.first_token = req.timings.first_token or now
        if req.params.logprobs is not None:
            req.logprobs.append(logprob)
            req.top_logprobs.append(top)
        reason, stop_reason = self._check_stop(req, token)
        if reason is not None:
            self._finish(req, reason, stop_reason)
        return self._output(req, [token])

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
