"""The OpenAI-compatible routes on FastAPI, in front of the AsyncEngine.

    POST /v1/completions, /v1/chat/completions   (stream or not; n; logprobs; usage)
    POST /v1/responses; GET, DELETE /v1/responses/{id}   (OpenAI's Responses API)
    POST /v1/embeddings                          (the served model's pooled final hidden state)
    GET  /v1/models, /v1/models/{id}, /health, /ping, /version, /metrics
    POST /tokenize, /detokenize; GET /tokenizer_info

A server may serve several models (each its own engine, ``ServedModel``), routers
between two of them (model_router.py) and a response cache (response_cache.py):
``_generate`` is the one path of a chat or completions request through them.

Every error a client can cause is a 4xx in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters or a
prompt that does not fit the context, 401 for a missing or wrong API key, 404 for an
unknown model, 429 when ``max_queue`` requests already wait. A client that goes away
aborts its request at once, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import itertools
import json
import logging
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.beam_search import BeamSearch, BeamSearchParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import RequestFailedError, StreamingFront
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError, UnknownModelError
from tokenmill.memory import parse_memory
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import ClientWindows, check_count, check_tokens, client_of
from tokenmill.server.clients import ClientBodyLimitMiddleware
from tokenmill.server.live import LiveView
from tokenmill.server.metrics import EngineSource, ServerMetrics
from tokenmill.server.model_router import ModelRouter, Route, parse_routers
from tokenmill.server.models import ServedModel, Target
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoRAAdapterRequest,
    TokenizeRequest,
    error_body,
    new_id,
    now,
    truncate_prompt,
)
from tokenmill.server.response_cache import (
    CachedAnswer,
    ResponseCache,
    best_match,
    bucket_key,
    detach,
    replayed,
    reproducible,
    request_key,
    semantic_text,
)
from tokenmill.server.responses import (
    OutputBuilder,
    ResponseShape,
    ResponsesRequest,
    ResponseStore,
    Stored,
    output_messages,
    owner_of,
    sse_event,
)
from tokenmill.server.responses import usage as responses_usage
from tokenmill.server.tools import ToolRequest, ToolStream, parse_tool_request, render_messages
from tokenmill.server.web import WebSessions, add_web_routes, authorised, cross_site, cross_site_refusal, login_page

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               408: "RequestTimeoutError",
               413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ContextLengthError(APIError):
    """A prompt (and max_tokens) that does not fit the model's context: a 400, and for a
    router a reason to ask the large model."""


RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def error_response(status: int, message: str, param: str | None = None, retry_after: bool = False) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 or retry_after else None
    return JSONResponse(error_body(message, ERROR_TYPES.get(status, "Error"), status, param), status_code=status,
                        headers=headers)  # fmt: skip


@dataclass
class Served:
    """What the routes need: the served models (each its own engine), the routers
    between them, the config, metrics and the stores."""

    models: dict[str, ServedModel]  # by name; the first answers requests that name none
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore  # /v1/responses stored with store: true
    routers: dict[str, ModelRouter] = field(default_factory=dict)
    cache: ResponseCache | None = None  # --response-cache exact|semantic
    live: LiveView | None = None  # the live view's recent past (GET /tokenmill/live)
    # Set by `serve` when a shutdown's drain timeout has passed: open streams end with
    # an error event and [DONE] rather than being cut mid-body.
    drain_expired: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # a shutdown has begun
    windows: ClientWindows = field(init=False)  # each client's place in the engine for many-prompt requests

    def __post_init__(self) -> None:
        self.windows = ClientWindows(self.config.max_inflight_prompts_per_client)

    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    def observe_finished(self, out: RequestOutput, model_name: str) -> None:
        """A sequence ended: the metrics' histograms and the live view's latencies."""
        self.metrics.observe_finished(out, model_name)
        if self.live is not None:
            self.live.observe(out, model_name)

    @property
    def is_dead(self) -> bool:
        return any(m.engine.is_dead for m in self.models.values())


def build_app(engine: StreamingFront, tokenizer: Any, max_model_len: int, config: ServerConfig) -> FastAPI:
    """The app for one model, named ``config.served_model_name``."""
    if config.served_model_name is None:  # `serve` names it after the model file; a bare app:
        config = replace(config, served_model_name="tokenmill")
    return build_models_app([ServedModel(config.served_model_name, engine, tokenizer, max_model_len)], config)


def build_models_app(models: list[ServedModel], config: ServerConfig) -> FastAPI:
    """The app for several models, each its own engine; ``config.router`` names the routers
    between them. Requests that name no model go to the first."""
    by_name = {m.name: m for m in models}
    routers = parse_routers(config.router, list(by_name), config.router_threshold, config.router_max_prompt_tokens,
                            config.router_large_for, config.router_classifier)  # fmt: skip
    if config.semantic_cache_model is not None and config.semantic_cache_model not in by_name:
        raise TokenmillError(f"--semantic-cache-model {config.semantic_cache_model!r} is not a served model "
                             f"({', '.join(by_name)})")  # fmt: skip
    cache = None
    if config.response_cache != "off":
        cache = ResponseCache(config.response_cache == "semantic", parse_memory(config.response_cache_memory),
                              config.response_cache_ttl, config.semantic_cache_threshold)  # fmt: skip
    sources = {m.name: EngineSource(m.engine.snapshot, (lambda e=m.engine: not e.is_dead),
                                    getattr(m.engine, "replica_view", None)) for m in models}  # fmt: skip
    metrics = ServerMetrics(sources, routers=list(routers), cache=cache)
    store = ResponseStore(config.max_stored_responses, config.stored_response_ttl)
    served = Served(by_name, config, metrics, store, routers, cache, LiveView(by_name))
    keys = api_keys(config)
    sessions = WebSessions(keys, config.web_session_ttl)
    app = FastAPI(title="tokenmill", version="0.1")
    app.state.served = served

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(e), e.param)

    @app.exception_handler(UnknownModelError)
    async def _unknown_model(_: Request, e: UnknownModelError) -> JSONResponse:
        return error_response(404, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        error = first.get("ctx", {}).get("error")
        if isinstance(error, InvalidRequestError):  # raised by a validator: its own message and field
            return error_response(400, str(error), error.param)
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        return error_response(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", where)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine is not running: {e}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405, ...
        detail = e.detail if isinstance(e.detail, str) else "error"
        return error_response(e.status_code, f"{detail}: {request.method} {request.url.path}")

    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys, sessions=sessions, login_page=config.web)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout=config.request_body_timeout)
    app.add_middleware(ClientBodyLimitMiddleware, limit=config.max_unfinished_bodies_per_client)  # clients.py
    app.add_middleware(OpenRequestLimitMiddleware, limit=config.max_open_requests)  # counts everything
    app.add_middleware(UnexpectedErrorMiddleware)  # outermost of ours: anything unforeseen is a JSON 500

    @app.get("/health")
    async def health() -> Response:
        if served.is_dead:
            dead = [m.name for m in served.models.values() if m.engine.is_dead]
            return error_response(503, f"the engine loop of {', '.join(dead)} has stopped")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = []
        for m in served.models.values():
            cards.append({"id": m.name, "object": "model", "created": now(), "owned_by": "tokenmill", "root": m.name,
                          "parent": None, "max_model_len": m.max_model_len})  # fmt: skip
            cards += [{"id": name, "object": "model", "created": now(), "owned_by": "tokenmill", "root": path,
                       "parent": m.name, "max_model_len": m.max_model_len}
                      for name, path in sorted(m.engine.snapshot().loras.items())]  # fmt: skip
        for r in routers.values():
            cards.append({"id": r.name, "object": "model", "created": now(), "owned_by": "tokenmill", "root": r.name,
                          "parent": None, "max_model_len": min(by_name[r.small].max_model_len, by_name[r.large].max_model_len),
                          "router": {"small": r.small, "large": r.large, "threshold": r.threshold,
                                     "max_prompt_tokens": r.max_prompt_tokens, "large_for": sorted(r.large_for),
                                     "classifier": config.router_classifier}})  # fmt: skip
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        found = next((card for card in (await models())["data"] if card["id"] == model_id), None)
        if found is None:
            raise APIError(404, f"the model `{model_id}` does not exist", "model")
        return found

    add_web_routes(app, served, keys, sessions)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    if config.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoRAAdapterRequest) -> Response:
            base = _base_model(served, body.model)
            if body.lora_path is None:
                raise APIError(400, "lora_path is required", "lora_path")
            if body.lora_name in _all_names(served):
                raise APIError(400, f"a model named {body.lora_name!r} is already served", "lora_name")
            try:
                await base.engine.add_lora(body.lora_name, body.lora_path)
            except TokenmillError as e:
                raise APIError(400, str(e), getattr(e, "param", None) or "lora_path") from None
            base.generation += 1
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: LoRAAdapterRequest) -> Response:
            base = next((m for m in served.models.values() if body.lora_name in m.engine.snapshot().loras), None)
            if base is None or (body.model is not None and body.model != base.name):
                where = "" if body.model is None else f" on the model {body.model!r}"
                raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not served{where}", "lora_name")
            await base.engine.remove_lora(body.lora_name)
            base.generation += 1
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        target = _target(served, body.model, "/tokenize")
        tokenizer, max_model_len = target.tokenizer, target.max_model_len
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages, True, None,
                                          served.config.allow_special_tokens_in_messages)  # fmt: skip
        else:  # off the event loop: a long text must not stall /health or other requests
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.token_to_str(t) if hasattr(tokenizer, "token_to_str") else
                                 tokenizer.decode([t], skip_special_tokens=False) for t in ids]  # fmt: skip
        return out

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict:
        """vLLM's: what a client needs to tokenise as the server does (lm-eval's remote
        tokenizer reads it, then calls /tokenize). ``?model=``: which served model's."""
        target = _target(served, model, "/tokenizer_info")
        tokenizer, max_model_len = target.tokenizer, target.max_model_len

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

        eos = getattr(tokenizer, "eos_token_id", None)
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": text(eos),
                "bos_token": text(getattr(tokenizer, "bos_token_id", None)), "pad_token": text(eos),
                "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len,
                "vocab_size": tokenizer.vocab_size}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        tokenizer = _target(served, body.model, "/detokenize").tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def prepare(target: Target) -> tuple[list[list[int]], list[SamplingParams]]:
            check_count(served.config, len(body.prompts()), "prompts", "prompt")  # before tokenising them all
            prompts = [truncate_prompt(await _encode(target, p), body.truncate_prompt_tokens, target.max_model_len)
                       for p in body.prompts()]  # fmt: skip
            check_tokens(served.config, prompts, "prompts", "prompt")
            params = [body.sampling_params(_max_tokens(target, ids, body.max_tokens)).with_bad_word_ids(target.tokenizer)
                      for ids in prompts]  # fmt: skip
            return prompts, params

        async def job(target: Target) -> _Job:
            prompts, params = await prepare(target)
            echoes = None
            if body.echo:  # the prompt as text: a token-id prompt decoded
                echoes = [t if isinstance(t, str) else await asyncio.to_thread(target.tokenizer.decode, t, False)
                          for t in body.prompts()]  # fmt: skip
            made = _Job(served, target, "cmpl", "text_completion", prompts, params, body.include_usage,
                        body.return_timings, chat=False, echoes=echoes, prompt_logprobs_asked=body.prompt_logprobs is not None,
                        best_of_keep=body.n if body.ranks_best_of else None, logprobs_asked=body.logprobs is not None)  # fmt: skip
            if len(prompts) > 1:  # its prompts enter the engine through the client's window (admission.py)
                made.place = functools.partial(served.windows.place, client_of(request), lambda: target.engine.num_waiting > 0)
            return made

        _check_cache_field(served, body)
        if body.use_beam_search:  # one search for all prompts: as many tokens as the tightest allows
            target = _target(served, body.model, "beam search")
            prompts, params = await prepare(target)
            beam = body.beam_params(min(p.max_tokens for p in params))
            _check_queue(served, target, beam.beam_width * len(prompts))
            return await _until_disconnect(request, _beam_response(served, target, "cmpl", prompts, beam, body, chat=False))
        return await _generate(served, request, body, "/v1/completions", job)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async def job(target: Target) -> _Job:
            ids, params, tools = await _chat_prompt(target, body, served.config.allow_special_tokens_in_messages)
            echo = body.echoed()
            return _Job(served, target, "chatcmpl", "chat.completion", [ids], [params],
                        body.include_usage, body.return_timings, chat=True, tools=tools, echoes=[echo] if echo else None,
                        prompt_logprobs_asked=body.prompt_logprobs is not None,
                        best_of_keep=body.n if body.ranks_best_of else None, logprobs_asked=body.logprobs)  # fmt: skip

        _check_cache_field(served, body)
        if body.use_beam_search:
            target = _target(served, body.model, "beam search")
            ids, params, _ = await _chat_prompt(target, body, served.config.allow_special_tokens_in_messages)
            beam = body.beam_params(params.max_tokens)
            _check_queue(served, target, beam.beam_width)
            return await _until_disconnect(request, _beam_response(served, target, "chatcmpl", [ids], beam, body, chat=True))
        return await _generate(served, request, body, "/v1/chat/completions", job)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        target = _target(served, body.model, "/v1/embeddings")
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embeddings have the model's hidden size (no "
                                "shortening)", "dimensions")  # fmt: skip
        check_count(served.config, len(body.inputs()), "inputs", "input")  # before tokenising them all
        prompts = [truncate_prompt(await _encode(target, p), body.truncate_prompt_tokens, target.max_model_len)
                   for p in body.inputs()]  # fmt: skip
        check_tokens(served.config, prompts, "inputs", "input")
        for i, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, f"input[{i}] is empty", "input")
            _max_tokens(target, ids, 1)  # fits the context
        place = (functools.partial(served.windows.place, client_of(request), lambda: target.engine.num_waiting > 0)
                 if len(prompts) > 1 else None)  # fmt: skip
        _check_queue(served, target, len(prompts) if place is None else min(len(prompts), served.windows.size))
        rid = new_id("embd")
        params = SamplingParams(max_tokens=1, pooling=body.pooling)
        streams = [target.engine.generate(f"{rid}-{i}", ids, params, target.lora) for i, ids in enumerate(prompts)]

        async def collect() -> Response:
            vectors: dict[int, list[float]] = {}
            async for i, out in _merge(streams, place):
                if out.finished:
                    served.observe_finished(out, target.model.name)
                    vectors[i] = out.embedding or []
            data = [{"object": "embedding", "index": i,
                     "embedding": _base64(vectors[i]) if body.encoding_format == "base64" else vectors[i]}
                    for i in range(len(prompts))]  # fmt: skip
            tokens = sum(len(ids) for ids in prompts)
            return JSONResponse({"object": "list", "data": data, "model": target.name,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip

        return await _until_disconnect(request, collect())

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        found = _resolve(served, body.model)
        owner = owner_of(request.headers.get("authorization"))
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = _stored(served, owner, body.previous_response_id, "previous_response_id").messages
        chat = _chat_body(body.chat_body(history))

        async def job(target: Target) -> _ResponseJob:
            ids, params, tools = await _chat_prompt(target, chat, served.config.allow_special_tokens_in_messages)
            shape = ResponseShape(body, target.name)
            return _ResponseJob(served, target, shape, ids, params, tools, owner, history + body.input_messages())

        if isinstance(found, ModelRouter):  # (not cached: a stored conversation is not a request's to key)
            headers: dict[str, str] = {}
            return await _routed(served, request, chat, found, job, headers, None)
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

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}  # fmt: skip


def _openapi(app: FastAPI) -> dict:
    """The document as the server behaves: invalid bodies are 400s in OpenAI's error
    shape (not FastAPI's 422), and the generation routes may answer a text/event-stream."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for path, methods in schema.get("paths", {}).items():
        for op in methods.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request", **error}
            if path.startswith("/v1/") and op is methods.get("post"):
                responses["401"] = {"description": "Missing or wrong API key (with --api-key)", **error}
                responses["429"] = {"description": "Queue full (--max-queue); see Retry-After", **error}
            if path in ("/v1/completions", "/v1/chat/completions"):
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    app.openapi_schema = schema
    return schema


async def _chat_prompt(target: Target, body: ChatCompletionRequest,
                       allow_special_tokens: bool = False) -> tuple[list[int], SamplingParams, ToolRequest | None]:  # fmt: skip
    """A chat request's prompt ids (through the chat template, tools rendered; special-token
    text in the messages tokenised as text unless ``allow_special_tokens``), its sampling
    parameters and its tools."""
    tokenizer = target.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    tools = parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, template)
    messages = [m.as_dict() for m in body.messages]
    messages = tools.render_messages(messages) if tools else render_messages(messages)
    described = None
    if tools and tools.hermes:  # the template describes the tools itself
        described = [t.as_openai() for t in tools.offered]
    ids = await asyncio.to_thread(tokenizer.encode_chat, messages, body.add_generation_prompt, described,
                                  allow_special_tokens)  # fmt: skip
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, target.max_model_len)
    params = body.sampling_params(_max_tokens(target, ids, body.requested_max_tokens), tools and tools.constraint())
    return ids, params.with_bad_word_ids(tokenizer), tools


JobMaker = Callable[[Target], Awaitable[Any]]  # the request's job on a model (a _Job, or a _ResponseJob)


async def _generate(served: Served, request: Request, body: Any, endpoint: str, make_job: JobMaker) -> Response:
    """A chat or completions request: answered from the response cache, through a
    router, or by the model it names; the cache and route headers say which."""
    found = _resolve(served, body.model)
    data = body.model_dump(mode="json")
    data.pop("model")  # the identity below says which model, whatever name reached it
    cache, headers = served.cache, {}
    remember, release = None, None
    if cache is not None:
        private = any(m.get("private") for m in data.get("messages") or [])
        cacheable = body.cache is not False and reproducible(data) and not private
        headers["x-tokenmill-cache"] = "miss" if cacheable else "bypass"
        if cacheable:
            hit, remember, release = await _cached(served, cache, request, endpoint, found, data, headers)
            if isinstance(hit, Response):  # the client left while its twin was answered
                return hit
            if hit is not None:
                job = await make_job(Target(served.models[hit.model], hit.lora))
                job.cached = True
                if hit.route is not None:
                    _route_headers(headers, hit.route)
                return _with_headers(await job.replay(request, body.stream, hit.outputs), headers)
    try:
        if isinstance(found, ModelRouter):
            response = await _routed(served, request, body, found, make_job, headers, remember)
        else:
            job = await make_job(found)
            if remember is not None:
                job.on_answered = functools.partial(remember, found, None)
            response = _with_headers(await job.respond(request, body.stream), headers)
    except BaseException:
        if release is not None:
            release()
        raise
    if release is not None:  # once the answer is sent (or the client has gone): the twins waiting look again
        response.background = BackgroundTask(release)
        weakref.finalize(response, release)  # (a stream cut before it began runs no background task)
    return response


async def _cached(served: Served, cache: ResponseCache, request: Request, endpoint: str, found: Target | ModelRouter,
                  data: dict[str, Any], headers: dict[str, str]) -> tuple[Any, Callable | None, Callable | None]:  # fmt: skip
    """The cached answer for this request (exact, else semantic where allowed); on a miss,
    how to keep the answer it gets and how to release the requests that wait for it.

    A non-streamed request whose exact twin is being answered right now waits for that
    answer rather than computing it again (as a gateway coalesces requests in flight),
    and is then a hit; if the twin ends without an answer to keep, it computes its own.
    A streamed one does not wait: it would see its first token only once the twin's
    whole answer is done (measured: p99 TTFT 139 ms -> 1.2 s on an FAQ workload)."""
    tenant = owner_of(request.headers.get("authorization"))
    if isinstance(found, ModelRouter):
        identity = "|".join([found.describe(), Target(served.models[found.small]).identity(),
                             Target(served.models[found.large]).identity()])  # fmt: skip
    else:
        identity = found.identity()
    key = request_key(tenant, endpoint, identity, data)
    waits, alongside = not data.get("stream"), False

    async def exact() -> Any:
        """The exact hit (after waiting out a twin in flight), a 499 if the client left, or None."""
        nonlocal waits, alongside
        while waits and key in cache.pending:  # its twin is being answered: wait for that answer
            waited = await _until_disconnect(request, asyncio.shield(cache.pending[key]))
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
        return hit, None, None
    text = semantic_text(data) if cache.semantic else None
    if text is not None:
        bucket = bucket_key(tenant, endpoint, identity, data)
        if served.config.semantic_cache_model is not None:
            embedder = Target(served.models[served.config.semantic_cache_model])
        else:
            embedder = Target(served.models[found.small]) if isinstance(found, ModelRouter) else Target(found.model)
        _check_queue(served, embedder, 1)
        try:
            embedding = await _embed(embedder, text, served.config.semantic_cache_pooling)
        except RequestFailedError as e:
            raise APIError(500, f"the semantic cache could not embed the message: {e}") from None
        candidates = cache.candidates(bucket) if embedding else []
        match = await asyncio.to_thread(best_match, candidates, embedding, cache.threshold) if candidates else None
        hit = cache.get(match[0]) if match is not None else None  # (gone meanwhile: a miss)
        if hit is not None:
            similarity = match[1]
            headers.update({"x-tokenmill-cache": "hit", "x-tokenmill-cache-kind": "semantic",
                            "x-tokenmill-cache-similarity": f"{similarity:.4f}"})  # fmt: skip
            cache.hit("semantic")
            return hit, None, None
        hit = await exact()  # a twin may have arrived while this one was embedded: wait for it after all
        if hit is not None:
            return hit, None, None
    cache.miss()

    kept = [False]

    def remember(target: Target, route: Route | None, finals: list[tuple[int, RequestOutput]]) -> None:
        kept[0] = cache.put(key, CachedAnswer([(i, detach(o)) for i, o in finals], target.model.name, target.lora, route,
                                              embedding, bucket=bucket))  # fmt: skip

    if key in cache.pending or alongside:  # a streamed twin of a request in flight, or a waiter let go: computed
        return None, remember, None  # alongside, waited for by none
    pending = cache.pending[key] = asyncio.get_running_loop().create_future()

    def release() -> None:
        if cache.pending.get(key) is pending:
            del cache.pending[key]
            with contextlib.suppress(RuntimeError):  # (a loop already closed: nobody waits)
                pending.set_result(kept[0])

    return None, remember, release


async def _embed(target: Target, text: str, pooling: str) -> list[float]:
    """The model's embedding of ``text`` (the semantic cache compares these)."""
    ids = (await _encode(target, text))[-(target.max_model_len - 1) :]
    stream = target.engine.generate(new_id("cache-embd"), ids, SamplingParams(max_tokens=1, pooling=pooling), None)
    embedding: list[float] = []
    async with contextlib.aclosing(stream):
        async for out in stream:
            if out.finished:
                embedding = out.embedding or []
    return embedding


