"""The whole server as a Ray Serve application, for ``serve run`` / ``serve deploy``
and KubeRay's RayService (deploy/ray-serve.yaml, deploy/kuberay-rayservice.yaml).

``tokenmill serve --data-parallel-size N`` runs our HTTP app in its own process and
only the engines on Ray. Under ``serve deploy`` there is no such process: Ray Serve's
HTTP proxy routes to an ingress deployment (``OpenAIIngress``) that builds the same
FastAPI app over a ``RayReplicaFront``, with the engine pools bound beside it. The
application's ``args`` are our option names (engine, replica and server options):

    import_path: tokenmill.replicas.serve_app:build
    args: {model: /models/x.gguf, data_parallel_size: 2, routing: kv, api_key: ...}
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve

from tokenmill.configuration.args import engine_args, engine_keywords
from tokenmill.configuration.serving_config import ReplicaConfig, ServerConfig
from tokenmill.errors import TokenmillError
from tokenmill.replicas import ray_serve
from tokenmill.replicas.front import RayReplicaFront, check_replica_options, replica_pools


@serve.ingress()
class OpenAIIngress:
    """Our OpenAI-compatible app, served by Ray Serve's proxy, over the engine pools."""

    def __init__(
        self,
        server: ServerConfig,
        model: str,
        prefix: str,
        routing: str,
        block_size: int,
        engine=None,
        prefill=None,
        decode=None,
        load_cost: int | None = None,
    ) -> None:
        self.server, self.model, self.prefix, self.routing, self.block_size = server, model, prefix, routing, block_size
        self.load_cost = load_cost
        self.handles = {
            k: h for k, h in (("engine", engine), ("prefill", prefill), ("decode", decode)) if h is not None
        }

    async def __serve_build_asgi_app__(self):
        from tokenmill.model.paths import resolve_model_path
        from tokenmill.model.tokenizer import load_tokenizer
        from tokenmill.server.app import build_app
        from tokenmill.server.gateway.models import model_id

        info = await self.handles.get("decode", self.handles.get("engine")).info.remote()
        tokenizer = load_tokenizer(resolve_model_path(self.model))
        indexes = {
            role: ray_serve.get_index(
                ray_serve.index_name(self.prefix, role), self.routing, self.block_size, self.load_cost
            )
            for role in self.handles
        }
        self.front = RayReplicaFront(self.handles, indexes, tokenizer, info)
        name = self.server.served_model_name or model_id(Path(info["model_path"]))
        return build_app(self.front, tokenizer, info["max_model_len"], replace(self.server, served_model_name=name))


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build(args: dict[str, Any]):
    """The application from ``serve deploy``'s ``args`` (our option names)."""
    args = dict(args)
    engine_kw = {k: args.pop(k) for k in list(args) if k in engine_keywords()}
    replica_kw = {k: args.pop(k) for k in list(args) if k in _fields(ReplicaConfig)}
    server_kw = {k: args.pop(k) for k in list(args) if k in _fields(ServerConfig)}
    prefix = args.pop("name", "tokenmill")
    if args:
        raise TokenmillError(f"unknown option(s) in the application's args: {', '.join(sorted(args))}")
    try:
        eargs, config, server = engine_args(**engine_kw), ReplicaConfig(**replica_kw), ServerConfig(**server_kw)
    except (TypeError, ValueError) as e:
        raise TokenmillError(str(e)) from None
    check_replica_options(eargs, config)
    threads = config.replica_threads or max(1, int(config.replica_cpus or 1))
    cpus = config.replica_cpus if config.replica_cpus is not None else float(threads)
    pools = {
        role: ray_serve.deployment(
            role,
            eargs,
            ray_serve.index_name(prefix, role),
            n,
            threads,
            cpus,
            config.replica_gpus,
            config.routing,
            config.max_replicas if role == "engine" else None,
            config.target_ongoing_requests,
            config.fixed_load_cost,
        )
        for role, n in replica_pools(config).items()
    }
    ingress = serve.deployment(OpenAIIngress, name="openai").options(
        max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(
        server,
        eargs.load.model,
        prefix,
        config.routing,
        eargs.cache.block_size,
        **pools,
        load_cost=config.fixed_load_cost,
    )
