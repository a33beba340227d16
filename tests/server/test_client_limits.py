"""Issue 40 item 5: one client address cannot take the server. The body cap in process
(a forged peer address in the ASGI scope); the connection cap and the header timeout
on one real uvicorn on 127.0.0.1 with the options `tokenmill serve` gives it, flooded
from 127.0.0.2 (loopback too: all of 127.0.0.0/8 is) while 127.0.0.1 is served."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tests.helpers import ScriptedRunner, ToyTokenizer, wait_until
from tokenmill.configuration.serving_config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.server.app import build_app
from tokenmill.server.guards.clients import client_key, uvicorn_options

MODEL = "toy"
PROMPT = json.dumps({"prompt": "ab", "max_tokens": 2}).encode()


@pytest.fixture
def engine():
    engine = AsyncEngine(
        Engine.create(ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    )
    yield engine
    engine.shutdown()


def test_a_client_is_its_address_and_an_ipv6_host_its_64():
    assert client_key("203.0.113.7") == "203.0.113.7" and client_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key(None) is None and client_key("testclient") == "testclient"


def _scope(client: str) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("t", 80),
        "client": (client, 1234),
        "root_path": "",
    }


async def _post(app, client: str, whole: bool) -> tuple[int, bytes]:
    """A completions request from ``client``: its body whole, or half of it and no more."""
    parts = [{"type": "http.request", "body": PROMPT if whole else PROMPT[:5], "more_body": not whole}]
    sent: list[dict] = []

    async def receive() -> dict:
        if parts:
            return parts.pop()
        await asyncio.sleep(3600)  # the rest never comes
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(_scope(client), receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_unfinished_bodies_are_capped_per_client_and_other_clients_are_served(engine):
    """Five half-sent bodies from one address: two are held, three are refused 429 at
    once, so that another address is served although only three requests may be open."""
    config = ServerConfig(
        served_model_name=MODEL, max_open_requests=3, max_unfinished_bodies_per_client=2, request_body_timeout=3600
    )
    app = build_app(engine, ToyTokenizer(), 64, config)

    async def main():
        flood = [asyncio.create_task(_post(app, "10.0.0.1", whole=False)) for _ in range(5)]
        await asyncio.sleep(0.2)
        refused = [t.result() for t in flood if t.done()]
        other = await asyncio.wait_for(_post(app, "10.0.0.2", whole=True), 10)
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        again = await asyncio.wait_for(_post(app, "10.0.0.1", whole=True), 10)  # the held bodies ended: room again
        return refused, other, again

    refused, other, again = asyncio.run(main())
    assert len(refused) == 3, refused
    for status, body in refused:
        err = json.loads(body)["error"]
        assert status == 429 and err["code"] == 429 and err["type"] == "RateLimitError"
        assert "--max-unfinished-bodies-per-client" in err["message"]
    assert other[0] == 200 and json.loads(other[1])["choices"][0]["text"]
    assert again[0] == 200


def _connect(port: int, source: str, data: bytes = b"") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """The server closed ``s`` (perhaps after an answer) within ``seconds``."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, ConnectionResetError):
        return False


@pytest.mark.parametrize("protocol", ["auto", "h11"])
def test_a_connection_flood_from_one_address_leaves_another_served_and_idle_connections_close(engine, protocol):
    config = ServerConfig(
        served_model_name=MODEL,
        max_open_requests=6,
        max_connections_per_client=4,
        request_header_timeout=0.5,
        request_body_timeout=3600,
    )
    base = None
    if protocol == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, ToyTokenizer(), 64, config),
            log_level="warning",
            lifespan="off",
            **uvicorn_options(config, base),
        )
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(PROMPT)
    )
    flood: list[socket.socket] = []
    try:
        assert wait_until(lambda: server.started, timeout=10)
        # Ten connections from 127.0.0.2, each a request head and half its body.
        flood = [_connect(port, "127.0.0.2", head + PROMPT[:5]) for _ in range(10)]
        answered: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + 3
        while len(answered) < 6 and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in flood if s not in answered], [], [], 0.1)
            for s in readable:
                answered[s] = _read_all(s)
        assert len(answered) == 6, f"{len(answered)} of the flood's 10 connections answered"
        for reply in answered.values():
            status, _, body = reply.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 429"), reply
            err = json.loads(body)["error"]
            assert err["code"] == 429 and "--max-connections-per-client" in err["message"]
        # 127.0.0.1 is served meanwhile (each request on a connection of its own)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            assert c.get("/v1/models").status_code == 200
            r = c.post("/v1/completions", content=PROMPT, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # Connections that send no whole head are closed after the header timeout (0.5 s),
        # and so is one that goes quiet with half a head after a response; the four held
        # requests, whose heads arrived, are not (the body timeout is theirs).
        started = time.monotonic()
        silent = _connect(port, "127.0.0.1")
        partial = _connect(port, "127.0.0.1", b"GET /health HTTP/1.1\r\nHost: t\r\n")
        again = _connect(port, "127.0.0.1", b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert again.recv(65536).startswith(b"HTTP/1.1 200")
        again.sendall(b"GET /health HTTP/1.1\r\n")
        assert all(_closed_within(s, 3) for s in (silent, partial, again))
        assert time.monotonic() - started < 2.5
        held = [s for s in flood if s not in answered]
        assert not select.select(held, [], [], 0)[0], "a held request's connection was closed or answered"
    finally:
        for s in flood:
            s.close()
        server.should_exit = True
        thread.join(10)


def _read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes ``s`` (or 2 s pass)."""
    s.settimeout(2)
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pass
    return b"".join(chunks)
