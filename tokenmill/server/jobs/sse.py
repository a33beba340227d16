"""How a chat or completions answer streams: OpenAI's server-sent events, one chunk per
choice's delta (role first, then the echoed prompt and vLLM's prompt logprobs, text or
reasoning or tool-call deltas, the finish), usage (final or continuous) and timings at the
end, an error as a last event in OpenAI's shape, then ``[DONE]``. The chunks are built from
the same pieces as the whole answer (answer.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.server.jobs.answer import Answer, timings
from tokenmill.server.jobs.reasoning import ReasoningSplitter
from tokenmill.server.jobs.streaming import DrainExpired
from tokenmill.server.jobs.tools import ToolStream
from tokenmill.server.protocol.openai import error_body


class EventStream:
    """One answer's events; ``completion_so_far`` counts each choice's tokens (continuous usage)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.asked = answer.asked
        self.completion_so_far: dict[int, int] = {}

    async def events(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        streams: AsyncIterator[tuple[int, RequestOutput]],
        observe: Callable[[int, RequestOutput], None],
        answered: Callable[[list[tuple[int, RequestOutput]]], None],
    ) -> AsyncIterator[str]:
        """The events of ``outputs`` (prompt index, output), each ``observe``d as it comes and the
        ended ones ``answered`` when all went well; the engine ``streams`` they are read from are
        closed (their requests aborted if unfinished) before the last event, whatever happens."""
        a = self.asked
        finals: list[RequestOutput] = []
        ended: list[tuple[int, RequestOutput]] = []
        started: set[int] = set()
        tool_streams: dict[int, ToolStream] = {}  # with tools: each choice's answer, as deltas
        splitters: dict[int, ReasoningSplitter] = {}  # with a reasoning parser: each choice's answer split
        try:
            async for i, out in outputs:
                observe(i, out)
                idx = self.answer.choice_index(i, out)
                c = out.outputs[0]
                self.completion_so_far[idx] = len(c.token_ids)
                first_of_choice = idx not in started
                if first_of_choice:
                    started.add(idx)
                    if a.chat:
                        yield self.chunk(
                            [
                                {
                                    "index": idx,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            top=await self.top() if len(started) == 1 else None,
                        )
                    head = self.head(idx, out)
                    if head is not None:
                        yield self.chunk([head])
                n_new = len(out.delta_token_ids)
                lps = None
                if out.delta_logprobs is not None and n_new and a.logprobs:  # deltas: O(new tokens) per chunk
                    lps = self.answer.logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
                thought, text = "", out.delta_text
                if a.reasoning is not None:
                    splitter = splitters.setdefault(idx, a.reasoning.splitter())
                    thought, text = splitter.feed(out.delta_text, out.finished)
                    thought = thought if a.extras.reasoning else ""  # include_reasoning false
                if a.tools is not None:
                    stream = tool_streams.setdefault(idx, ToolStream(a.tools))
                    if thought:  # tool calls are parsed from the content after it
                        yield self.chunk(
                            [
                                {
                                    "index": idx,
                                    "delta": {"reasoning": thought, "reasoning_content": thought},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    for delta in stream.feed(text, out.finished):
                        yield self.chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
                    if out.finished:
                        reason = "tool_calls" if stream.calls and c.finish_reason == "stop" else c.finish_reason
                        yield self.chunk(
                            [
                                {
                                    "index": idx,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": reason,
                                    "stop_reason": c.stop_reason,
                                }
                            ]
                        )
                elif text or thought or out.finished or lps is not None:
                    choice: dict[str, Any] = {
                        "index": idx,
                        "logprobs": lps,
                        "finish_reason": c.finish_reason if out.finished else None,
                    }
                    if a.chat:
                        choice["delta"] = {"reasoning": thought, "reasoning_content": thought} if thought else {}
                        if text:
                            choice["delta"]["content"] = text
                    else:
                        choice["text"] = out.delta_text
                    if out.finished:
                        choice["stop_reason"] = c.stop_reason
                    if a.extras.token_ids:
                        choice["token_ids"] = list(out.delta_token_ids)
                        if first_of_choice and not a.chat:
                            choice["prompt_token_ids"] = a.prompts[i]
                    yield self.chunk([choice])
                if out.finished:
                    finals.append(out)
                    ended.append((i, out))
            answered(ended)
            if a.usage_stats is not None:
                yield self.chunk([], usage=self.answer.usage(finals))
            if a.return_timings:
                yield f"data: {json.dumps({'id': self.answer.id, 'timings': [timings(o) for o in finals]})}\n\n"
        except InvalidRequestError as e:  # a later prompt of a batch was refused after streaming began
            yield f"data: {json.dumps(error_body(str(e), 'BadRequestError', 400, e.param))}\n\n"
        except RequestFailedError as e:
            yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(str(e), 'ServiceUnavailableError', 503))}\n\n"
        except DrainExpired:
            message = "the server is shutting down and its drain timeout has passed: request aborted"
            yield f"data: {json.dumps(error_body(message, 'ServiceUnavailableError', 503))}\n\n"
        finally:
            await streams.aclose()
        yield "data: [DONE]\n\n"

    def head(self, index: int, out: RequestOutput) -> dict | None:
        """A choice's first chunk when it has one: the echoed prompt (with its logprobs
        when asked) and vLLM's prompt_logprobs. Sent with the choice's first output,
        which for a sequence 0 carries the prompt's logprobs whole."""
        a = self.asked
        echo = a.echo(index)
        scored = out if out.prompt_logprobs is not None else None
        if not echo and not (a.prompt_logprobs and scored is not None):
            return None
        head: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        if a.chat:
            head["delta"] = {"content": echo}
        else:
            head["text"] = echo
            if echo and a.logprobs and scored is not None:
                head["logprobs"] = self.answer.prompt_logprobs_legacy(scored)
        if a.prompt_logprobs and scored is not None:
            head["prompt_logprobs"] = self.answer.prompt_logprobs_vllm(scored)
        return head

    async def top(self) -> dict | None:
        """What a chat stream's first chunk carries beside its choices: vLLM's prompt_token_ids
        and prompt_text, when asked, and what a context shift dropped."""
        a = self.asked
        top: dict[str, Any] = {}
        if a.extras.token_ids:
            top["prompt_token_ids"] = a.prompts[0]
        if a.extras.prompt_text:
            top["prompt_text"] = await self.answer.prompt_text()
        if a.context_shift is not None:
            top["context_shift"] = a.context_shift.as_json()
        return top or None

    def chunk(self, choices: list[dict], usage: dict | None = None, top: dict | None = None) -> str:
        a, answer = self.asked, self.answer
        obj = "chat.completion.chunk" if a.chat else "text_completion"
        body = {"id": answer.id, "object": obj, "created": answer.created, "model": answer.model, "choices": choices}
        body |= top or {}
        if a.usage_stats is not None:
            if usage is None and choices and a.usage_stats == "continuous":
                usage = self.running_usage()
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def running_usage(self) -> dict:
        """vLLM's continuous usage: the prompts' tokens and the completions' so far."""
        prompt = self.asked.prompt_tokens
        completion = sum(self.completion_so_far.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