async def _routed(served: Served, request: Request, body: Any, router: ModelRouter, make_job: JobMaker,
                  headers: dict[str, str], remember: Callable | None) -> Response:  # fmt: skip
    """A router's request: the rules' model, or the cascade's (the small model answers;
    kept when confident, else the large model answers afresh, streamed live)."""
    try:
        job = await make_job(Target(served.models[router.small]))
    except ContextLengthError:  # the small model has no room for it: the large may
        job, route = None, Route(router.large, "long_prompt")
    else:
        try:
            route = router.pre_route(body.model_dump(mode="json", exclude_unset=True), job.longest_prompt)
        except Exception as e:  # noqa: BLE001 - the user's classifier: its failure is the server's 500, named
            raise APIError(500, f"router {router.name}: the classifier failed: {e}") from None
    finals = None
    if route is None:
        job.ask_logprobs()  # the cascade judges by them (not answered unless asked)
        try:
            finals = await _until_disconnect(request, job.run())
        except RequestFailedError as e:
            return error_response(500, str(e))
        if isinstance(finals, Response):  # the client went away
            return finals
        route = router.judge([out.outputs[0].logprobs or [] for _, out in finals])
    if job is None or route.model != router.small:
        job = await make_job(Target(served.models[route.model]))
    served.metrics.observe_route(router.name, route)
    _route_headers(headers, route)
    if remember is not None:
        job.on_answered = functools.partial(remember, job.target, route)
    if finals is not None and route.model == router.small:
        return _with_headers(await job.replay(request, bool(body.stream), finals), headers)
    return _with_headers(await job.respond(request, bool(body.stream)), headers)


