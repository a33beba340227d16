"""``POST /v1/completions``: one or several prompts (text or token ids), each run with
n sequences as one engine request (several enter through the client's window,
admission.py), answered by a ``Job`` through the gateway (cache, routers), or by a
beam search; echo, logprobs and prompt logprobs (echo with max_tokens 0: the prompt
scored, nothing generated), best_of.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.gateway.gateway import check_cache_field, generate
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.served import Served, check_queue, target_of
from tokenmill.server.guards.admission import check_count, check_tokens
from tokenmill.server.jobs.asked import Asked
from tokenmill.server.jobs.beam_job import beam_response
from tokenmill.server.jobs.job import Job
from tokenmill.server.jobs.prompts import encode, max_tokens_for, truncate_prompt, with_eviction_default
from tokenmill.server.jobs.streaming import until_disconnect
from tokenmill.server.protocol.error_responses import APIError
from tokenmill.server.protocol.openai import CompletionRequest, client_request_id


def register(app: FastAPI, served: Served) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        client = served.clients.client_of(request)
        config = served.config
        body = with_eviction_default(
            body, config.kv_eviction_window, config.kv_eviction_sinks, config.kv_eviction_policy
        )

        async def prepare(target: Target) -> tuple[list[list[int]], list[SamplingParams]]:
            check_count(served.config, len(body.prompts()), "prompts", "prompt")  # before tokenising them all
            prompts = [
                truncate_prompt(
                    await encode(target, p, body.add_special_tokens),
                    body.truncate_prompt_tokens,
                    target.max_model_len,
                    body.truncation_side,
                )
                for p in body.prompts()
            ]
            check_tokens(served.config, prompts, "prompts", "prompt")
            params = [
                replace(
                    body.sampling_params(
                        max_tokens_for(target, ids, 1 if prompt_only else body.max_tokens, body.streams)
                    ),
                    client=client,
                ).with_bad_word_ids(target.tokenizer)
                for ids in prompts
            ]
            return prompts, params

        async def job(target: Target) -> Job:
            prompts, params = await prepare(target)
            echoes = None
            if body.echo:  # the prompt as text: a token-id prompt decoded
                echoes = [
                    t if isinstance(t, str) else await asyncio.to_thread(target.tokenizer.decode, t, False)
                    for t in body.prompts()
                ]
            asked = Asked(
                "cmpl",
                "text_completion",
                prompts,
                params,
                chat=False,
                usage_stats=body.usage_stats,
                return_timings=body.return_timings,
                echoes=echoes,
                prompt_logprobs=body.prompt_logprobs is not None,
                best_of_keep=body.n if body.ranks_best_of else None,
                logprobs=body.logprobs is not None,
                request_id=client_request_id(request.headers.get("x-request-id"), body.request_id),
                tokens_as_ids=body.return_tokens_as_token_ids,
                extras=body.answer_extras(),
                prompt_only=prompt_only,
            )
            made = Job(served, target, asked)
            if len(prompts) > 1:  # its prompts enter the engine through the client's window (admission.py)
                made.place = functools.partial(served.windows.place, client, lambda: target.engine.num_waiting > 0)
            return made

        # max_tokens 0 with echo: the legacy way to score a prompt (its logprobs), nothing generated;
        # the engine runs it with max_tokens 1 and the job drops that token
        prompt_only = body.max_tokens == 0
        if prompt_only and not body.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it scores the prompt, which needs echo", "max_tokens")
        check_cache_field(served, body)
        served.clients.check_priority(request, body.priority)
        if body.use_beam_search:  # one search for all prompts: as many tokens as the tightest allows
            target = target_of(served, body.model, "beam search")
            prompts, params = await prepare(target)
            beam = body.beam_params(min(p.max_tokens for p in params))
            check_queue(served, target, beam.beam_width * len(prompts))
            return await until_disconnect(
                request, beam_response(served, target, "cmpl", prompts, beam, body, chat=False, client=client)
            )
        return await generate(served, request, body, "/v1/completions", job)
