"""The prefix cache's disk tier behind `tokenmill serve`: what one server computed, a server
restarted on the same directory reads back (its blocks written before the first one exits),
answering the same; /metrics and the live state show the tier (and the host-memory tier
above it)."""

from __future__ import annotations

import time

import httpx

from tests.server.conftest import MODEL, Server

SYSTEM = "You are the harbour archive's assistant. " + "The archive keeps ledgers of tolls, ships and storms. " * 40


def ask(server: Server) -> tuple[str, float, float]:
    """A greedy answer, and the prefix-cache hits and disk-tier reads it brought."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which ledgers are kept?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    hits = server.metric("tokenmill:prefix_cache_hits_total")
    reads = server.metric("tokenmill:kv_disk_cache_hits_total")
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return (
        r.json()["choices"][0]["message"]["content"],
        server.metric("tokenmill:prefix_cache_hits_total") - hits,
        server.metric("tokenmill:kv_disk_cache_hits_total") - reads,
    )


def test_a_restarted_server_answers_from_the_blocks_the_last_one_wrote(tmp_path):
    first = Server("--kv-disk-cache", str(tmp_path), "--kv-host-cache", "32MiB")  # a host tier above it
    try:
        answer, hits, reads = ask(first)
        assert hits == 0 and reads == 0
        deadline = time.monotonic() + 30
        while first.metric("tokenmill:kv_disk_cache_stored_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # (written by the tier's thread)
        assert first.metric("tokenmill:kv_disk_cache_bytes") > 0
        live = httpx.get(first.url + "/tokenmill/live").json()["models"][0]["gauges"]["kv_disk"]
        assert live["stored"] > 0 and live["bytes"] > 0 and live["hits"] == 0
        host = httpx.get(first.url + "/tokenmill/live").json()["models"][0]["gauges"]["kv_host"]
        assert host["stored"] == first.metric("tokenmill:kv_host_cache_stored_total") >= live["stored"]
        assert host["bytes"] == first.metric("tokenmill:kv_host_cache_bytes") > 0 and host["hits"] == 0
    finally:
        assert first.stop() == 0
    files = list(tmp_path.rglob("*.kv"))
    second = Server("--kv-disk-cache", str(tmp_path))
    try:
        again, hits, reads = ask(second)
        assert again == answer
        assert reads >= len(files) - 2 and hits >= 16 * reads  # the prompt's blocks, from the disk
    finally:
        assert second.stop() == 0
