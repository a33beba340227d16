"""The job that answers one chat or completions request: ``Job`` starts its engine
requests (prompts x n, through the client's window when there are several), and
answers whole (``_collect``) or as OpenAI's SSE chunks (``_sse``) from the outputs'
deltas: choices, echo, logprobs and prompt logprobs, best_of, tool calls, usage,
timings. It answers from finished outputs alike (``replay``: a cached answer, or the
small model's that a router kept). ``beam_response``: vLLM's use_beam_search.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.response_cache import detach, replayed
from tokenmill.server.gateway.served import Served, check_queue
from tokenmill.server.jobs.prompts import ContextShift
from tokenmill.server.jobs.reasoning import Reasoning, ReasoningSplitter
from tokenmill.server.jobs.streaming import DrainExpired, chain, merge, until, until_disconnect
from tokenmill.server.jobs.tools import ToolRequest, ToolStream
from tokenmill.server.protocol.error_responses import error_response
from tokenmill.server.protocol.openai import error_body, new_id, now
from tokenmill.server.protocol.vllm_fields import AnswerExtras


def with_logprobs(params: SamplingParams) -> SamplingParams:
    """``params`` asking for each token's logprob (a router's cascade judges by them)."""
    return replace(params, logprobs=0) if params.logprobs is None else params


class Job:
    """One API request: its prompts (a completions request may carry several), each
    run as one engine request with n sequences; choice i*n + j is sequence j of
    prompt i."""

    def __init__(
        self,
        served: Served,
        target: Target,
        prefix: str,
        obj: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        usage_stats: str | None,
        return_timings: bool,
        chat: bool,
        tools: ToolRequest | None = None,
        reasoning: Reasoning | None = None,
        echoes: list[str] | None = None,
        prompt_logprobs_asked: bool = False,
        best_of_keep: int | None = None,
        logprobs_asked: bool = True,
        request_id: str | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        self.served = served
        self.target = target
        self.id = f"{prefix}-{request_id}" if request_id else new_id(prefix)  # the client's X-Request-Id, if sent
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
        self.object = obj
        self.created = now()
        self.prompts = prompts
        self.params = params
        self.usage_stats = usage_stats  # streamed usage: None, "final" (a last chunk) or "continuous" (every chunk)
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.completion_so_far: dict[int, int] = {}  # streamed: each choice's tokens so far (continuous usage)
        self.extras = AnswerExtras()  # vLLM's return_token_ids, return_prompt_text, include_reasoning
        self.context_shift: ContextShift | None = None  # what a chat's context shift dropped (prompts.py)
        self.return_timings = return_timings
        self.chat = chat
        self.tools = tools  # chat with tools: answers are parsed into tool calls
        self.reasoning = reasoning  # chat, --reasoning-parser: answers split into reasoning_content and content
        self.model = target.name
        self.echoes = echoes  # per prompt: the text echo puts before each of its answers
        self.prompt_logprobs_asked = prompt_logprobs_asked  # vLLM's field (echo alone scores the prompt too)
        self.best_of_keep = best_of_keep  # best_of: the n kept per prompt, by cumulative logprob
        self.logprobs_asked = logprobs_asked  # (best_of and a router's cascade ask the engine for them)
        self.cached = False  # answered from the response cache
        self.observed = False  # its outputs are in the metrics already (a replay)
        # Called with the finished sequences (prompt index, output) of an answer that ended
        # well (every sequence stopped or reached its length): the response cache keeps it.
        self.on_answered: Callable[[list[tuple[int, RequestOutput]]], None] | None = None
        self.place: Callable[[], AbstractAsyncContextManager] | None = None  # the client's window (several prompts)
        self.prompt_only = False  # echo with max_tokens 0: the prompt scored, the one token run for it dropped

    def _start(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        first = self.params if self.place is None else self.params[: self.served.windows.size]  # in at once
        check_queue(self.served, self.target, sum(p.n for p in first))  # engine sequences: prompts x n
        streams = [
            self.target.engine.generate(f"{self.id}-{i}", ids, p, self.target.lora)
            for i, (ids, p) in enumerate(zip(self.prompts, self.params, strict=True))
        ]
        merged = merge(streams, self.place)
        return _prompt_only(merged) if self.prompt_only else merged

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
        return max(len(p) for p in self.prompts)

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
                yield i, replayed(out) if self.cached else out

        if stream:
            return StreamingResponse(self._sse(None, outputs()), media_type="text/event-stream")
        return await until_disconnect(request, self._collect(None, outputs()))

    def _answered(self, finals: list[tuple[int, RequestOutput]]) -> None:
        if self.on_answered is not None and finals and all(o.finish_reason in ("stop", "length") for _, o in finals):
            self.on_answered(finals)

    # ------------------------------------------------------------------ results

    def _choice_index(self, prompt_index: int, out: RequestOutput) -> int:
        return prompt_index * self.params[prompt_index].n + out.outputs[0].index

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
                    finals[self._choice_index(i, out)] = out
                    ended.append((i, out))
        except RequestFailedError as e:
            return error_response(500, str(e))
        self._answered(ended)
        choices = [self._final_choice(idx, finals[idx], self._scored(idx, finals)) for idx in sorted(finals)]
        if self.best_of_keep is not None:
            choices = self._best_of(choices, finals)
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(finals.values()),
        }
        if self.chat and choices and "prompt_logprobs" in choices[0]:  # vLLM's chat has it once, at the top
            body["prompt_logprobs"] = choices[0]["prompt_logprobs"]
            for c in choices:
                c.pop("prompt_logprobs", None)
        if self.chat and self.extras.token_ids:
            body["prompt_token_ids"] = self.prompts[0]
        if self.chat and self.extras.prompt_text:
            body["prompt_text"] = await asyncio.to_thread(self.target.tokenizer.decode, self.prompts[0], False)
        if self.return_timings:
            body["timings"] = [self._timings(finals[idx]) for idx in sorted(finals)]
        if self.context_shift is not None:
            body["context_shift"] = self.context_shift.as_json()
        return JSONResponse(body)

    def _final_choice(self, index: int, out: RequestOutput, scored: RequestOutput | None = None) -> dict:
        """``scored``: the output of the prompt's sequence 0, which carries the prompt's logprobs."""
        c = out.outputs[0]
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        lps = self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0) if self.logprobs_asked else None
        echo = self.echoes[index // self.params[0].n] if self.echoes else ""
        if self.chat:
            thought, text = self.reasoning.split(c.text) if self.reasoning else (None, c.text)
            content, calls = self.tools.parse(text) if self.tools and text is not None else (text, [])
            choice["message"] = {"role": "assistant", "content": echo + content if content is not None else content}
            if self.reasoning and self.extras.reasoning:  # (include_reasoning false: the content alone)
                choice["message"] |= {"reasoning": thought, "reasoning_content": thought}  # vLLM's name, and the old
            if calls:
                choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
                choice["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        else:
            choice["text"] = echo + c.text
            if echo and lps is not None and scored is not None and scored.prompt_logprobs is not None:
                lps = _joined(self._prompt_logprobs_legacy(scored), lps)
        choice["logprobs"] = lps
        if self.extras.token_ids:  # vLLM's return_token_ids (a completion's choice carries its prompt's too)
            choice["token_ids"] = list(c.token_ids)
            if not self.chat:
                choice["prompt_token_ids"] = self.prompts[index // self.params[0].n]
        if scored is not None and scored.prompt_logprobs is not None and self.prompt_logprobs_asked:
            choice["prompt_logprobs"] = self._prompt_logprobs_vllm(scored)
        return choice

    def _prompt_logprobs_legacy(self, out: RequestOutput) -> dict:
        """The prompt's part of an echoed completion's logprobs: its tokens, their logprobs
        and top alternatives, null for the first token (as OpenAI's legacy API)."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
        texts = [self._token(t) for t in out.prompt_token_ids]
        tops = [None] + [{self._token(t): v for t, v in top} for top in out.prompt_top_logprobs[1:]]
        return {
            "tokens": texts,
            "token_logprobs": list(out.prompt_logprobs),
            "top_logprobs": tops,
            "text_offset": _offsets(texts),
        }

    def _prompt_logprobs_vllm(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, then a map of token
        id -> {logprob, rank, decoded_token} holding the token itself and the top k."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None and out.prompt_ranks is not None
        tok = self.target.tokenizer
        result: list[dict | None] = [None]
        for j in range(1, len(out.prompt_logprobs)):  # all of the prompt, unless the request failed
            t = out.prompt_token_ids[j]
            entry = {
                str(t): {
                    "logprob": out.prompt_logprobs[j],
                    "rank": out.prompt_ranks[j],
                    "decoded_token": tok.decode([t], skip_special_tokens=False),
                }
            }
            for rank, (alt, v) in enumerate(out.prompt_top_logprobs[j], start=1):
                entry.setdefault(
                    str(alt),
                    {"logprob": v, "rank": rank, "decoded_token": tok.decode([alt], skip_special_tokens=False)},
                )
            result.append(entry)
        return result

    def _best_of(self, choices: list[dict], finals: dict[int, RequestOutput]) -> list[dict]:
        """Per prompt, the best_of_keep choices with the highest cumulative logprob, indexed
        afresh (logprobs dropped unless asked: they were asked for the ranking)."""
        per, keep = self.params[0].n, self.best_of_keep
        assert keep is not None
        kept = []
        for i in range(len(self.prompts)):
            group = [c for c in choices if c["index"] // per == i]
            group.sort(
                key=lambda c: sum(lp for lp in finals[c["index"]].outputs[0].logprobs or [] if lp is not None),
                reverse=True,
            )
            for k, c in enumerate(group[:keep]):
                kept.append({**c, "index": i * keep + k, "logprobs": c["logprobs"] if self.logprobs_asked else None})
        return kept

    def _scored(self, index: int, finals: dict[int, RequestOutput]) -> RequestOutput | None:
        """The final output of sequence 0 of choice ``index``'s prompt (it has the prompt's logprobs)."""
        return finals.get(index - index % self.params[0].n)

    def _usage(self, finals) -> dict:
        prompt = self.prompt_tokens
        completion = sum(len(o.outputs[0].token_ids) for o in finals)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.cached:  # nothing was computed: every token came from the response cache
            usage["prompt_tokens_details"] = {"cached_tokens": prompt}
            usage["completion_tokens_details"] = {"cached_tokens": completion}
        return usage

    def _timings(self, out: RequestOutput) -> dict:
        t = out.timings[0]
        return {
            "arrival": t.arrival,
            "first_scheduled": t.first_scheduled,
            "first_token": t.first_token,
            "finished": t.finished,
            "num_tokens": len(out.outputs[0].token_ids),
        }

    def _token(self, t: int) -> str:
        return token_name(self.target.tokenizer, t, self.tokens_as_ids)

    def _logprobs(self, token_ids, logprobs, top_logprobs, start: int) -> dict | None:
        """Logprobs of token_ids[start:] in the completions or the chat shape."""
        if logprobs is None:
            return None
        return token_logprobs(self._token, self.chat, token_ids[start:], logprobs[start:], top_logprobs[start:])

    # -------------------------------------------------------------------- stream

    async def _sse(self, first, merged) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []
        ended: list[tuple[int, RequestOutput]] = []
        started: set[int] = set()
        tool_streams: dict[int, ToolStream] = {}  # with tools: each choice's answer, as deltas
        splitters: dict[int, ReasoningSplitter] = {}  # with a reasoning parser: each choice's answer split
        items = [first] if first is not None else []
        try:
            async for i, out in until(chain(items, merged), self.served.drain_expired):
                self._observe(i, out)
                idx = self._choice_index(i, out)
                c = out.outputs[0]
                self.completion_so_far[idx] = len(c.token_ids)
                first_of_choice = idx not in started
                if first_of_choice:
                    started.add(idx)
                    if self.chat:
                        yield self._chunk(
                            [
                                {
                                    "index": idx,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            top=await self._stream_top() if len(started) == 1 else None,
                        )
                    head = self._stream_head(idx, out)
                    if head is not None:
                        yield self._chunk([head])
                n_new = len(out.delta_token_ids)
                lps = None
                if out.delta_logprobs is not None and n_new and self.logprobs_asked:  # deltas: O(new tokens) per chunk
                    lps = self._logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs, 0)
                thought, text = "", out.delta_text
                if self.reasoning is not None:
                    splitter = splitters.setdefault(idx, self.reasoning.splitter())
                    thought, text = splitter.feed(out.delta_text, out.finished)
                    thought = thought if self.extras.reasoning else ""  # include_reasoning false
                if self.tools is not None:
                    stream = tool_streams.setdefault(idx, ToolStream(self.tools))
                    if thought:  # tool calls are parsed from the content after it
                        yield self._chunk(
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
                        yield self._chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
                    if out.finished:
                        reason = "tool_calls" if stream.calls and c.finish_reason == "stop" else c.finish_reason
                        yield self._chunk(
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
                    if self.chat:
                        choice["delta"] = {"reasoning": thought, "reasoning_content": thought} if thought else {}
                        if text:
                            choice["delta"]["content"] = text
                    else:
                        choice["text"] = out.delta_text
                    if out.finished:
                        choice["stop_reason"] = c.stop_reason
                    if self.extras.token_ids:
                        choice["token_ids"] = list(out.delta_token_ids)
                        if first_of_choice and not self.chat:
                            choice["prompt_token_ids"] = self.prompts[i]
                    yield self._chunk([choice])
                if out.finished:
                    finals.append(out)
                    ended.append((i, out))
            self._answered(ended)
            if self.usage_stats is not None:
                yield self._chunk([], usage=self._usage(finals))
            if self.return_timings:
                yield f"data: {json.dumps({'id': self.id, 'timings': [self._timings(o) for o in finals]})}\n\n"
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
            await merged.aclose()
        yield "data: [DONE]\n\n"

    def _stream_head(self, index: int, out: RequestOutput) -> dict | None:
        """A choice's first chunk when it has one: the echoed prompt (with its logprobs
        when asked) and vLLM's prompt_logprobs. Sent with the choice's first output,
        which for a sequence 0 carries the prompt's logprobs whole."""
        echo = self.echoes[index // self.params[0].n] if self.echoes else ""
        scored = out if out.prompt_logprobs is not None else None
        if not echo and not (self.prompt_logprobs_asked and scored is not None):
            return None
        head: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        if self.chat:
            head["delta"] = {"content": echo}
        else:
            head["text"] = echo
            if echo and self.logprobs_asked and scored is not None:
                head["logprobs"] = self._prompt_logprobs_legacy(scored)
        if self.prompt_logprobs_asked and scored is not None:
            head["prompt_logprobs"] = self._prompt_logprobs_vllm(scored)
        return head

    async def _stream_top(self) -> dict | None:
        """What a chat stream's first chunk carries beside its choices: vLLM's prompt_token_ids
        and prompt_text, when asked."""
        top: dict[str, Any] = {}
        if self.extras.token_ids:
            top["prompt_token_ids"] = self.prompts[0]
        if self.extras.prompt_text:
            top["prompt_text"] = await asyncio.to_thread(self.target.tokenizer.decode, self.prompts[0], False)
        if self.context_shift is not None:
            top["context_shift"] = self.context_shift.as_json()
        return top or None

    def _chunk(self, choices: list[dict], usage: dict | None = None, top: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        body |= top or {}
        if self.usage_stats is not None:
            if usage is None and choices and self.usage_stats == "continuous":
                usage = self._running_usage()
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def _running_usage(self) -> dict:
        """vLLM's continuous usage: the prompts' tokens and the completions' so far."""
        prompt = self.prompt_tokens
        completion = sum(self.completion_so_far.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs blocks as one (the echoed prompt's, then the completion's)."""
    tokens = first["tokens"] + then["tokens"]
    return {
        "tokens": tokens,
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
        "text_offset": _offsets(tokens),
    }


def _offsets(texts: list[str]) -> list[int]:
    out, pos = [], 0
    for t in texts:
        out.append(pos)
        pos += len(t)
    return out


def token_name(tokenizer: Any, t: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{t}" if as_id else tokenizer.decode([t], skip_special_tokens=False)


def token_logprobs(
    name: Callable[[int], str],
    chat: bool,
    ids: list[int],
    lps: list[float],
    tops: list[list[tuple[int, float]]],
) -> dict:
    """Tokens' logprobs in the chat shape (``content``) or the completions one; ``name``
    writes a token as the response shows it."""
    texts = [name(t) for t in ids]
    if chat:
        content = []
        for text, lp, top in zip(texts, lps, tops, strict=True):
            alts = [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())} for t, v in top]
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts})
        return {"content": content}
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": [{name(t): v for t, v in top} or None for top in tops],
        "text_offset": _offsets(texts),
    }
