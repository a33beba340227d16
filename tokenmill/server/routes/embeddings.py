"""``POST /v1/embeddings``: each input's pooled final hidden state, one pooling engine
request per input (pooled.py: the limits, the client's window, the queue), as floats
or OpenAI's base64. Never cached, never routed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.gateway.served import Served, target_of
from tokenmill.server.jobs.pooled import as_encoded, pooled, pooling_prompts
from tokenmill.server.jobs.prompts import render_chat
from tokenmill.server.jobs.streaming import until_disconnect
from tokenmill.server.protocol.error_responses import APIError
from tokenmill.server.protocol.pooling_requests import EmbeddingRequest


def register(app: FastAPI, served: Served) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        target = target_of(served, body.model, "/v1/embeddings")
        if body.dimensions is not None:
            raise APIError(
                400,
                "dimensions is not supported: the embeddings have the model's hidden size (no shortening)",
                "dimensions",
            )
        if body.messages is not None:  # vLLM's chat form: one input, rendered as the chat request would be
            ids, _ = await render_chat(
                target, body.as_chat(), served.config.allow_special_tokens_in_messages, served.templates
            )
            inputs: list = [("messages", ids)]
        else:
            inputs = [(f"input[{i}]", p) for i, p in enumerate(body.inputs())]
        prompts = await pooling_prompts(served, target, inputs, body, "input")

        async def collect() -> Response:
            vectors = await pooled(served, request, target, prompts, body, "embd")
            data = [
                {"object": "embedding", "index": i, "embedding": as_encoded(v, body)} for i, v in enumerate(vectors)
            ]
            tokens = sum(len(ids) for ids in prompts)
            return JSONResponse(
                {
                    "object": "list",
                    "data": data,
                    "model": target.name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await until_disconnect(request, collect())
