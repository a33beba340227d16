"""The engine: add_request / abort / step.

Each step asks the scheduling policy which tokens to compute, hands the model
runner a ModelInput of ids and counts, appends the sampled tokens, checks stops,
frees what finished and returns per-request outputs.

This first engine serves one request at a time (first come, first served): the
whole prompt in one step, then one token per step. The paged block tables are
already real, so the continuous-batching scheduler replaces only ``_schedule``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.model_input import ModelInput, ModelOutput, SeqInput
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


class Runner(Protocol):
    def execute(self, batch: ModelInput) -> ModelOutput: ...


class TextTokenizer(Protocol):
    stop_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Engine:
    def __init__(
        self, runner: Runner, tokenizer: TextTokenizer, block_pool: BlockPool, block_size: int, max_model_len: int
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._finished_ids: list[str] = []

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, add_special_tokens: bool = True
    ) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, ids = None, list(prompt)
        self._validate_prompt(ids)
        req = Request(request_id=request_id, prompt=text, prompt_token_ids=ids, params=params)
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        self.waiting.append(req)
        return req

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens but the context window is {self.max_model_len} tokens "
                "(it must leave room for at least one generated token)"
            )
        needed = -(-(len(ids) + 1) // self.block_size)
        if needed > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache has only "
                f"{self.block_pool.num_blocks}; raise kv_cache_memory"
            )

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")
            del self.requests[request_id], self._detok[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        batch = self._schedule()
        batch.finished_request_ids, self._finished_ids = self._finished_ids, []
        if not batch.seqs:
            self.runner.execute(batch)
            return []
        now = time.perf_counter()
        for s in batch.seqs:
            req = self.requests[s.request_id]
            req.timings.first_scheduled = req.timings.first_scheduled or now
        result = self.runner.execute(batch)
        outputs = []
        for s in batch.seqs:
            req = self.requests[s.request_id]
            req.num_computed_tokens += len(s.token_ids)
            sampled = result.sampled.get(s.request_id)
            if sampled is not None:
                outputs.append(self._append_token(req, sampled.token_id, sampled.logprob, sampled.top_logprobs))
        return outputs

    def _schedule(self) -> ModelInput:
        """One request at a time: its whole prompt, then one token per step."""
        if not self.running and self.waiting:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        if not self.running:
            return ModelInput(seqs=[])
        req = self.running[0]
        new_tokens = req.all_token_ids[req.num_computed_tokens :]
        self._ensure_blocks(req, req.num_computed_tokens + len(new_tokens))
        return ModelInput(
            seqs=[
                SeqInput(
                    request_id=req.request_id,
                    token_ids=new_tokens,
                    num_computed_tokens=req.num_computed_tokens,
                    block_table=req.block_ids,
                    sample=True,
                    params=req.params,
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
                )
            ]
        )

    def _ensure_blocks(self, req: Request, num_tokens: int) -> None:
        missing = -(-num_tokens // self.block_size) - len(req.block_ids)
        if missing > 0:
            req.block_ids.extend(self.block_pool.allocate(missing))

    # -------------------------------------------------------------------- output

    def _append_token(self, req: Request, token: int, logprob: float | None, top: list) -> RequestOutput:
        now = time.perf_counter()
        before = len(req.output_token_ids)
        req.output_token_ids.append(token)
        req.timings.token_times.append(now)
        req.timings.first_token = req.timings.first_token or now
        if req.params.logprobs is not None:
            req.logprobs.append(logprob)
            req.top_logprobs.append(top)
        reason, stop_reason = self._check_stop(req, token)
        if reason is not None:
            self._finish(req, reason, stop_reason)
        return self._output(req, req.output_token_ids[before:])

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

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.timings.finished = time.perf_counter()
        if not isinstance(stop_reason, str):  # a stop string truncated the text already
            self._detok[req.request_id].flush()
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.block_pool.free(req.block_ids)
        req.block_ids = []
        self._finished_ids.append(req.request_id)

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        detok = self._detok[req.request_id]
        delta = detok.take_delta(req.finished)
        completion = CompletionOutput(
            index=0,
            text=detok.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.top_logprobs) if req.params.logprobs is not None else None,
        )
        if req.finished:
            del self._detok[req.request_id]
            del self.requests[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.finished,
            timings=[req.timings],
            delta_text=delta,
            delta_token_ids=new_ids,
        )
