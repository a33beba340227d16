"""The job that answers one /v1/responses request (``ResponseJob``): one engine
request, its answer turned into output items by responses.py's ``OutputBuilder``, sent
whole or as OpenAI's typed events, and stored when the request asks. It offers what a
router needs (``run``, ``replay``, ``ask_logprobs``) as the chat job does, so a
router's name works here too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.response_cache import detach
from tokenmill.server.gateway.served import Served, check_queue
from tokenmill.server.jobs.job import with_logprobs
from tokenmill.server.jobs.reasoning import Reasoning
from tokenmill.server.jobs.response_items import OutputBuilder, ResponseShape, output_messages, sse_event
from tokenmill.server.jobs.response_items import usage as responses_usage
from tokenmill.server.jobs.streaming import DrainExpired, chain, until, until_disconnect
from tokenmill.server.jobs.tools import ToolRequest
from tokenmill.server.protocol.error_responses import error_response


class ResponseJob:
    """One /v1/responses request: one engine request, its answer as output items
    (``OutputBuilder``), whole or as OpenAI's typed events; stored when asked."""

    def __init__(
        self,
        served: Served,
        target: Target,
        shape: ResponseShape,
        ids: list[int],
        params: SamplingParams,
        tools: ToolRequest | None,
        owner: str,
        conversation: list[dict[str, Any]],
        reasoning: Reasoning | None = None,
    ) -> None:
        self.served, self.target, self.shape, self.ids, self.params, self.tools = (
            served,
            target,
            shape,
            ids,
            params,
            tools,
        )
        self.owner, self.conversation = owner, conversation
        self.reasoning = reasoning  # --reasoning-parser: a reasoning item, and reasoning_tokens
        self.observed = False  # its output is in the metrics already (a replay)

    # a router drives this job as it drives a chat one (gateway.routed)
    @property
    def longest_prompt(self) -> int:
        return len(self.ids)

    def ask_logprobs(self) -> None:
        self.params = with_logprobs(self.params)  # (a response never shows them: top_logprobs is refused)

    async def run(self) -> list[tuple[int, RequestOutput]]:
        check_queue(self.served, self.target, self.params.n)
        final = None
        async with contextlib.aclosing(
            self.target.engine.generate(self.shape.id, self.ids, self.params, self.target.lora)
        ) as stream:
            async for out in stream:
                if out.finished:
                    self.served.observe_finished(out, self.target.model.name)
                    final = detach(out)
        return [] if final is None else [(0, final)]

    async def replay(self, request: Request, _: bool, finals: list[tuple[int, RequestOutput]]) -> Response:
        self.observed = True

        async def nothing() -> AsyncIterator[RequestOutput]:
            return
            yield

        first = [out for _, out in finals]
        if self.shape.request.stream:
            return StreamingResponse(self._events(first, nothing()), media_type="text/event-stream")
        return await until_disconnect(request, self._whole(first, nothing()))

    async def respond(self, request: Request, _: bool = False) -> Response:
        """(The request's own ``stream`` decides; the flag is the chat job's.)"""
        check_queue(self.served, self.target, self.params.n)
        stream = self.target.engine.generate(self.shape.id, self.ids, self.params, self.target.lora)
        try:
            first = [await anext(stream)]  # surfaces an invalid request as a 400 before any byte is sent
        except StopAsyncIteration:
            first = []
        except RequestFailedError as e:
            await stream.aclose()
            return error_response(500, str(e))
        if self.shape.request.stream:
            return StreamingResponse(self._events(first, stream), media_type="text/event-stream")
        return await until_disconnect(request, self._whole(first, stream))

    async def _whole(self, first: list, stream: AsyncIterator[RequestOutput]) -> Response:
        final = None
        try:
            async for out in chain(first, stream):
                if out.finished:
                    final = out
        except RequestFailedError as e:
            return error_response(500, str(e))
        finally:
            await stream.aclose()
        builder = OutputBuilder(self.tools, self.reasoning)
        builder.feed(final.text if final is not None else "", finished=True)
        return JSONResponse(self._finish(builder.output, final))

    async def _events(self, first: list, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        sequence = itertools.count()
        yield sse_event("response.created", next(sequence), response=self.shape.body("in_progress", [], None))
        yield sse_event("response.in_progress", next(sequence), response=self.shape.body("in_progress", [], None))
        builder, final = OutputBuilder(self.tools, self.reasoning), None
        try:
            async for out in until(chain(first, stream), self.served.drain_expired):
                for kind, payload in builder.feed(out.delta_text, out.finished):
                    yield sse_event(kind, next(sequence), **payload)
                if out.finished:
                    final = out
            body = self._finish(builder.output, final)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield sse_event(kind, next(sequence), response=body)
        except (InvalidRequestError, RequestFailedError, EngineDeadError, DrainExpired) as e:
            status = 400 if isinstance(e, InvalidRequestError) else 500 if isinstance(e, RequestFailedError) else 503
            message = str(e) or "the server is shutting down and its drain timeout has passed: request aborted"
            yield sse_event("error", next(sequence), code=status, message=message, param=getattr(e, "param", None))
        finally:
            await stream.aclose()

    def _finish(self, output: list[dict[str, Any]], final: RequestOutput | None) -> dict[str, Any]:
        """The finished response (stored when asked); ``final``: the engine's last output."""
        if final is not None and not self.observed:
            self.served.observe_finished(final, self.target.model.name)
        reason = final.finish_reason if final is not None else "abort"
        incomplete = None if reason in ("stop", "tool_calls") else "max_output_tokens" if reason == "length" else reason
        tokens = len(final.token_ids) if final is not None else 0
        cached = final.num_cached_tokens if final is not None else 0
        thought = self.reasoning.reasoning_tokens(list(final.token_ids)) if self.reasoning and final else 0
        body = self.shape.body(
            "incomplete" if incomplete else "completed",
            output,
            responses_usage(len(self.ids), tokens, cached, thought),
            incomplete,
        )
        if self.shape.request.store:
            self.served.responses.put(self.owner, body, self.conversation + output_messages(output))
        return body
