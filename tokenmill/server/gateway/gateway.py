"""What stands in front of a chat or completions request's model: the response cache
(response_cache.py holds the entries; this is its lookup at request time) and the
routers (model_router.py decides; this runs the decision). ``generate`` is the one
path of such a request through them: answered from the cache, through a router, or
by the model it names; the ``x-tokenmill-cache*`` and ``x-tokenmill-route*`` headers
say which.

A lookup hands back a ``CacheLease``: the answer found, or on a miss the request's
claim on its key, which keeps the answer it gets (``remember``) and lets go the twins
that wait for it (``release``). The routes hand in a ``JobMaker`` and never see the
cache or the routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.gateway.model_router import ModelRouter, Route
from tokenmill.server.gateway.models import Target
from tokenmill.server.gateway.response_cache import (
    CachedAnswer,
    ResponseCache,
    best_match,
    bucket_key,
    detach,
    reproducible,
    request_key,
    semantic_text,
)
from tokenmill.server.gateway.served import Served, check_queue, resolve
from tokenmill.server.jobs.prompts import encode
from tokenmill.server.jobs.response_items import owner_of
from tokenmill.server.jobs.streaming import until_disconnect
from tokenmill.server.protocol.error_responses import APIError, ContextLengthError, error_response
from tokenmill.server.protocol.openai import new_id

JobMaker = Callable[[Target], Awaitable[Any]]  # the request's job on a model (a jobs.Job, or a ResponseJob)


async def generate(served: Served, request: Request, body: Any, endpoint: str, make_job: JobMaker) -> Response:
    """A chat or completions request: answered from the response cache, through a
    router, or by the model it names; the cache and route headers say which."""
    found = resolve(served, body.model)
    data = body.model_dump(mode="json")
    data.pop("model")  # the identity below says which model, whatever name reached it
    cache, headers = served.cache, {}
    lease: CacheLease | None = None
    if cache is not None:
        private = any(m.get("private") for m in data.get("messages") or [])
        cacheable = body.cache is not False and reproducible(data) and not private
        headers["x-tokenmill-cache"] = "miss" if cacheable else "bypass"
        if cacheable:
            lease = await look_up(served, cache, request, endpoint, found, data, headers)
            hit = lease.answer
            if isinstance(hit, Response):  # the client left while its twin was answered
                return hit
            if hit is not None:
                job = await make_job(Target(served.models[hit.model], hit.lora))
                job.answer.cached = True  # its usage says every token came from the cache
                if hit.route is not None:
                    _route_headers(headers, hit.route)
                return _with_headers(await job.replay(request, body.stream, hit.outputs), headers)
    try:
        if isinstance(found, ModelRouter):
            response = await routed(served, request, body, found, make_job, headers, lease)
        else:
            job = await make_job(found)
            if lease is not None:
                job.on_answered = functools.partial(lease.remember, found, None)
            response = _with_headers(await job.respond(request, body.stream), headers)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    if (
        lease is not None and lease.twins_wait
    ):  # once the answer is sent (or the client has gone): the twins waiting look again
        response.background = BackgroundTask(lease.release)
        weakref.finalize(response, lease.release)  # (a stream cut before it began runs no background task)
    return response


class CacheLease:
    """A request's part in the response cache, from one lookup (``look_up``). ``answer``:
    the cached answer found, or the 499 ``Response`` of a client that left while its twin
    was answered, or None on a miss. On a miss, ``remember`` keeps the answer the request
    gets; when its twins in flight wait for that answer (``twins_wait``), ``release`` (once it
    is sent, or has failed) tells them whether one was kept, and they look again."""

    def __init__(
        self,
        cache: ResponseCache,
        key: str,
        answer: CachedAnswer | Response | None = None,
        embedding: list[float] | None = None,
        bucket: str | None = None,
    ) -> None:
        self.cache, self.key, self.answer = cache, key, answer
        self.embedding, self.bucket = embedding, bucket  # a semantic entry's
        self.kept = False  # whether ``remember`` kept an answer
        self.pending: asyncio.Future | None = None  # what the twins wait on, while this request answers for them

    @property
    def twins_wait(self) -> bool:
        return self.pending is not None

    def let_twins_wait(self) -> None:
        """Make this request the one its later exact twins wait for."""
        self.pending = self.cache.pending[self.key] = asyncio.get_running_loop().create_future()

    def remember(self, target: Target, route: Route | None, finals: list[tuple[int, RequestOutput]]) -> None:
        self.kept = self.cache.put(
            self.key,
            CachedAnswer(
                [(i, detach(o)) for i, o in finals],
                target.model.name,
                target.lora,
                route,
                self.embedding,
                bucket=self.bucket,
            ),
        )

    def release(self) -> None:
        if self.pending is not None and self.cache.pending.get(self.key) is self.pending:
            del self.cache.pending[self.key]
            with contextlib.suppress(RuntimeError):  # (a loop already closed: nobody waits)
                self.pending.set_result(self.kept)


async def look_up(
    served: Served,
    cache: ResponseCache,
    request: Request,
    endpoint: str,
    found: Target | ModelRouter,
    data: dict[str, Any],
    headers: dict[str, str],
) -> CacheLease:
    """The cached answer for this request (exact, else semantic where allowed); on a miss,
    the lease that keeps the answer it gets and releases the requests that wait for it.

    A non-streamed request whose exact twin is being answered right now waits for that
    answer rather than computing it again (as a gateway coalesces requests in flight),
    and is then a hit; if the twin ends without an answer to keep, it computes its own.
    A streamed one does not wait: it would see its first token only once the twin's
    whole answer is done (measured: p99 TTFT 139 ms -> 1.2 s on an FAQ workload)."""
    tenant = owner_of(request.headers.get("authorization"))
    if isinstance(found, ModelRouter):
        identity = "|".join(
            [
                found.describe(),
                Target(served.models[found.small]).identity(),
                Target(served.models[found.large]).identity(),
            ]
        )
    else:
        identity = found.identity()
    key = request_key(tenant, endpoint, identity, data)
    waits, alongside = not data.get("stream"), False

    async def exact() -> Any:
        """The exact hit (after waiting out a twin in flight), a 499 if the client left, or None."""
        nonlocal waits, alongside
        while waits and key in cache.pending:  # its twin is being answered: wait for that answer
            waited = await until_disconnect(request, asyncio.shield(cache.pending[key]))
            if isinstance(waited, Response):
                return waited
            if waited is False:  # the twin kept no answer: compute alongside the other waiters rather than queue
                waits, alongside = False, True
        found_hit = cache.get(key)
        if found_hit is not None:
            headers.update({"x-tokenmill-cache": "hit", "x-tokenmill-cache-kind": "exact"})
            cache.hit("exact")
        return found_hit

    hit, bucket, embedding = await exact(), None, None
    if hit is not None:
        return CacheLease(cache, key, hit)
    text = semantic_text(data) if cache.semantic else None
    if text is not None:
        bucket = bucket_key(tenant, endpoint, identity, data)
        if served.config.semantic_cache_model is not None:
            embedder = Target(served.models[served.config.semantic_cache_model])
        else:
            embedder = Target(served.models[found.small]) if isinstance(found, ModelRouter) else Target(found.model)
        check_queue(served, embedder, 1)
        try:
            client = served.clients.client_of(request)
            embedding = await _embed(embedder, text, served.config.semantic_cache_pooling, client)
        except RequestFailedError as e:
            raise APIError(500, f"the semantic cache could not embed the message: {e}") from None
        candidates = cache.candidates(bucket) if embedding else []
        match = await asyncio.to_thread(best_match, candidates, embedding, cache.threshold) if candidates else None
        hit = cache.get(match[0]) if match is not None else None  # (gone meanwhile: a miss)
        if hit is not None:
            similarity = match[1]
            headers.update(
                {
                    "x-tokenmill-cache": "hit",
                    "x-tokenmill-cache-kind": "semantic",
                    "x-tokenmill-cache-similarity": f"{similarity:.4f}",
                }
            )
            cache.hit("semantic")
            return CacheLease(cache, key, hit)
        hit = await exact()  # a twin may have arrived while this one was embedded: wait for it after all
        if hit is not None:
            return CacheLease(cache, key, hit)
    cache.miss()
    lease = CacheLease(cache, key, None, embedding, bucket)
    # A streamed twin of a request in flight, or a waiter let go, is computed alongside,
    # waited for by none; any other miss is what its twins arriving now will wait for.
    if key not in cache.pending and not alongside:
        lease.let_twins_wait()
    return lease


async def _embed(target: Target, text: str, pooling: str, client: str) -> list[float]:
    """The model's embedding of ``text`` (the semantic cache compares these), for ``client``."""
    ids = (await encode(target, text))[-(target.max_model_len - 1) :]
    stream = target.engine.generate(new_id("cache-embd"), ids, PoolingParams(pooling, client), None)
    embedding: list[float] = []
    async with contextlib.aclosing(stream):
        async for out in stream:
            if out.finished:
                embedding = out.embedding or []
    return embedding


