"""The engine-core process of ``tokenmill serve``: loads the model, runs the core loop.

Started by the API process (``AsyncCoreClient``, spawn) with the engine options; it
builds an ``EngineCore`` over the model (factory.build_engine) and serves it over the
pipe (engine/core/core_loop.py). Ctrl-C and SIGTERM are the API process's to handle: it
drains, then tells this one to stop; a closed pipe (the API process died) stops it too,
between steps. An API process that dies while this one loads the model or runs a
step (killed, or a SIGTERM it did not handle) ends it at once (host/lifetime.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from multiprocessing.connection import Connection

from tokenmill.configuration.config import EngineArgs
from tokenmill.host.lifetime import exit_with_parent


def run_engine_core(args: EngineArgs, conn: Connection) -> None:
    parent = multiprocessing.parent_process()  # the pid the API process recorded: it may be gone already
    if parent is not None and parent.pid is not None:
        exit_with_parent(parent.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (engine core): %(message)s")

    def build():
        from tokenmill.engine.pipe.messages import CoreInfo
        from tokenmill.factory import build_engine

        parts = build_engine(args, progress=False, outputs=False)
        info = CoreInfo(parts.max_model_len, parts.num_blocks, args.cache.block_size, str(parts.model_path))
        return parts.core, info, parts.close

    from tokenmill.engine.core.core_loop import serve_core

    sys.exit(serve_core(build, conn))
