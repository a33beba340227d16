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
import struct

from fastapi import Request

from tokenmill.pooling_params import PoolingParams
from tokenmill.server.admission import check_count, check_tokens
from tokenmill.server.errors import APIError
from tokenmill.server.models import Target
from tokenmill.server.prompts import encode, max_tokens_for
from tokenmill.server.protocol import new_id, truncate_prompt
from tokenmill.server.served import Served, check_queue
from tokenmill.server.streaming import merge

Input = tuple[str, str | list[int]]  # where it is in the request ("input[2]", "query"), and the text or its ids


async def pooling_prompts(
    served: Served, target: Target, inputs: list[Input], truncate: int | None, param: str, counted: int | None = None
) -> list[list[int]]:
    """The inputs' prompt ids, truncated when asked (vLLM's truncate_prompt_tokens); a 400
    for too many inputs or tokens (naming ``param``), an empty one or one over the context
    (naming its field). ``counted``: how many of the inputs ``--max-embedding-inputs``
    counts, when not all (a rerank's documents: its query is not one of them)."""
    check_count(served.config, len(inputs) if counted is None else counted, "inputs", param)  # before tokenising
    prompts = [truncate_prompt(await encode(target, p), truncate, target.max_model_len) for _, p in inputs]
    check_tokens(served.config, prompts, "inputs", param)
    for (where, _), ids in zip(inputs, prompts, strict=True):
        if not ids:
            raise APIError(400, f"{where} is empty", where.split("[")[0])
        max_tokens_for(target, ids, 1)  # fits the context
    return prompts


async def pooled(
    served: Served, request: Request, target: Target, prompts: list[list[int]], pooling: str, prefix: str
) -> list[list[float]]:
    """Each prompt's pooled, normalised final hidden state, in order; ``prefix`` names
    its engine requests (``embd``, ``score``, ...)."""
    client = served.clients.client_of(request)
    place = (
        functools.partial(served.windows.place, client, lambda: target.engine.num_waiting > 0)
        if len(prompts) > 1
        else None
    )
    check_queue(served, target, len(prompts) if place is None else min(len(prompts), served.windows.size))
    rid = new_id(prefix)
    params = PoolingParams(pooling, client)
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


def as_encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as floats, or in OpenAI's base64 encoding: its float32s, little-endian."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