def _check_cache_field(served: Served, body: Any) -> None:
    """``cache: true`` asks for what the server may not have; beam search is never cached."""
    if body.cache and served.cache is None:
        raise APIError(400, "cache: true, but this server keeps no response cache (--response-cache exact|semantic)",
                       "cache")  # fmt: skip
    if body.cache and body.use_beam_search:
        raise APIError(400, "beam search answers are not cached: leave cache unset (or false) with use_beam_search",
                       "cache")  # fmt: skip


def _route_headers(headers: dict[str, str], route: Route) -> None:
    headers["x-tokenmill-route"] = route.model
    headers["x-tokenmill-route-reason"] = route.reason
    if route.confidence is not None:
        headers["x-tokenmill-route-confidence"] = f"{route.confidence:.4f}"


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    response.headers.update(headers)
    return response


def api_keys(config: ServerConfig) -> tuple[str, ...]:
    """--api-key's keys and --api-key-file's, each a tenant of its own."""
    keys = list(config.api_key)
    if config.api_key_file is not None:
        try:
            lines = Path(config.api_key_file).read_text().splitlines()
        except OSError as e:
            raise TokenmillError(f"--api-key-file {config.api_key_file}: {e.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise TokenmillError(f"--api-key-file {config.api_key_file} holds no key")
    bad = [k for k in keys if not k or any(c.isspace() for c in k)]
    if bad:
        raise TokenmillError("an API key must be non-empty and hold no spaces")
    return tuple(keys)


def _chat_body(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request made from another route's body; its validation errors are 400s."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        error = first.get("ctx", {}).get("error")
        if isinstance(error, InvalidRequestError):
            raise error from None
        where = ".".join(str(x) for x in first.get("loc", ())) or "input"
        raise APIError(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", "input") from None


def _stored(served: Served, owner: str, response_id: str, param: str) -> Stored:
    found = served.responses.get(owner, response_id)
    if found is None:
        cfg = served.config
        raise APIError(404, f"no stored response {response_id!r} (kept with store: true, for "
                            f"{cfg.stored_response_ttl:g} s, the last {cfg.max_stored_responses}, "
                            "for the API key that made it)", param)  # fmt: skip
    return found


def _check_queue(served: Served, target: Target, adding: int) -> None:
    """429 (with Retry-After) while ``max_queue`` engine sequences already wait for the model."""
    queue, waiting = served.config.max_queue, target.engine.num_waiting
    if queue and waiting + adding > queue:
        raise APIError(429, f"server busy: {waiting} sequences are already waiting and this request adds "
                            f"{adding} (max_queue={queue}, --max-queue); retry later")  # fmt: skip


def _all_names(served: Served) -> list[str]:
    names = []
    for m in served.models.values():
        names += [m.name, *sorted(m.engine.snapshot().loras)]
    return names + list(served.routers)


def _resolve(served: Served, model: str | None) -> Target | ModelRouter:
    """The request's model: a served model, one of its LoRA adapters, or a router; 404
    for a name not served. No name: the first model."""
    if model is None:
        return Target(served.default)
    if model in served.models:
        return Target(served.models[model])
    if model in served.routers:
        return served.routers[model]
    for m in served.models.values():
        if model in m.engine.snapshot().loras:
            return Target(m, model)
    raise APIError(404, f"the model `{model}` does not exist; this server serves {', '.join(_all_names(served))}", "model")


def _target(served: Served, model: str | None, what: str) -> Target:
    """The request's model, for a route that does not route: a router is a 400 there."""
    found = _resolve(served, model)
    if isinstance(found, ModelRouter):
        raise APIError(400, f"`{model}` is a router: it routes chat, completions and responses; for {what} "
                            f"name one of its models ({found.small}, {found.large})", "model")  # fmt: skip
    return found


def _base_model(served: Served, model: str | None) -> ServedModel:
    """The served model an adapter is loaded into (default: the first)."""
    if model is None:
        return served.default
    if model not in served.models:
        raise APIError(404, f"no served model `{model}` to load the adapter into ({', '.join(served.models)})", "model")
    return served.models[model]


def _with_logprobs(params: SamplingParams) -> SamplingParams:
    """``params`` asking for each token's logprob (a router's cascade judges by them)."""
    return replace(params, logprobs=0) if params.logprobs is None else params


async def _encode(target: Target, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return await asyncio.to_thread(target.tokenizer.encode, prompt)
    return list(prompt)


def _max_tokens(target: Target, prompt_ids: list[int], requested: int | None) -> int:
    """The request's max_tokens, or all the room left; 400 when it does not fit."""
    limit = target.max_model_len
    if requested is None:
        if len(prompt_ids) >= limit:
            raise ContextLengthError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                          f"prompt is {len(prompt_ids)} tokens, leaving no room for the completion.",
                                     "messages")  # fmt: skip
        return limit - len(prompt_ids)
    if isinstance(requested, int) and requested >= 1 and len(prompt_ids) + requested > limit:
        raise ContextLengthError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + requested} tokens ({len(prompt_ids)} in the prompt, {requested} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    return requested


class _Job:
    """One API request: its prompts (a completions request may carry several), each
    run as one engine request with n sequences; choice i*n + j is sequence j of
    prompt i."""

    def __init__(self, served: Served, target: Target, prefix: str, obj: str, prompts: list[list[int]],
                 params: list[SamplingParams], include_usage: bool, return_timings: bool, chat: bool,
                 tools: ToolRequest | None = None, echoes: list[str] | None = None,
                 prompt_logprobs_asked: bool = False, best_of_keep: int | None = None,
                 logprobs_asked: bool = True) -> None:  # fmt: skip
        self.served = served
        self.target = target
        self.id = new_id(prefix)
        self.object = obj
        self.created = now()
        self.prompts = prompts
        self.params = params
        self.include_usage = include_usage
        self.return_timings = return_timings
        self.chat = chat
        self.tools = tools  # chat with tools: answers are parsed into tool calls
        self.model = target.name
        self.echoes = echoes  # per prompt: the text echo puts before each of its answers
        self.prompt_logprobs_asked = prompt_logprobs_asked  # vLLM's field (echo alone scores the prompt too)
        self.best_of_keep = best_of_keep  # best_of: the n kept per prompt, by cumulative logprob
        self.logprobs_asked = logprobs_asked  # (best_of and a router's cascade ask the engine for them)
        self.cached = False  # answered from the response cache
        self.observed = False  # its outputs are in the metrics already (a replay)
        # Called with the finished sequences (prompt index, output) of an answer that ended
        # well (every sequence stopped or reached its length): the response cache keeps it.
        self.on_answered: Callable[[list[tuple[int, RequestOutput]]], None] | None = None
        self.place: Callable[[], AbstractAsyncContextManager] | None = None  # the client's window (several prompts)

    def _start(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        first = self.params if self.place is None else self.params[: self.served.windows.size]  # in at once
        _check_queue(self.served, self.target, sum(p.n for p in first))  # engine sequences: prompts x n
        streams = [self.target.engine.generate(f"{self.id}-{i}", ids, p, self.target.lora)
                   for i, (ids, p) in enumerate(zip(self.prompts, self.params, strict=True))]  # fmt: skip
        return _merge(streams, self.place)

    async def respond(self, request: Request, stream: bool) -> Response:
        merged = self._start()
        try:
            first = await anext(merged)  # surfaces an invalid request as a 400 before any byte is sent
        except StopAsyncIteration:
            first = None
        except RequestFailedError as e:
            await merged.aclose()
            return error_response(500, str(e))
        if stream:
            return StreamingResponse(self._sse(first, merged), media_type="text/event-stream")
        return await _until_disconnect(request, self._collect(first, merged))

    @property
    def longest_prompt(self) -> int:
        return max(len(p) for p in self.prompts)

    def ask_logprobs(self) -> None:
        """Have the engine report each token's logprob (a router's cascade judges by them);
        the answer shows them only if the client asked."""
        self.params = [_with_logprobs(p) for p in self.params]

    async def run(self) -> list[tuple[int, RequestOutput]]:
        """Every sequence's final output, whole (``detach``), without answering (a router's
        cascade judges them first); RequestFailedError if one failed."""
        finals = []
        async with contextlib.aclosing(self._start()) as merged:
            async for i, out in merged:
                self._observe(out)
                if out.finished:
                    finals.append((i, detach(out)))
        return finals

    async def replay(self, request: Request, stream: bool, finals: list[tuple[int, RequestOutput]]) -> Response:
        """Answer with finished outputs (cached, or judged by a router), streamed or not."""
        self.observed = True  # in metrics already, or not engine work at all

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            for i, out in finals:
                yield i, replayed(out) if self.cached else out

        if stream:
            return StreamingResponse(self._sse(None, outputs()), media_type="text/event-stream")
        return await _until_disconnect(request, self._collect(None, outputs()))

    def _answered(self, finals: list[tuple[int, RequestOutput]]) -> None:
        if self.on_answered is not None and finals and all(o.finish_reason in ("stop", "length") for _, o in finals):
            self.on_answered(finals)

    # ------------------------------------------------------------------ results

    def _choice_index(self, prompt_index: int, out: RequestOutput) -> int:
        return prompt_index * self.params[prompt_index].n + out.outputs[0].index

    def _observe(self, out: RequestOutput) -> None:
        if out.finished and not self.observed:
            self.served.observe_finished(out, self.target.model.name)

    async def _collect(self, first, merged) -> JSONResponse:
        finals: dict[int, RequestOutput] = {}
        ended: list[tuple[int, RequestOutput]] = []
        items = [first] if first is not None else []
        try:
            async for item in _chain(items, merged):
                i, out = item
                self._observe(out)
                if out.finished:
                    finals[self._choice_index(i, out)] = out
                    ended.append((i, out))
        except RequestFailedError as e:
            return error_response(500, str(e))
        self._answered(ended)
        choices = [self._final_choice(idx, finals[idx], self._scored(idx, finals)) for idx in sorted(finals)]
        if self.best_of_keep is not None:
            choices = self._best_of(choices, finals)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(finals.values())}  # fmt: skip
        if self.chat and choices and "prompt_logprobs" in choices[0]:  # vLLM's chat has it once, at the top
            body["prompt_logprobs"] = choices[0]["prompt_logprobs"]
            for c in choices:
                c.pop("prompt_logprobs", None)
        if self.return_timings:
            body["timings"] = [self._timings(finals[idx]) for idx in sorted(finals)]
        return JSONResponse(body)

    def _final_choice(self, index: int, out: RequestOutput, scored: RequestOutput | None = None) -> dict:
        """``scored``: the output of the prompt's sequence 0, which carries the prompt's logprobs."""
        c = out.outputs[0]
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        lps = self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0) if self.logprobs_asked else None
        echo = self.echoes[index // self.params[0].n] if self.echoes else ""
        if self.chat:
            content, calls = self.tools.parse(c.text) if self.tools else (c.text, [])
            choice["message"] = {"role": "assistant", "content": echo + content if content is not None else content}
            if calls:
                choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
                choice["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        else:
            choice["text"] = echo + c.text
            if echo and lps is not None and scored is not None and scored.prompt_logprobs is not None:
                lps = _joined(self._prompt_logprobs_legacy(scored), lps)
        choice["logprobs"] = lps
        if scored is not None and scored.prompt_logprobs is not None and self.prompt_logprobs_asked:
            choice["prompt_logprobs"] = self._prompt_logprobs_vllm(scored)
        return choice

    def _prompt_logprobs_legacy(self, out: RequestOutput) -> dict:
        """The prompt's part of an echoed completion's logprobs: its tokens, their logprobs
        and top alternatives, null for the first token (as OpenAI's legacy API)."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
        tok = self.target.tokenizer
        texts = [tok.decode([t], skip_special_tokens=False) for t in out.prompt_token_ids]
        tops = [None] + [{tok.decode([t], skip_special_tokens=False): v for t, v in top} for top in out.prompt_top_logprobs[1:]]
        return {"tokens": texts, "token_logprobs": list(out.prompt_logprobs), "top_logprobs": tops,
                "text_offset": _offsets(texts)}  # fmt: skip

    def _prompt_logprobs_vllm(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, then a map of token
        id -> {logprob, rank, decoded_token} holding the token itself and the top k."""
        assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None and out.prompt_ranks is not None
        tok = self.target.tokenizer
        result: list[dict | None] = [None]
        for j in range(1, len(out.prompt_logprobs)):  # all of the prompt, unless the request failed
            t = out.prompt_token_ids[j]
            entry = {str(t): {"logprob": out.prompt_logprobs[j], "rank": out.prompt_ranks[j],
                              "decoded_token": tok.decode([t], skip_special_tokens=False)}}  # fmt: skip
            for rank, (alt, v) in enumerate(out.prompt_top_logprobs[j], start=1):
                entry.setdefault(str(alt), {"logprob": v, "rank": rank, "decoded_token": tok.decode([alt], skip_special_tokens=False)})
            result.append(entry)
        return result

    def _best_of(self, choices: list[dict], finals: dict[int, RequestOutput]) -> list[dict]:
        """Per prompt, the best_of_keep choices with the highest cumulative logprob, indexed
        afresh (logprobs dropped unless asked: they were asked for the ranking)."""
        per, keep = self.params[0].n, self.best_of_keep
        assert keep is not None
        kept = []
        for i in range(len(self.prompts)):
            group = [c for c in choices if c["index"] // per == i]
            group.sort(key=lambda c: sum(lp for lp in finals[c["index"]].outputs[0].logprobs or [] if lp is not None),
                       reverse=True)  # fmt: skip
            for k, c in enumerate(group[:keep]):
                kept.append({**c, "index": i * keep + k, "logprobs": c["logprobs"] if self.logprobs_asked else None})
        return kept

    def _scored(self, index: int, finals: dict[int, RequestOutput]) -> RequestOutput | None:
        """The final output of sequence 0 of choice ``index``'s prompt (it has the prompt's logprobs)."""
        return finals.get(index - index % self.params[0].n)

    def _usage(self, finals) -> dict:
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(o.outputs[0].token_ids) for o in finals)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cached:  # nothing was computed: every token came from the response cache
            usage["prompt_tokens_details"] = {"cached_tokens": prompt}
            usage["completion_tokens_details"] = {"cached_tokens": completion}
        return usage

    def _timings(self, out: RequestOutput) -> dict:
        t = out.timings[0]
        return {"arrival": t.arrival, "first_scheduled": t.first_scheduled, "first_token": t.first_token,
                "finished": t.finished, "num_tokens": len(out.outputs[0].token_ids)}  # fmt: skip

    def _logprobs(self, token_ids, logprobs, top_logprobs, start: int) -> dict | None:
        """Logprobs of token_ids[start:] in the completions or the chat shape."""
        if logprobs is None:
            return None
        tok = self.target.tokenizer
        ids, lps, tops = token_ids[start:], logprobs[start:], top_logprobs[start:]
        texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
        if self.chat:
            content = []
            for text, lp, top in zip(texts, lps, tops, strict=True):
                alts = [{"token": tok.decode([t], skip_special_tokens=False), "logprob": v,
                         "bytes": list(tok.decode([t], skip_special_tokens=False).encode())} for t, v in top]  # fmt: skip
                content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts})
            return {"content": content}
        return {
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": [{tok.decode([t], skip_special_tokens=False): v for t, v in top} or None for top in tops],
            "text_offset": _offsets(texts),
        }

    # -------------------------------------------------------------------- stream

    async def _sse(self, first, merged) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []
        ended: list[tuple[int, RequestOutput]] = []
        started: set[int] = set()
        tool_streams: dict[int, ToolStream] = {}  # with tools: each choice's answer, as deltas
        items = [first] if first is not None else []
        try:
            async for i, out in _until(_chain(items, merged), self.served.drain_expired):
                self._observe(out)
                idx = self._choice_index(i, out)
                c = out.outputs[0]
                if idx not in started:
                    started.add(idx)
                    if self.chat:
                        yield self._chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}])  # fmt: skip
                    head = self._stream_head(idx, out)
                    if head is not None:
                        yield self._chunk([head])
                n_new = len(out.delta_token_ids)
                lps = None
                if out.delta_logprobs is not None and n_new and self.logprobs_asked:  # deltas: O(new tokens) per chunk
                    lps = self._logprobs(out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs, 0)
                if self.tools is not None:
                    stream = tool_streams.setdefault(idx, ToolStream(self.tools))
                    for delta in stream.feed(out.delta_text, out.finished):
                        yield self._chunk([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])
                    if out.finished:
                        reason = "tool_calls" if stream.calls and c.finish_reason == "stop" else c.finish_reason
                        yield self._chunk([{"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason,
                                            "stop_reason": c.stop_reason}])  # fmt: skip
                elif out.delta_text or out.finished or lps is not None:
                    choice: dict[str, Any] = {"index": idx, "logprobs": lps,
                                              "finish_reason": c.finish_reason if out.finished else None}  # fmt: skip
                    if self.chat:
                        choice["delta"] = {"content": out.delta_text} if out.delta_text else {}
                    else:
                        choice["text"] = out.delta_text
                    if out.finished:
                        choice["stop_reason"] = c.stop_reason
                    yield self._chunk([choice])
                if out.finished:
                    finals.append(out)
                    ended.append((i, out))
            self._answered(ended)
            if self.include_usage:
                yield self._chunk([], usage=self._usage(finals))
            if self.return_timings:
                yield f"data: {json.dumps({'id': self.id, 'timings': [self._timings(o) for o in finals]})}\n\n"
        except InvalidRequestError as e:  # a later prompt of a batch was refused after streaming began
            yield f"data: {json.dumps(error_body(str(e), 'BadRequestError', 400, e.param))}\n\n"
        except RequestFailedError as e:
            yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(str(e), 'ServiceUnavailableError', 503))}\n\n"
        except DrainExpired:
            message = "the server is shutting down and its drain timeout has passed: request aborted"
            yield f"data: {json.dumps(error_body(message, 'ServiceUnavailableError', 503))}\n\n"
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

    def _stream_head(self, index: int, out: RequestOutput) -> dict | None:
        """A choice's first chunk when it has one: the echoed prompt (with its logprobs
        when asked) and vLLM's prompt_logprobs. Sent with the choice's first output,
        which for a sequence 0 carries the prompt's logprobs whole."""
        echo = self.echoes[index // self.params[0].n] if self.echoes else ""
        scored = out if out.prompt_logprobs is not None else None
        if not echo and not (self.prompt_logprobs_asked and scored is not None):
            return None
        head: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
        if self.chat:
            head["delta"] = {"content": echo}
        else:
            head["text"] = echo
            if echo and self.logprobs_asked and scored is not None:
                head["logprobs"] = self._prompt_logprobs_legacy(scored)
        if self.prompt_logprobs_asked and scored is not None:
            head["prompt_logprobs"] = self._prompt_logprobs_vllm(scored)
        return head

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"


async def _beam_response(served: Served, target: Target, prefix: str, prompts: list[list[int]], beam: BeamSearchParams,
                         body: Any, chat: bool) -> Response:  # fmt: skip
    """A beam-search request (vLLM's use_beam_search): per prompt, the n best of its
    beams as choices. Each round's beams are one-token requests to the engine."""
    rid = new_id(prefix)
    search = BeamSearch(prompts, beam, frozenset(target.tokenizer.stop_token_ids))
    while not search.finished:
        round_ = search.requests()
        streams = [target.engine.generate(f"{rid}-{search.rounds}-{i}", ids, beam.step_params(), target.lora)
                   for i, (_, _, ids) in enumerate(round_)]  # fmt: skip
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
        search.advance({(p, b): finals[i].outputs[0].top_logprobs[0] for i, (p, b, _) in enumerate(round_)})
    choices, completion = [], 0
    for p, result in enumerate(search.results()):
        for k, found in enumerate(result.beams[: body.n]):
            tokens = found.tokens[:-1] if found.finished else found.tokens  # the end-of-sequence token is not text
            text = await asyncio.to_thread(target.tokenizer.decode, tokens, body.skip_special_tokens)
            choice: dict[str, Any] = {"index": p * body.n + k, "finish_reason": "stop" if found.finished else "length",
                                      "stop_reason": None, "logprobs": None}  # fmt: skip
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
            completion += len(found.tokens)
    prompt_tokens = sum(len(ids) for ids in prompts)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                         "model": target.name, "choices": choices,
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                   "total_tokens": prompt_tokens + completion}})  # fmt: skip


