"""A beam-search request (vLLM's ``use_beam_search``) answered: each round's beams are
one-token requests to the engine (beam_search.py decides which), and the n best beams of
each prompt become its choices, in the chat or the completions shape."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, Response

from tokenmill.beam_search import BeamSearch, BeamSearchParams
from tokenmill.engine.outputs import RequestOutput
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.served import Served
from tokenmill.server.jobs.answer import token_logprobs, token_name
from tokenmill.server.jobs.reasoning import Reasoning
from tokenmill.server.jobs.streaming import merge
from tokenmill.server.protocol.openai import new_id, now


async def beam_response(
    served: Served,
    target: Target,
    prefix: str,
    prompts: list[list[int]],
    beam: BeamSearchParams,
    body: Any,
    chat: bool,
    client: str = "",
    reasoning: Reasoning | None = None,
) -> Response:
    """A beam-search request (vLLM's use_beam_search): per prompt, the n best of its
    beams as choices. Each round's beams are one-token requests to the engine, for
    ``client`` (admission.Clients.client_of); a chat's answers split by the model's
    ``reasoning`` parser where it has one."""
    rid = new_id(prefix)
    search = BeamSearch(prompts, beam, frozenset(target.tokenizer.stop_token_ids))
    # logprobs asked: chat's logprobs (with top_logprobs alternatives), completions' logprobs (that many)
    top_k = (body.top_logprobs or 0) if chat and body.logprobs else None if chat else body.logprobs
    name = functools.partial(token_name, target.tokenizer, as_id=body.return_tokens_as_token_ids)

    step_params = replace(beam.step_params(top_k or 0), client=client)
    while not search.finished:
        round_ = search.requests()
        streams = [
            target.engine.generate(f"{rid}-{search.rounds}-{i}", ids, step_params, target.lora)
            for i, (_, _, ids) in enumerate(round_)
        ]
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            if out.finished:
                finals[i] = out
        search.advance({(p, b): finals[i].outputs[0].top_logprobs[0] for i, (p, b, _) in enumerate(round_)})
    choices, completion = [], 0
    for p, result in enumerate(search.results()):
        for k, found in enumerate(result.beams[: body.n]):
            tokens = found.tokens[:-1] if found.finished else found.tokens  # the end-of-sequence token is not text
            text = await asyncio.to_thread(target.tokenizer.decode, tokens, body.skip_special_tokens)
            choice: dict[str, Any] = {
                "index": p * body.n + k,
                "finish_reason": "stop" if found.finished else "length",
                "stop_reason": None,
                "logprobs": None,
            }
            if top_k is not None:  # each beam's own tokens (not a final end-of-sequence), their logprobs, the top k
                n = len(tokens)
                choice["logprobs"] = token_logprobs(
                    name, chat, tokens, found.logprobs[:n], [top[:top_k] for top in found.tops[:n]]
                )
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if reasoning is not None:  # --reasoning-parser
                    thought, choice["message"]["content"] = reasoning.split(text)
                    choice["message"] |= {"reasoning": thought, "reasoning_content": thought}  # vLLM's, the old
            else:
                choice["text"] = text
            choices.append(choice)
            completion += len(found.tokens)
    prompt_tokens = sum(len(ids) for ids in prompts)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": target.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }
    )
