"""``Served``: what every route, job and the gateway share (the served models, the
routers between them, the config, metrics and stores), and the questions asked of it
on each request: which model a name means (``resolve``, ``target``) and whether its
queue has room (``check_queue``). Its own module, below the routes and the jobs, so
that they can all name it without importing the app that assembles them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.outputs import RequestOutput
from tokenmill.server.gateway.model_router import ModelRouter
from tokenmill.server.gateway.models import ServedModel, Target
from tokenmill.server.gateway.response_cache import ResponseCache
from tokenmill.server.guards.admission import Clients, ClientWindows
from tokenmill.server.jobs.response_items import ResponseStore
from tokenmill.server.jobs.template_sandbox import RequestTemplates
from tokenmill.server.observe.live import LiveView
from tokenmill.server.observe.metrics import ServerMetrics
from tokenmill.server.protocol.error_responses import APIError


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
    api_keys: tuple[str, ...] = ()  # --api-key's and --api-key-file's (app.api_keys)
    windows: ClientWindows = field(init=False)  # each client's place in the engine for many-prompt requests
    clients: Clients = field(init=False)  # who is asking, and who may raise its priority
    templates: RequestTemplates | None = field(init=False)  # request chat templates' renderers, when trusted

    def __post_init__(self) -> None:
        self.windows = ClientWindows(self.config.max_inflight_prompts_per_client)
        self.clients = Clients(self.api_keys, self.config.priority_api_key, self.config.min_priority)
        self.templates = RequestTemplates.from_config(self.config)

    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    def observe_finished(self, out: RequestOutput, model_name: str, max_tokens: int | None = None) -> None:
        """A sequence ended: the metrics' histograms and the live view's latencies."""
        self.metrics.observe_finished(out, model_name, max_tokens)
        if self.live is not None:
            self.live.observe(out, model_name)

    @property
    def is_dead(self) -> bool:
        return any(m.engine.is_dead for m in self.models.values())


def check_queue(served: Served, target: Target, adding: int) -> None:
    """429 (with Retry-After) while ``max_queue`` engine sequences already wait for the model."""
    queue, waiting = served.config.max_queue, target.engine.num_waiting
    if queue and waiting + adding > queue:
        raise APIError(
            429,
            f"server busy: {waiting} sequences are already waiting and this request adds "
            f"{adding} (max_queue={queue}, --max-queue); retry later",
        )


def all_names(served: Served) -> list[str]:
    names = []
    for m in served.models.values():
        names += [m.name, *sorted(m.engine.snapshot().loras)]
    return names + list(served.routers)


def resolve(served: Served, model: str | None) -> Target | ModelRouter:
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
    raise APIError(
        404, f"the model `{model}` does not exist; this server serves {', '.join(all_names(served))}", "model"
    )


def target_of(served: Served, model: str | None, what: str) -> Target:
    """The request's model, for a route that does not route: a router is a 400 there."""
    found = resolve(served, model)
    if isinstance(found, ModelRouter):
        raise APIError(
            400,
            f"`{model}` is a router: it routes chat, completions and responses; for {what} "
            f"name one of its models ({found.small}, {found.large})",
            "model",
        )
    return found
