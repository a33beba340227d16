"""`tokenmill serve`: the engine loop, the app and uvicorn, with a graceful drain.

On SIGTERM (or Ctrl-C) uvicorn closes the listening socket at once, so nothing new
is admitted, then waits up to ``--drain-timeout`` seconds for in-flight requests to
finish before cancelling what is left (which aborts those requests); the engine
loop stops last and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace

from tokenmill.args import server_config_from_namespace
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import build_app


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
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, timeout_graceful_shutdown=config.drain_timeout,
                       log_level="warning", lifespan="off")  # fmt: skip
    )
    # uvicorn drains on SIGTERM and then re-raises it to the handler installed before
    # it started: make that one a no-op, so that a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown()
    print("tokenmill: server stopped", file=sys.stderr, flush=True)
    return 0
