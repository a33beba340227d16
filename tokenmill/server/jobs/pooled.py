"""A request's texts as the model's pooled states: each text tokenised, fitted and
checked against the request limits (``--max-embedding-inputs``, ``--max-request-tokens``),
then run as one pooling request to the engine (several enter through the client's
window, admission.py; the queue limit is ``check_queue``'s). Its result per text is the
final hidden state, pooled and L2-normalised (``PoolingParams``). Shared by the routes
that embed: ``/v1/embeddings``, ``/pooling``, ``/score`` and ``/rerank``.
"""

from __future__ import annotations

import base64
import functools
import math
from typing import Any, Protocol

import numpy as np
from fastapi import Request

from tokenmill.pooling_params import PoolingParams
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.served import Served, check_queue
from tokenmill.server.guards.admission import check_count, check_tokens
from tokenmill.server.jobs.prompts import encode, max_tokens_for, truncate_prompt
from tokenmill.server.jobs.streaming import merge
from tokenmill.server.protocol.error_responses import APIError
from tokenmill.server.protocol.openai import check_request_id, new_id

Input = tuple[str, str | list[int]]  # where it is in the request ("input[2]", "query"), and the text or its ids


class PoolingBody(Protocol):
    """What the routes that embed take from their request (protocol/pooling_requests.py's bodies)."""

    pooling: str
    add_special_tokens: bool
    truncate_prompt_tokens: int | None
    truncation_side: str | None
    cache_salt: str | None
    priority: int
    request_id: str | None


async def pooling_prompts(
    served: Served, target: Target, inputs: list[Input], body: PoolingBody, param: str, counted: int | None = None
) -> list[list[int]]:
    """The inputs' prompt ids (``body.add_special_tokens``), truncated when asked (vLLM's
    truncate_prompt_tokens and truncation_side); a 400 for too many inputs or tokens (naming
    ``param``), an empty one or one over the context (naming its field). ``counted``: how many
    of the inputs ``--max-embedding-inputs`` counts, when not all (a rerank's documents: its
    query is not one of them)."""
    check_count(served.config, len(inputs) if counted is None else counted, "inputs", param)  # before tokenising
    prompts = [
        truncate_prompt(
            await encode(target, p, body.add_special_tokens),
            body.truncate_prompt_tokens,
            target.max_model_len,
            body.truncation_side,
        )
        for _, p in inputs
    ]
    check_tokens(served.config, prompts, "inputs", param)
    for (where, _), ids in zip(inputs, prompts, strict=True):
        if not ids:
            raise APIError(400, f"{where} is empty", where.split("[")[0])
        max_tokens_for(target, ids, 1)  # fits the context
    return prompts


async def pooled(
    served: Served, request: Request, target: Target, prompts: list[list[int]], body: PoolingBody, prefix: str
) -> list[list[float]]:
    """Each prompt's pooled, normalised final hidden state, in order; ``prefix`` names its
    engine requests (``embd``, ``score``, ...), with the client's ``request_id`` if it gave one."""
    client = served.clients.client_of(request)
    place = (
        functools.partial(served.windows.place, client, lambda: target.engine.num_waiting > 0)
        if len(prompts) > 1
        else None
    )
    check_queue(served, target, len(prompts) if place is None else min(len(prompts), served.windows.size))
    if body.request_id is not None:
        check_request_id(body.request_id, "request_id")
    rid = f"{prefix}-{body.request_id}" if body.request_id else new_id(prefix)
    served.clients.check_priority(request, body.priority)
    params = PoolingParams(body.pooling, client, body.cache_salt, body.priority)
    streams = [target.engine.generate(f"{rid}-{i}", ids, params, target.lora) for i, ids in enumerate(prompts)]
    vectors: dict[int, list[float]] = {}
    async for i, out in merge(streams, place):
        if out.finished:
            served.observe_finished(out, target.model.name)
            vectors[i] = out.embedding or []
    return [vectors[i] for i in range(len(prompts))]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0 when one is all zeros)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0


def as_encoded(vector: list[float], body: Any) -> list[float] | str:
    """A vector as floats, or in OpenAI's base64 encoding: its float32s, little-endian; or, as
    vLLM's ``embed_dtype`` and ``endianness`` ask, float16 or bfloat16 (rounded to nearest
    even) and big-endian ("native": this machine's order)."""
    if body.encoding_format != "base64":
        if body.embed_dtype != "float32":
            raise APIError(400, "embed_dtype applies to encoding_format base64", "embed_dtype")
        return vector
    order = {"little": "<", "big": ">", "native": "="}[body.endianness]
    values = np.asarray(vector, dtype=np.float32)
    if body.embed_dtype == "float16":
        raw = values.astype(order + "f2").tobytes()
    elif body.embed_dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        raw = rounded.astype(order + "u2").tobytes()
    else:
        raw = values.astype(order + "f4").tobytes()
    return base64.b64encode(raw).decode()