async def routed(
    served: Served,
    request: Request,
    body: Any,
    router: ModelRouter,
    make_job: JobMaker,
    headers: dict[str, str],
    lease: CacheLease | None,
) -> Response:
    """A router's request: the rules' model, or the cascade's (the small model answers;
    kept when confident, else the large model answers afresh, streamed live)."""
    try:
        job = await make_job(Target(served.models[router.small]))
    except ContextLengthError:  # the small model has no room for it: the large may
        job, route = None, Route(router.large, "long_prompt")
    else:
        try:
            route = router.pre_route(body.model_dump(mode="json", exclude_unset=True), job.longest_prompt)
        except Exception as e:
            raise APIError(500, f"router {router.name}: the classifier failed: {e}") from None
    finals = None
    if route is None:
        job.ask_logprobs()  # the cascade judges by them (not answered unless asked)
        try:
            finals = await until_disconnect(request, job.run())
        except RequestFailedError as e:
            return error_response(500, str(e))
        if isinstance(finals, Response):  # the client went away
            return finals
        route = router.judge([out.outputs[0].logprobs or [] for _, out in finals])
    if job is None or route.model != router.small:
        job = await make_job(Target(served.models[route.model]))
    served.metrics.observe_route(router.name, route)
    _route_headers(headers, route)
    if lease is not None:
        job.on_answered = functools.partial(lease.remember, job.target, route)
    if finals is not None and route.model == router.small:
        return _with_headers(await job.replay(request, bool(body.stream), finals), headers)
    return _with_headers(await job.respond(request, bool(body.stream)), headers)


def check_cache_field(served: Served, body: Any) -> None:
    """``cache: true`` asks for what the server may not have; beam search is never cached."""
    if body.cache and served.cache is None:
        raise APIError(
            400, "cache: true, but this server keeps no response cache (--response-cache exact|semantic)", "cache"
        )
    if body.cache and body.use_beam_search:
        raise APIError(
            400, "beam search answers are not cached: leave cache unset (or false) with use_beam_search", "cache"
        )


def _route_headers(headers: dict[str, str], route: Route) -> None:
    headers["x-tokenmill-route"] = route.model
    headers["x-tokenmill-route-reason"] = route.reason
    if route.confidence is not None:
        headers["x-tokenmill-route-confidence"] = f"{route.confidence:.4f}"


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    response.headers.update(headers)
    return response
