"""The Grafana dashboard and the Prometheus alert rules query only metrics that a
tokenmill server exports (a renamed metric must not silently blank a panel)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app

OPS = Path(__file__).parents[2] / "ops"
METRIC = re.compile(r"tokenmill:[a-z0-9_]+")


def exported_names() -> set[str]:
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    )
    app = build_app(engine, ToyTokenizer(), 64, ServerConfig(served_model_name="toy"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})  # so histograms have samples
            assert r.status_code == 200
            return (await c.get("/metrics")).text

    try:
        text = asyncio.run(go())
    finally:
        engine.shutdown()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("tokenmill:")}


def test_every_metric_the_dashboard_and_alerts_query_is_exported():
    exported = exported_names()
    dashboard = json.loads((OPS / "grafana" / "tokenmill.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if "tokenmill:" in str(v.get("query"))]
    rules = (OPS / "prometheus" / "alerts.yml").read_text()
    queried = {m for e in exprs for m in METRIC.findall(e)} | set(METRIC.findall(rules))
    assert len(queried) >= 12
    missing = sorted(queried - exported)
    assert not missing, f"queried but not exported: {missing}"
    assert "tokenmill:engine_alive" in queried and "tokenmill:kv_cache_usage_perc" in queried
