"""``POST /v1/embeddings``: each input's pooled final hidden state, one one-token engine
request per input (several enter through the client's window, admission.py), as
floats or OpenAI's base64. Never cached, never routed.
"""

from __future__ import annotations

import base64
import functools
import struct

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.pooling_params import PoolingParams
from tokenmill.server.admission import check_count, check_tokens, client_of
from tokenmill.server.errors import APIError
from tokenmill.server.prompts import encode, max_tokens_for
from tokenmill.server.protocol import EmbeddingRequest, new_id, truncate_prompt
from tokenmill.server.served import Served, check_queue, target_of
from tokenmill.server.streaming import merge, until_disconnect


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
        check_count(served.config, len(body.inputs()), "inputs", "input")  # before tokenising them all
        prompts = [
            truncate_prompt(await encode(target, p), body.truncate_prompt_tokens, target.max_model_len)
            for p in body.inputs()
        ]
        check_tokens(served.config, prompts, "inputs", "input")
        for i, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, f"input[{i}] is empty", "input")
            max_tokens_for(target, ids, 1)  # fits the context
        place = (
            functools.partial(served.windows.place, client_of(request), lambda: target.engine.num_waiting > 0)
            if len(prompts) > 1
            else None
        )
        check_queue(served, target, len(prompts) if place is None else min(len(prompts), served.windows.size))
        rid = new_id("embd")
        params = PoolingParams(body.pooling)
        streams = [target.engine.generate(f"{rid}-{i}", ids, params, target.lora) for i, ids in enumerate(prompts)]

        async def collect() -> Response:
            vectors: dict[int, list[float]] = {}
            async for i, out in merge(streams, place):
                if out.finished:
                    served.observe_finished(out, target.model.name)
                    vectors[i] = out.embedding or []
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": _base64(vectors[i]) if body.encoding_format == "base64" else vectors[i],
                }
                for i in range(len(prompts))
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


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding of an embedding: its float32s, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
