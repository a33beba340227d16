"""`tokenmill serve` with a split model: it serves, and when a worker dies the request
in flight gets 503, the server exits non-zero and no worker is left behind."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.helpers import child_pids, engine_core_pid, process_alive
from tests.server.conftest import MODEL, Server


def test_pipeline_parallel_server_dies_with_its_worker():
    server = Server("--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB")
    try:
        workers = child_pids(engine_core_pid(server.proc.pid))  # the ranks are the engine core's children
        assert len(workers) == 1 and process_alive(workers[0])
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]

        stream_body = {**body, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=stream_body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.kill(workers[0], signal.SIGKILL)
        assert events[-1]["error"]["code"] == 503, events[-1]
        assert "worker rank 1 exited with code -9" in events[-1]["error"]["message"]

        start = time.monotonic()
        code = server.proc.wait(timeout=30)
        assert code == 1 and time.monotonic() - start < 15
        assert "the engine died" in server.proc.stderr.read()
        assert not process_alive(workers[0])
    finally:
        server.stop()
