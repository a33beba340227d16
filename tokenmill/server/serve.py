"""`tokenmill serve`: the engine loop, the app and uvicorn, with a graceful drain.

On SIGTERM (or Ctrl-C) uvicorn closes the listening socket at once, so nothing new
is admitted, then waits up to ``--drain-timeout`` seconds for in-flight requests to
finish. Streams still open then end with an error event and ``[DONE]``; what is left
is cancelled (which aborts those requests); the engine loop stops last and the
process exits 0.

If the engine dies (its loop fails, or a worker process of a split model dies), the
requests in flight get 503, the server stops accepting, and the process exits 1, so
that a supervisor restarts it instead of leaving a server that can only answer 503.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace

from tokenmill.args import server_config_from_namespace
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import build_app


async def _stop_when_dead(server, engine: AsyncEngine, grace: float = 0.5) -> None:
    while engine.death is None:
        await asyncio.sleep(0.1)
    await asyncio.sleep(grace)  # let the requests in flight send their 503
    server.should_exit = True


async def _expire_streams(server, drain_expired: asyncio.Event, drain_timeout: float) -> None:
    """Once a shutdown has begun, wait out the drain timeout, then end open streams."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await asyncio.sleep(drain_timeout)
    drain_expired.set()


def serve(llm, args: argparse.Namespace) -> int:
    import uvicorn

    config = server_config_from_namespace(args)
    path = llm.model_path
    name = config.served_model_name or (path.stem if path.is_file() else path.name)
    config = replace(config, served_model_name=name)
    engine = AsyncEngine(llm.engine)
    app = build_app(engine, llm.tokenizer, llm.max_model_len, config)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(f"tokenmill: serving {name} on http://{config.host}:{config.port}/v1", file=sys.stderr, flush=True)
    # uvicorn waits a little longer than the drain timeout, so that at the timeout our
    # open streams can still send their error event and [DONE] before it closes them.
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, timeout_graceful_shutdown=config.drain_timeout + 2,
                       log_level="warning", lifespan="off")  # fmt: skip
    )
    # uvicorn drains on SIGTERM and then re-raises it to the handler installed before
    # it started: make that one a no-op, so that a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)

    async def run() -> None:
        watchers = [asyncio.create_task(_expire_streams(server, app.state.served.drain_expired, config.drain_timeout)),
                    asyncio.create_task(_stop_when_dead(server, engine))]  # fmt: skip
        try:
            await server.serve()
        finally:
            for w in watchers:
                w.cancel()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
        llm.close()
    if engine.death is not None:
        print(f"tokenmill: the engine died ({engine.death}); server stopped", file=sys.stderr, flush=True)
        return 1
    print("tokenmill: server stopped", file=sys.stderr, flush=True)
    return 0
