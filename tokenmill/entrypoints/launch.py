"""`tokenmill serve`: the engine loop, the app and uvicorn, with a graceful drain.

It sits above both ways of hosting engines it chooses among (an engine-core process,
Ray Serve replicas, this process) and above the HTTP app (server/), which is why it is
not in server/: a Ray Serve replica builds that app too (replicas/serve_app.py).

Two processes by default (``--engine-core process``, vLLM v1's shape): this one is
the API process (HTTP, JSON, tokenising, detokenising, SSE: core_client.py) and the
engine core runs in its own (scheduler, KV blocks, model: core_loop.py), so neither
waits on the other's GIL. ``--engine-core thread`` runs the engine loop on a thread
here instead (and so does a server under torchrun, whose ranks are one process each).
With replica options (``--data-parallel-size N``, ``--prefill-replicas`` and
``--decode-replicas``, ``--ray``) the engines are Ray Serve replicas and this process
streams from them (replicas/front.py).

On SIGTERM (or Ctrl-C) uvicorn closes the listening socket at once, so nothing new
is admitted, then waits up to ``--drain-timeout`` seconds for in-flight requests to
finish. Streams still open then end with an error event and ``[DONE]``; what is left
is cancelled (which aborts those requests); the engine loop stops last and the
process exits 0. Whatever happens meanwhile, the first SIGTERM or Ctrl-C also arms a
deadline (``--drain-timeout`` + ``EXIT_GRACE_S``) past which the process exits 1 at
once: a stop is never left waiting on something stuck.

If the engine dies (its loop fails, or a worker process of a split model dies), the
requests in flight get 503, the server stops accepting, and the process exits 1, so
that a supervisor restarts it instead of leaving a server that can only answer 503.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from tokenmill.configuration.args import (
    ModelSpec,
    replica_config_from_namespace,
    served_models,
    server_config_from_namespace,
)
from tokenmill.configuration.config import EngineArgs
from tokenmill.configuration.memory import available_memory, parse_memory
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.distributed.env import under_torchrun
from tokenmill.engine.api.streams import StreamingFront
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import TokenmillError
from tokenmill.model.paths import hub_ref, with_model_paths
from tokenmill.server.app import api_keys, build_models_app
from tokenmill.server.gateway.model_router import parse_routers
from tokenmill.server.gateway.models import ServedModel, model_id
from tokenmill.server.guards.clients import uvicorn_options

EXIT_GRACE_S = 15.0  # after the drain timeout, what stopping the engines may take before the process just exits


def _exit_by(seconds: float) -> None:
    """Exit the process ``seconds`` from now unless it has exited by then (a thread of its
    own: it fires even while the main thread is stuck)."""

    def expire() -> None:
        time.sleep(seconds)
        print(
            f"tokenmill: not stopped {seconds:g} s after the signal to stop; exiting now", file=sys.stderr, flush=True
        )
        os._exit(1)

    threading.Thread(target=expire, name="tokenmill-exit-deadline", daemon=True).start()


async def _stop_when_dead(server, engine: StreamingFront, grace: float = 0.5) -> None:
    while engine.death is None:
        await asyncio.sleep(0.1)
    await asyncio.sleep(grace)  # let the requests in flight send their 503
    server.should_exit = True


async def _expire_streams(server, stopping: asyncio.Event, drain_expired: asyncio.Event, drain_timeout: float) -> None:
    """Once a shutdown has begun, say so (the live view's streams end at once), wait out
    the drain timeout, then end open streams."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    stopping.set()
    await asyncio.sleep(drain_timeout)
    drain_expired.set()


def _start_engine(args: argparse.Namespace, config: ServerConfig, engine_args: EngineArgs):
    """The engine front, the tokenizer, the context length, the model's path, and how to
    release what was started."""
    replicas = replica_config_from_namespace(args)
    if replicas.enabled:
        if under_torchrun():
            raise TokenmillError("engine replicas run on Ray Serve, not under torchrun")
        from tokenmill.replicas.front import start_replicas

        front, tokenizer, max_model_len, path = start_replicas(engine_args, replicas)
        return front, tokenizer, max_model_len, path, lambda: None
    if config.engine_core == "process" and not under_torchrun():
        from tokenmill.core_process import run_engine_core
        from tokenmill.engine.api.core_client import AsyncCoreClient
        from tokenmill.model.paths import resolve_model_path
        from tokenmill.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(engine_args.load.model))
        client = AsyncCoreClient(functools.partial(run_engine_core, engine_args), tokenizer)
        return client, tokenizer, client.info.max_model_len, Path(client.info.model_path), lambda: None
    from tokenmill.llm import LLM

    llm = LLM(args=engine_args)
    return AsyncEngine(llm.engine), llm.tokenizer, llm.max_model_len, llm.model_path, llm.close


