"""The OpenAI-compatible routes on FastAPI, in front of engine fronts (``StreamingFront``:
engine/api/streams.py).

    POST /v1/completions, /v1/chat/completions   (stream or not; n; logprobs; usage)
    POST /v1/responses; GET, DELETE /v1/responses/{id}   (OpenAI's Responses API)
    POST /v1/embeddings                          (the served model's pooled final hidden state)
    POST /score, /rerank, /pooling               (vLLM's scoring: the cosine of those states; /v1/, /v2/ too)
    GET  /v1/models, /v1/models/{id}, /health, /ping, /version, /metrics
    POST /tokenize, /detokenize; GET /tokenizer_info

A server may serve several models (each its own engine, ``ServedModel``), routers
between two of them (gateway/model_router.py) and a response cache (gateway/response_cache.py):
gateway/gateway.py's ``generate`` is the one path of a chat or completions request through them.

This module assembles the app from its folders: the shared state (``Served``, gateway/served.py),
the error handlers (protocol/error_responses.py) and the guards (guards/middleware.py), the
observers (observe/: metrics, the live view, the web page), then each API's routes (routes/),
whose requests are answered by jobs (jobs/), and the OpenAPI document as the server behaves.

Every error a client can cause is a 4xx in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters or a
prompt that does not fit the context, 401 for a missing or wrong API key, 404 for an
unknown model, 429 when ``max_queue`` requests already wait. A client that goes away
aborts its request at once, freeing its KV blocks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from tokenmill.configuration.memory import parse_memory
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.api.streams import StreamingFront
from tokenmill.errors import TokenmillError
from tokenmill.host.energy import EnergyMeter
from tokenmill.server.gateway.model_router import parse_routers
from tokenmill.server.gateway.models import ServedModel
from tokenmill.server.gateway.response_cache import ResponseCache
from tokenmill.server.gateway.served import Served
from tokenmill.server.guards.middleware import install_middleware
from tokenmill.server.jobs.reasoning import apply_reasoning_parser
from tokenmill.server.jobs.response_items import ResponseStore
from tokenmill.server.observe.live import LiveView
from tokenmill.server.observe.metrics import EngineSource, ServerMetrics
from tokenmill.server.observe.web import WebSessions
from tokenmill.server.protocol.error_responses import install_error_handlers
from tokenmill.server.routes import admin, chat, completions, embeddings, scoring
from tokenmill.server.routes import responses as responses_api


def build_app(engine: StreamingFront, tokenizer: Any, max_model_len: int, config: ServerConfig) -> FastAPI:
    """The app for one model, named ``config.served_model_name``."""
    if config.served_model_name is None:  # `serve` names it after the model file; a bare app:
        config = replace(config, served_model_name="tokenmill")
    return build_models_app([ServedModel(config.served_model_name, engine, tokenizer, max_model_len)], config)


def build_models_app(models: list[ServedModel], config: ServerConfig) -> FastAPI:
    """The app for several models, each its own engine; ``config.router`` names the routers
    between them. Requests that name no model go to the first."""
    by_name = {m.name: m for m in models}
    if config.reasoning_parser is not None:
        apply_reasoning_parser(models, config.reasoning_parser)
    routers = parse_routers(
        config.router,
        list(by_name),
        config.router_threshold,
        config.router_max_prompt_tokens,
        config.router_large_for,
        config.router_classifier,
    )
    if config.semantic_cache_model is not None and config.semantic_cache_model not in by_name:
        raise TokenmillError(
            f"--semantic-cache-model {config.semantic_cache_model!r} is not a served model ({', '.join(by_name)})"
        )
    cache = None
    if config.response_cache != "off":
        cache = ResponseCache(
            config.response_cache == "semantic",
            parse_memory(config.response_cache_memory),
            config.response_cache_ttl,
            config.semantic_cache_threshold,
        )
    sources = {
        m.name: EngineSource(
            m.engine.snapshot, (lambda e=m.engine: not e.is_dead), getattr(m.engine, "replica_view", None)
        )
        for m in models
    }
    energy = EnergyMeter(config.watts_per_cpu)
    metrics = ServerMetrics(sources, list(routers), cache, energy, config.price_per_hour)
    store = ResponseStore(config.max_stored_responses, config.stored_response_ttl)
    keys = api_keys(config)
    live = LiveView(by_name, energy, config.price_per_hour)
    served = Served(by_name, config, metrics, store, routers, cache, live, api_keys=keys)
    sessions = WebSessions(keys, config.web_session_ttl)
    app = FastAPI(title="tokenmill", version="0.1")
    app.state.served = served
    install_error_handlers(app)
    install_middleware(app, config, keys, sessions)
    admin.register(app, served, keys, sessions)  # /health, /metrics, /v1/models, the web page, /tokenize, ...
    completions.register(app, served)
    chat.register(app, served)
    embeddings.register(app, served)
    scoring.register(app, served)  # /score, /rerank, /pooling: on the embeddings' pooled states
    responses_api.register(app, served)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


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
    bad = [k for k in (*keys, *config.priority_api_key) if not k or any(c.isspace() for c in k)]
    if bad:
        raise TokenmillError("an API key must be non-empty and hold no spaces")
    if keys and not set(config.priority_api_key) <= set(keys):  # (the key itself is never printed)
        raise TokenmillError(
            "a --priority-api-key is not one of --api-key's (or --api-key-file's) keys: requests with it would be refused"
        )
    return tuple(keys)


ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


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
