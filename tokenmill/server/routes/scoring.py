"""The scoring routes vLLM serves for RAG, on the model's own pooled states (pooled.py):

    POST /score, /v1/score                 text_1 against each text_2 (1:1, 1:N) or pairwise (N:N); or
                                           data_1/data_2, queries/documents, queries/items
    POST /rerank, /v1/rerank, /v2/rerank   a query's documents, best first (Jina / Cohere)
    POST /pooling                          each input's pooled state

The served models are decoder LMs without a classification head, so a pair's score is,
as vLLM's for such a model, the cosine similarity of the two texts' embeddings (the
final hidden state the embeddings route returns). Never cached, never routed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.gateway.served import Served, target_of
from tokenmill.server.jobs.pooled import as_encoded, cosine, pooled, pooling_prompts
from tokenmill.server.jobs.streaming import until_disconnect
from tokenmill.server.protocol.openai import new_id, now
from tokenmill.server.protocol.pooling_requests import PoolingRequest, RerankRequest, ScoreRequest


def register(app: FastAPI, served: Served) -> None:
    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        target = target_of(served, body.model, "/score")
        first, second = body.texts()
        one, two = body.names()
        inputs = [*_named(one, getattr(body, one), first), *_named(two, getattr(body, two), second)]
        prompts = await pooling_prompts(served, target, inputs, body, two)

        async def collect() -> Response:
            vectors = await pooled(served, request, target, prompts, body, "score")
            ones, twos = vectors[: len(first)], vectors[len(first) :]
            scores = [cosine(ones[0 if len(ones) == 1 else j], v) for j, v in enumerate(twos)]
            tokens = sum(len(ids) for ids in prompts)
            return JSONResponse(
                {
                    "id": new_id("score"),
                    "object": "list",
                    "created": now(),
                    "model": target.name,
                    "data": [{"index": j, "object": "score", "score": s} for j, s in enumerate(scores)],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await until_disconnect(request, collect())

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        target = target_of(served, body.model, "/rerank")
        documents = body.texts()
        inputs = [("query", body.query), *((f"documents[{i}]", d) for i, d in enumerate(documents))]
        prompts = await pooling_prompts(
            served, target, inputs, body, "documents", counted=len(documents)
        )  # the limit counts the documents (2,048 by default); the query's tokens count with theirs

        async def collect() -> Response:
            query, *docs = await pooled(served, request, target, prompts, body, "rerank")
            ranked = sorted(((cosine(query, v), i) for i, v in enumerate(docs)), key=lambda r: (-r[0], r[1]))
            results = []
            for relevance, i in ranked[: body.top_n or None]:
                result = {"index": i, "relevance_score": relevance}
                if body.return_documents:
                    result["document"] = {"text": documents[i]}
                results.append(result)
            tokens = sum(len(ids) for ids in prompts)
            return JSONResponse(
                {"id": new_id("rerank"), "model": target.name, "usage": {"total_tokens": tokens}, "results": results}
            )

        return await until_disconnect(request, collect())

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        target = target_of(served, body.model, "/pooling")
        inputs = [(f"input[{i}]", p) for i, p in enumerate(body.inputs())]
        prompts = await pooling_prompts(served, target, inputs, body, "input")

        async def collect() -> Response:
            vectors = await pooled(served, request, target, prompts, body, "pool")
            tokens = sum(len(ids) for ids in prompts)
            return JSONResponse(
                {
                    "id": new_id("pool"),
                    "object": "list",
                    "created": now(),
                    "model": target.name,
                    "data": [
                        {"index": i, "object": "pooling", "data": as_encoded(v, body)} for i, v in enumerate(vectors)
                    ],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await until_disconnect(request, collect())


def _named(field: str, value: str | list[str], texts: list[str]) -> list[tuple[str, str]]:
    """Each text with where it is in the request: the field, or the field and its index."""
    if isinstance(value, str):
        return [(field, value)]
    return [(f"{field}[{i}]", t) for i, t in enumerate(texts)]