def _bind(config: ServerConfig) -> socket.socket:
    """The listening address, taken now: before Ray starts, whose processes open ports of
    their own while the replicas load (one took a port chosen for the server)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)  # listening: no other socket can take the port meanwhile (connections wait)
    except OSError as e:
        sock.close()
        raise TokenmillError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from None
    return sock


def _plan_models(args: argparse.Namespace, config: ServerConfig) -> list[tuple[ModelSpec, EngineArgs]]:
    """Each served model's engine options. Several models share the KV budget
    (--kv-cache-memory, or its default) equally, unless one sets its own; the budgets
    and the weights' files must fit in the memory free now."""
    # a model named by its Hub id is resolved here, once: downloaded (with progress) before any engine starts
    planned = [(spec, with_model_paths(engine_args)) for spec, engine_args in served_models(args)]
    specs = [spec for spec, _ in planned]
    if specs[0].name is not None and config.served_model_name is not None:
        raise TokenmillError("--served-model-name names a model given as a PATH; --model NAME=PATH names its own")
    if len(specs) > 1:
        if replica_config_from_namespace(args).enabled or under_torchrun():
            raise TokenmillError("several models are served by one process: not with engine replicas or torchrun")
    parse_routers(
        config.router,
        [s.name or "" for s in specs],
        config.router_threshold,
        config.router_max_prompt_tokens,
        config.router_large_for,
        config.router_classifier,
    )  # (fails before any model loads)
    if config.router and len(specs) == 1:
        raise TokenmillError("--router routes between served models: give two with --model NAME=PATH")
    if len(specs) > 1:
        _check_memory(planned)
    return planned


def _check_memory(planned: list[tuple[ModelSpec, EngineArgs]]) -> None:
    from tokenmill.model.paths import resolve_model_path

    need, parts = 0, []
    for spec, engine_args in planned:
        if engine_args.load.device != "cpu":  # its weights and KV live in the accelerator's memory
            parts.append(f"{spec.name}: on {engine_args.load.device}, not counted")
            continue
        path = resolve_model_path(engine_args.load.model)
        weights = (
            path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        )
        kv = parse_memory(engine_args.cache.kv_cache_memory)
        need += weights + kv
        parts.append(f"{spec.name}: weights ~{weights / 2**30:.2f} GiB + KV {kv / 2**30:.2f} GiB")
    free = available_memory()
    if need > free:
        raise TokenmillError(
            f"the models need ~{need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB is free "
            f"({'; '.join(parts)}): lower --kv-cache-memory, or a model's kv_cache_memory="
        )
    print(
        f"tokenmill: memory: {'; '.join(parts)} (~{need / 2**30:.2f} of {free / 2**30:.2f} GiB free; weights "
        "dequantised at load take more than their files)",
        file=sys.stderr,
        flush=True,
    )


def _run_server(models: list[ServedModel], config: ServerConfig, sock: socket.socket | None = None) -> None:
    import uvicorn

    app = build_models_app(models, config)
    names = ", ".join(m.name for m in models) + "".join(f", {r} (router)" for r in app.state.served.routers)
    print(f"tokenmill: serving {names} on http://{config.host}:{config.port}/v1", file=sys.stderr, flush=True)
    if config.web:
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        key = " (it asks for the API key)" if config.api_key or config.api_key_file else ""
        print(
            f"tokenmill: chat and watch the engine: open http://{host}:{config.port}/ in a browser{key}",
            file=sys.stderr,
            flush=True,
        )
    # uvicorn waits a little longer than the drain timeout, so that at the timeout our
    # open streams can still send their error event and [DONE] before it closes them.

    class Server(uvicorn.Server):
        armed = False

        def handle_exit(self, sig, frame) -> None:  # runs between the main thread's bytecodes, even mid-syscall
            super().handle_exit(sig, frame)
            if not self.armed:
                self.armed = True
                _exit_by(config.drain_timeout + EXIT_GRACE_S)

    server = Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            timeout_graceful_shutdown=config.drain_timeout + 2,
            log_level="warning",
            lifespan="off",
            **uvicorn_options(config),
        )
    )
    # uvicorn drains on SIGTERM and then re-raises it to the handler installed before
    # it started: make that one a no-op, so that a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)

    async def run() -> None:
        watchers = [
            asyncio.create_task(
                _expire_streams(server, app.state.served.stopping, app.state.served.drain_expired, config.drain_timeout)
            ),
            *[asyncio.create_task(_stop_when_dead(server, m.engine)) for m in models],
        ]
        try:
            await server.serve(sockets=None if sock is None else [sock])
        finally:
            for w in watchers:
                w.cancel()

    try:
        asyncio.run(run())
    finally:  # a request template's render still in flight has had its drain: its worker goes now
        if app.state.served.templates is not None:
            app.state.served.templates.close()


def serve(args: argparse.Namespace) -> int:
    config = server_config_from_namespace(args)
    api_keys(config)  # a bad keys file fails now, before any model loads
    planned = _plan_models(args, config)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = _bind(config) if replica_config_from_namespace(args).enabled else None
    models: list[ServedModel] = []
    closers: list = []
    try:  # from here on every engine started (perhaps a process) is stopped however this ends
        for spec, engine_args in planned:
            engine, tokenizer, max_model_len, path, close = _start_engine(args, config, engine_args)
            name = spec.name or config.served_model_name or (spec.path if hub_ref(spec.path) else model_id(path))
            models.append(ServedModel(name, engine, tokenizer, max_model_len))
            closers.append(close)
        if planned[0][0].name is None:  # the single-model form: the name in the config, as before
            config = replace(config, served_model_name=models[0].name)
        _run_server(models, config, sock)
    finally:
        for m in models:
            m.engine.shutdown()
        for close in closers:
            close()
    dead = [m for m in models if m.engine.death is not None]
    if dead:
        which = f" (model {dead[0].name})" if len(models) > 1 else ""
        print(
            f"tokenmill: the engine died ({dead[0].engine.death}){which}; server stopped", file=sys.stderr, flush=True
        )
        return 1
    print("tokenmill: server stopped", file=sys.stderr, flush=True)
    return 0