class _ResponseJob:
    """One /v1/responses request: one engine request, its answer as output items
    (``OutputBuilder``), whole or as OpenAI's typed events; stored when asked."""

    def __init__(self, served: Served, target: Target, shape: ResponseShape, ids: list[int], params: SamplingParams,
                 tools: ToolRequest | None, owner: str, conversation: list[dict[str, Any]]) -> None:  # fmt: skip
        self.served, self.target, self.shape, self.ids, self.params, self.tools = served, target, shape, ids, params, tools
        self.owner, self.conversation = owner, conversation
        self.observed = False  # its output is in the metrics already (a replay)

    # a router drives this job as it drives a chat one (_routed)
    @property
    def longest_prompt(self) -> int:
        return len(self.ids)

    def ask_logprobs(self) -> None:
        self.params = _with_logprobs(self.params)  # (a response never shows them: top_logprobs is refused)

    async def run(self) -> list[tuple[int, RequestOutput]]:
        _check_queue(self.served, self.target, self.params.n)
        final = None
        async with contextlib.aclosing(self.target.engine.generate(self.shape.id, self.ids, self.params,
                                                                   self.target.lora)) as stream:  # fmt: skip
            async for out in stream:
                if out.finished:
                    self.served.observe_finished(out, self.target.model.name)
                    final = detach(out)
        return [] if final is None else [(0, final)]

    async def replay(self, request: Request, _: bool, finals: list[tuple[int, RequestOutput]]) -> Response:
        self.observed = True

        async def nothing() -> AsyncIterator[RequestOutput]:
            return
            yield

        first = [out for _, out in finals]
        if self.shape.request.stream:
            return StreamingResponse(self._events(first, nothing()), media_type="text/event-stream")
        return await _until_disconnect(request, self._whole(first, nothing()))

    async def respond(self, request: Request, _: bool = False) -> Response:
        """(The request's own ``stream`` decides; the flag is the chat job's.)"""
        _check_queue(self.served, self.target, self.params.n)
        stream = self.target.engine.generate(self.shape.id, self.ids, self.params, self.target.lora)
        try:
            first = [await anext(stream)]  # surfaces an invalid request as a 400 before any byte is sent
        except StopAsyncIteration:
            first = []
        except RequestFailedError as e:
            await stream.aclose()
            return error_response(500, str(e))
        if self.shape.request.stream:
            return StreamingResponse(self._events(first, stream), media_type="text/event-stream")
        return await _until_disconnect(request, self._whole(first, stream))

    async def _whole(self, first: list, stream: AsyncIterator[RequestOutput]) -> Response:
        final = None
        try:
            async for out in _chain(first, stream):
                if out.finished:
                    final = out
        except RequestFailedError as e:
            return error_response(500, str(e))
        finally:
            await stream.aclose()
        builder = OutputBuilder(self.tools)
        builder.feed(final.text if final is not None else "", finished=True)
        return JSONResponse(self._finish(builder.output, final))

    async def _events(self, first: list, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        sequence = itertools.count()
        yield sse_event("response.created", next(sequence), response=self.shape.body("in_progress", [], None))
        yield sse_event("response.in_progress", next(sequence), response=self.shape.body("in_progress", [], None))
        builder, final = OutputBuilder(self.tools), None
        try:
            async for out in _until(_chain(first, stream), self.served.drain_expired):
                for kind, payload in builder.feed(out.delta_text, out.finished):
                    yield sse_event(kind, next(sequence), **payload)
                if out.finished:
                    final = out
            body = self._finish(builder.output, final)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield sse_event(kind, next(sequence), response=body)
        except (InvalidRequestError, RequestFailedError, EngineDeadError, DrainExpired) as e:
            status = 400 if isinstance(e, InvalidRequestError) else 500 if isinstance(e, RequestFailedError) else 503
            message = str(e) or "the server is shutting down and its drain timeout has passed: request aborted"
            yield sse_event("error", next(sequence), code=status, message=message, param=getattr(e, "param", None))
        finally:
            await stream.aclose()

    def _finish(self, output: list[dict[str, Any]], final: RequestOutput | None) -> dict[str, Any]:
        """The finished response (stored when asked); ``final``: the engine's last output."""
        if final is not None and not self.observed:
            self.served.observe_finished(final, self.target.model.name)
        reason = final.finish_reason if final is not None else "abort"
        incomplete = None if reason in ("stop", "tool_calls") else "max_output_tokens" if reason == "length" else reason
        tokens = len(final.token_ids) if final is not None else 0
        cached = final.num_cached_tokens if final is not None else 0
        body = self.shape.body("incomplete" if incomplete else "completed", output,
                               responses_usage(len(self.ids), tokens, cached), incomplete)  # fmt: skip
        if self.shape.request.store:
            self.served.responses.put(self.owner, body, self.conversation + output_messages(output))
        return body


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding of an embedding: its float32s, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs blocks as one (the echoed prompt's, then the completion's)."""
    tokens = first["tokens"] + then["tokens"]
    return {"tokens": tokens, "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + then["top_logprobs"], "text_offset": _offsets(tokens)}  # fmt: skip


def _offsets(texts: list[str]) -> list[int]:
    out, pos = [], 0
    for t in texts:
        out.append(pos)
        pos += len(t)
    return out


class DrainExpired(Exception):
    """The shutdown's drain timeout passed while this stream was open."""


async def _until(items: AsyncIterator, stop: asyncio.Event) -> AsyncIterator:
    """items, until stop is set (then DrainExpired). Each next item is awaited in a
    task of its own; whatever ends this generator (the stop, a client that went away,
    an error) cancels and waits out that task first, so that the caller can then close
    ``items`` (it is no longer running)."""
    stopped = asyncio.ensure_future(stop.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                raise DrainExpired
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        stopped.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _merge(streams: list[AsyncIterator[RequestOutput]], place: Callable[[], AbstractAsyncContextManager] | None = None,
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:  # fmt: skip
    """Interleave several engine streams as (stream index, output). Closing the merged
    stream (or cancelling its reader) cancels every pump, which aborts its request.
    With ``place`` (the client's window: admission.py), each stream starts only once it
    holds a place, and keeps it until it ends."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async with place() if place is not None else contextlib.nullcontext():
                async for out in s:
                    await queue.put((i, out))
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenmill/", "/web/")  # /health and /metrics stay open, as vLLM's


class APIKeyMiddleware:
    """401 for the API routes, the web page and the live view without
    ``Authorization: Bearer KEY`` (the scheme is case-insensitive, RFC 7235) or the
    page's sign-in cookie (web.py: a browser cannot send the header when it opens the
    page or an event stream); a request that shows the cookie goes on as if it had sent
    its key's header, so that it is the same tenant (but a request other than GET or
    HEAD that another site's page sent with the cookie is a 403: ``web.cross_site``).
    ``GET /`` without a key is the page's login form (``login_page``). A plain ASGI
    middleware, not Starlette's BaseHTTPMiddleware, which wraps ``receive`` so that a
    handler never sees its client disconnect, and a non-streamed request would run on
    unwatched."""

    def __init__(self, app: Any, keys: tuple[str, ...], sessions: WebSessions, login_page: bool = True) -> None:
        self.app, self.keys, self.sessions, self.login_page = app, frozenset(k.encode() for k in keys), sessions, login_page

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path == "/" or path.startswith(PROTECTED):
            auth, by_cookie = authorised(scope["headers"], self.keys, self.sessions)
            if auth is None:
                if path == "/" and self.login_page:
                    await login_page(401)(scope, receive, send)
                    return
                response = error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)")
                await response(scope, receive, send)
                return
            if by_cookie and scope["method"] not in ("GET", "HEAD") and cross_site(scope["headers"]):
                await cross_site_refusal()(scope, receive, send)  # 403: another site's page, riding the cookie
                return
            scope = {**scope, "headers": auth}
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """An exception no handler foresaw is logged and answered with a JSON 500 in
    OpenAI's shape, and not raised on: Starlette's own last resort answers plain text
    and re-raises, and uvicorn then drops the keep-alive connection, so the client's
    next request on it fails too. If the response had already started (a stream), the
    exception goes on up (the connection cannot be kept: its response is cut), unless
    the response was already whole."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def watched(message: dict) -> None:
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if finished:
                return  # the client has its whole answer: the connection stays
            if started:
                raise
            await error_response(500, "internal error: the server failed on this request (see its log)")(scope, receive, send)


UNCAPPED = ("/health", "/ping", "/metrics")  # a saturated server still answers its probes


class OpenRequestLimitMiddleware:
    """503 (OpenAI's shape, with Retry-After) for a request that arrives while ``limit``
    are open: whether their bodies are still arriving, they wait for the engine, or they
    stream. Thousands of slow or idle clients cannot take every socket and task the
    server has; they are answered at once, and the connection closes."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit, self.open = app, limit, 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in UNCAPPED:
            await self.app(scope, receive, send)
            return
        if self.open >= self.limit:
            message = f"server busy: {self.open} requests are open (--max-open-requests {self.limit}); retry later"
            await error_response(503, message, retry_after=True)(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes`` (declared or streamed), before any of it
    is parsed, and 408 for one not received whole within ``timeout`` seconds (a client
    trickling a body would otherwise hold its connection open for ever). The body is
    read here and handed on whole; later ``receive`` calls go to the client, so a
    disconnect is still seen."""

    def __init__(self, app: Any, max_bytes: int, timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                message = f"request body not received within {self.timeout:g} s (--request-body-timeout)"
                await error_response(408, message)(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        handed = False

        async def replay() -> dict:
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body over {self.max_bytes} bytes (--max-request-bytes)"
        await error_response(413, message)(scope, receive, send)


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await a non-streamed response, cancelling it (and so aborting its requests) if
    the client disconnects first."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=0.25)
        except TimeoutError:
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
    return task.result()
