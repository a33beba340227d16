"""The server's own routes, beside the OpenAI generation ones: its probes (``/health``,
``/ping``, ``/metrics``, ``/version``), the models it serves (``/v1/models``, routers
and LoRA adapters among them; loading and unloading adapters with
``--allow-runtime-lora-updating``), its tokenizers (``/tokenize``, ``/detokenize``,
``/tokenizer_info``); and web.py's page and live view, registered among them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.errors import TokenmillError
from tokenmill.server.gateway.models import ServedModel
from tokenmill.server.gateway.served import Served, all_names, target_of
from tokenmill.server.jobs.prompts import render_chat
from tokenmill.server.observe.web import WebSessions, add_web_routes
from tokenmill.server.protocol.admin_requests import DetokenizeRequest, LoRAAdapterRequest, TokenizeRequest
from tokenmill.server.protocol.error_responses import APIError, error_response
from tokenmill.server.protocol.openai import now


def register(app: FastAPI, served: Served, keys: tuple[str, ...], sessions: WebSessions) -> None:
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
            cards.append(
                {
                    "id": m.name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "tokenmill",
                    "root": m.name,
                    "parent": None,
                    "max_model_len": m.max_model_len,
                }
            )
            cards += [
                {
                    "id": name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "tokenmill",
                    "root": path,
                    "parent": m.name,
                    "max_model_len": m.max_model_len,
                }
                for name, path in sorted(m.engine.snapshot().loras.items())
            ]
        for r in served.routers.values():
            cards.append(
                {
                    "id": r.name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "tokenmill",
                    "root": r.name,
                    "parent": None,
                    "max_model_len": min(served.models[r.small].max_model_len, served.models[r.large].max_model_len),
                    "router": {
                        "small": r.small,
                        "large": r.large,
                        "threshold": r.threshold,
                        "max_prompt_tokens": r.max_prompt_tokens,
                        "large_for": sorted(r.large_for),
                        "classifier": served.config.router_classifier,
                    },
                }
            )
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        found = next((card for card in (await models())["data"] if card["id"] == model_id), None)
        if found is None:
            raise APIError(404, f"the model `{model_id}` does not exist", "model")
        return found

    add_web_routes(app, served, keys, sessions)  # the page and the live view (web.py)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    if served.config.allow_runtime_lora_updating:
        _register_lora(app, served)
    _register_tokenizer(app, served)


def _register_lora(app: FastAPI, served: Served) -> None:
    """Adapters loaded and unloaded while serving (``--allow-runtime-lora-updating``)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoRAAdapterRequest) -> Response:
        base = base_model(served, body.model)
        if body.lora_path is None:
            raise APIError(400, "lora_path is required", "lora_path")
        if body.lora_name in all_names(served):
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


def _register_tokenizer(app: FastAPI, served: Served) -> None:
    """Each served model's tokenizer, for clients that count or build tokens as the server does."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        target = target_of(served, body.model, "/tokenize")
        tokenizer, max_model_len = target.tokenizer, target.max_model_len
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:  # rendered as the chat request would be (tools, template fields)
            ids, _ = await render_chat(
                target, body.as_chat(), served.config.allow_special_tokens_in_messages, served.templates
            )
        else:  # off the event loop: a long text must not stall /health or other requests
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
        if body.return_token_strs:
            out["token_strs"] = [
                tokenizer.token_to_str(t)
                if hasattr(tokenizer, "token_to_str")
                else tokenizer.decode([t], skip_special_tokens=False)
                for t in ids
            ]
        return out

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict:
        """vLLM's: what a client needs to tokenise as the server does (lm-eval's remote
        tokenizer reads it, then calls /tokenize). ``?model=``: which served model's."""
        target = target_of(served, model, "/tokenizer_info")
        tokenizer, max_model_len = target.tokenizer, target.max_model_len

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

        eos = getattr(tokenizer, "eos_token_id", None)
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": text(eos),
            "bos_token": text(getattr(tokenizer, "bos_token_id", None)),
            "pad_token": text(eos),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        tokenizer = target_of(served, body.model, "/detokenize").tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}


def base_model(served: Served, model: str | None) -> ServedModel:
    """The served model an adapter is loaded into (default: the first)."""
    if model is None:
        return served.default
    if model not in served.models:
        raise APIError(404, f"no served model `{model}` to load the adapter into ({', '.join(served.models)})", "model")
    return served.models[model]
