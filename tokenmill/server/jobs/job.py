"""The job that answers one chat or completions request: ``Job`` starts its engine requests
(prompts x n, through the client's window when there are several), counts them in the
metrics as they end, and answers whole (answer.py) or as OpenAI's server-sent events
(sse.py); or it answers from finished outputs alike (``replay``: a cached answer, or the
small model's that a router kept). What was asked is the route's ``Asked`` (asked.py),
made once and only read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.response_cache import detach, replayed
from tokenmill.server.gateway.served import Served, check_queue
from tokenmill.server.jobs.answer import Answer
from tokenmill.server.jobs.asked import Asked
from tokenmill.server.jobs.sse import EventStream
from tokenmill.server.jobs.streaming import chain, merge, until, until_disconnect
from tokenmill.server.protocol.error_responses import error_response
from tokenmill.server.protocol.openai import new_id, now


def with_logprobs(params: SamplingParams) -> SamplingParams:
    """``params`` asking for each token's logprob (a router's cascade judges by them)."""
    return replace(params, logprobs=0) if params.logprobs is None else params


class Job:
    """One API request run on one target: its prompts (a completions request may carry
    several), each one engine request with n sequences."""

    def __init__(self, served: Served, target: Target, asked: Asked) -> None:
        self.served = served
        self.target = target
        self.asked = asked
        self.params = asked.params  # what the engine is asked (a router's cascade adds logprobs)
        answer_id = f"{asked.prefix}-{asked.request_id}" if asked.request_id else new_id(asked.prefix)
        self.answer = Answer(asked, answer_id, now(), target.name, target.tokenizer)
        self.observed = False  # its outputs are in the metrics already (a replay)
        # Called with the finished sequences (prompt index, output) of an answer that ended
        # well (every sequence stopped or reached its length): the response cache keeps it.
        self.on_answered: Callable[[list[tuple[int, RequestOutput]]], None] | None = None
        self.place: Callable[[], AbstractAsyncContextManager] | None = None  # the client's window (several prompts)

    def _start(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        first = self.params if self.place is None else self.params[: self.served.windows.size]  # in at once
        check_queue(self.served, self.target, sum(p.n for p in first))  # engine sequences: prompts x n
        streams = [
            self.target.engine.generate(f"{self.answer.id}-{i}", ids, p, self.target.lora)
            for i, (ids, p) in enumerate(zip(self.asked.prompts, self.params, strict=True))
        ]
        merged = merge(streams, self.place)
        return _prompt_only(merged) if self.asked.prompt_only else merged

    async def respond(self, request: Request, stream: bool) -> Response:
        merged = self._start()
        try:
            first = await anext(merged)  # surfaces an invalid request as a 400 before any byte is sent
        except StopAsyncIteration:
            first = None
        except RequestFailedError as e:
            await merged.aclose()
            return error_response(500, str(e))
        if stream:
            return StreamingResponse(self._sse(first, merged), media_type="text/event-stream")
        return await until_disconnect(request, self._collect(first, merged))

    @property
    def longest_prompt(self) -> int:
        return max(len(p) for p in self.asked.prompts)

    def ask_logprobs(self) -> None:
        """Have the engine report each token's logprob (a router's cascade judges by them);
        the answer shows them only if the client asked."""
        self.params = [with_logprobs(p) for p in self.params]

    async def run(self) -> list[tuple[int, RequestOutput]]:
        """Every sequence's final output, whole (``detach``), without answering (a router's
        cascade judges them first); RequestFailedError if one failed."""
        finals = []
        async with contextlib.aclosing(self._start()) as merged:
            async for i, out in merged:
                self._observe(i, out)
                if out.finished:
                    finals.append((i, detach(out)))
        return finals

    async def replay(self, request: Request, stream: bool, finals: list[tuple[int, RequestOutput]]) -> Response:
        """Answer with finished outputs (cached, or judged by a router), streamed or not."""
        self.observed = True  # in metrics already, or not engine work at all

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            for i, out in finals:
                yield i, replayed(out) if self.answer.cached else out

        if stream:
            return StreamingResponse(self._sse(None, outputs()), media_type="text/event-stream")
        return await until_disconnect(request, self._collect(None, outputs()))

    def _answered(self, finals: list[tuple[int, RequestOutput]]) -> None:
        if self.on_answered is not None and finals and all(o.finish_reason in ("stop", "length") for _, o in finals):
            self.on_answered(finals)

    def _observe(self, i: int, out: RequestOutput) -> None:
        """Prompt ``i``'s sequence ``out`` in the metrics, once it has ended."""
        if out.finished and not self.observed:
            self.served.observe_finished(out, self.target.model.name, self.params[i].max_tokens)

    async def _collect(self, first, merged) -> JSONResponse:
        finals: dict[int, RequestOutput] = {}
        ended: list[tuple[int, RequestOutput]] = []
        items = [first] if first is not None else []
        try:
            async for item in chain(items, merged):
                i, out = item
                self._observe(i, out)
                if out.finished:
                    finals[self.answer.choice_index(i, out)] = out
                    ended.append((i, out))
        except RequestFailedError as e:
            return error_response(500, str(e))
        self._answered(ended)
        return JSONResponse(await self.answer.body(finals))

    def _sse(self, first, merged) -> AsyncIterator[str]:
        outputs = until(chain([first] if first is not None else [], merged), self.served.drain_expired)
        return EventStream(self.answer).events(outputs, merged, self._observe, self._answered)


async def _prompt_only(merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a prompt-scoring request (echo, max_tokens 0: run with max_tokens 1),
    without the token generated: no text, token or logprob, and finish_reason length."""
    async with contextlib.aclosing(merged):
        async for i, out in merged:
            kept = [
                replace(
                    c,
                    finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
                    stop_reason=None,
                    _num_tokens=0,
                    _num_chars=0,
                )
                for c in out.outputs
            ]
            yield (
                i,
                replace(
                    out,
                    outputs=kept,
                    delta_text="",
                    delta_token_ids=[],
                    delta_logprobs=None if out.delta_logprobs is None else [],
                    delta_top_logprobs=None if out.delta_top_logprobs is None else [],
                ),
            )
