"""``POST /v1/chat/completions``: the messages through the model's chat template (tools
rendered, tool_choice's constraint), one engine request with n sequences, answered by
a ``Job`` through the gateway (cache, routers), or by a beam search.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server.gateway.gateway import check_cache_field, generate
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.served import Served, check_queue, target_of
from tokenmill.server.jobs.asked import Asked
from tokenmill.server.jobs.beam_job import beam_response
from tokenmill.server.jobs.job import Job
from tokenmill.server.jobs.prompts import chat_prompt, with_eviction_default
from tokenmill.server.jobs.streaming import until_disconnect
from tokenmill.server.protocol.openai import ChatCompletionRequest, client_request_id


def register(app: FastAPI, served: Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        client = served.clients.client_of(request)
        config = served.config
        body = with_eviction_default(
            body, config.kv_eviction_window, config.kv_eviction_sinks, config.kv_eviction_policy
        )

        async def job(target: Target) -> Job:
            chat = await chat_prompt(
                target,
                body,
                served.config.allow_special_tokens_in_messages,
                served.templates,
                served.config.context_shift,
            )
            if chat.shift is not None:
                served.metrics.observe_context_shift(target.model.name, chat.shift.dropped_prompt_tokens)
            echo = body.echoed()
            asked = Asked(
                "chatcmpl",
                "chat.completion",
                [chat.ids],
                [replace(chat.params, client=client)],
                chat=True,
                usage_stats=body.usage_stats,
                return_timings=body.return_timings,
                tools=chat.tools,
                reasoning=chat.reasoning,
                echoes=[echo] if echo else None,
                prompt_logprobs=body.prompt_logprobs is not None,
                best_of_keep=body.n if body.ranks_best_of else None,
                logprobs=body.logprobs,
                request_id=client_request_id(request.headers.get("x-request-id"), body.request_id),
                tokens_as_ids=body.return_tokens_as_token_ids,
                extras=body.answer_extras(),
                context_shift=chat.shift,
            )
            return Job(served, target, asked)

        check_cache_field(served, body)
        served.clients.check_priority(request, body.priority)
        if body.use_beam_search:
            target = target_of(served, body.model, "beam search")
            chat = await chat_prompt(target, body, served.config.allow_special_tokens_in_messages, served.templates)
            beam = body.beam_params(chat.params.max_tokens)
            check_queue(served, target, beam.beam_width)
            answer = beam_response(
                served, target, "chatcmpl", [chat.ids], beam, body, chat=True, client=client, reasoning=chat.reasoning
            )
            return await until_disconnect(request, answer)
        return await generate(served, request, body, "/v1/chat/completions", job)
