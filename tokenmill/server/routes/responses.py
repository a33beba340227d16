"""OpenAI's Responses API: ``POST /v1/responses`` (a chat request in another shape,
server/jobs/response_items.py: input items and the conversation stored under
``previous_response_id`` become chat messages, answered by a ``ResponseJob``, through a
router when one is named; never cached), ``GET`` and ``DELETE /v1/responses/{id}``
(the stored responses of the caller's API key).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server.gateway.gateway import routed
from tokenmill.server.gateway.model_router import ModelRouter
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.served import Served, resolve
from tokenmill.server.jobs.prompts import chat_prompt, with_eviction_default
from tokenmill.server.jobs.response_items import ResponseShape, Stored, owner_of
from tokenmill.server.jobs.response_job import ResponseJob
from tokenmill.server.protocol.error_responses import APIError
from tokenmill.server.protocol.openai import chat_request
from tokenmill.server.protocol.responses_request import ResponsesRequest


def register(app: FastAPI, served: Served) -> None:
    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        found = resolve(served, body.model)
        owner = owner_of(request.headers.get("authorization"))
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = _stored(served, owner, body.previous_response_id, "previous_response_id").messages
        config = served.config
        chat = with_eviction_default(
            chat_request(body.chat_body(history), "input"),
            config.kv_eviction_window,
            config.kv_eviction_sinks,
            config.kv_eviction_policy,
        )
        client = served.clients.client_of(request)

        async def job(target: Target) -> ResponseJob:
            made = await chat_prompt(target, chat, served.config.allow_special_tokens_in_messages)
            shape = ResponseShape(body, target.name)
            conversation = history + body.input_messages()
            params = replace(made.params, client=client)
            return ResponseJob(served, target, shape, made.ids, params, made.tools, owner, conversation, made.reasoning)

        if isinstance(found, ModelRouter):  # (not cached: a stored conversation is not a request's to key)
            headers: dict[str, str] = {}
            return await routed(served, request, chat, found, job, headers, None)
        return await (await job(found)).respond(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        return _stored(served, owner_of(request.headers.get("authorization")), response_id, "response_id").body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        owner = owner_of(request.headers.get("authorization"))
        _stored(served, owner, response_id, "response_id")
        served.responses.delete(owner, response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _stored(served: Served, owner: str, response_id: str, param: str) -> Stored:
    found = served.responses.get(owner, response_id)
    if found is None:
        cfg = served.config
        raise APIError(
            404,
            f"no stored response {response_id!r} (kept with store: true, for "
            f"{cfg.stored_response_ttl:g} s, the last {cfg.max_stored_responses}, "
            "for the API key that made it)",
            param,
        )
    return found
