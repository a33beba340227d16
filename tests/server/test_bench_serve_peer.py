"""`tokenmill bench serve` measures any OpenAI-compatible server, not only ours: here
an independent stub in the style of llama.cpp's server (it streams a `timings` object
of its own in every chunk, which once made every request fail with KeyError)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import wait_until
from tokenmill.loadgen.server_process import free_port

STUB = r"""
import json, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

async def completions(request):
    body = await request.json()
    n = int(body.get("max_tokens", 4))
    async def events():
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}],
                     "timings": {"predicted_n": i + 1, "predicted_ms": 1.0}}
            yield f"data: {json.dumps(chunk)}\n\n"
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
                "timings": {"predicted_n": n}}
        yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_bench_serve_measures_an_independent_openai_style_server(tmp_path):
    port = free_port()
    (tmp_path / "stub.py").write_text(STUB)
    stub = subprocess.Popen([sys.executable, str(tmp_path / "stub.py"), str(port)])
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=30)
        cmd = [
            sys.executable,
            "-m",
            "tokenmill",
            "bench",
            "serve",
            "--base-url",
            url,
            "--num-prompts",
            "8",
            "--request-rate",
            "inf",
            "--output-dir",
            str(tmp_path),
            "--label",
            "peer",
            "--price-per-hour",
            "3",
        ]
        started = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "no plots" not in r.stderr
        run = json.loads((tmp_path / "peer.json").read_text())["runs"][0]
        assert run["completed"] == 8 and run["failed"] == 0, run
        assert run["output_token_throughput"] > 0 and time.time() - started < 300
        assert (tmp_path / "peer_latency_cdf.png").stat().st_size > 1000
        # no energy on the stub's /metrics: this machine's, labelled; the cost at $3 an hour
        energy, cost = run["energy"], run["cost"]
        assert energy["source"] in ("measured", "estimated") and energy["joules"] >= 0
        assert energy["source"] == "measured" or energy["how"].endswith("(whole machine)")
        out_tokens = round(run["output_token_throughput"] * run["duration_s"])
        want = 3 * run["duration_s"] / 3600 / out_tokens * 1e6
        assert cost["dollars_per_million_output_tokens"] == pytest.approx(want)
        assert (tmp_path / "peer_energy_cost.png").stat().st_size > 1000
    finally:
        stub.terminate()
        stub.wait(10)
