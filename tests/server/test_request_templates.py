"""A chat template a request brings (``--trust-request-chat-template``) is rendered with
limits, in worker processes the server can stop (issue 57): the issue's hostile
templates are 400s naming ``chat_template`` (one ended a server, one was a 500, one
never ended), the server answers chat, completions and embeddings while seven endless
ones render, and SIGTERM stops it at once, its workers with it."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import child_pids, loads_torch, process_alive, wait_until
from tests.server.conftest import MODEL, Server

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HOSTILE = {
    "huge-string": "{{ 'a' * 10**9 }}",
    "range-too-big": "{% for i in range(100001) %}{% endfor %}x",
    "endless-loops": LOOPS,
}
CHAT = [{"role": "user", "content": "Name a colour."}]
LIVENESS_S = 60  # far beyond the default 5 s render timeout: only a render nobody stops gets there


@pytest.fixture(scope="module")
def trusting():
    s = Server("--trust-request-chat-template")
    yield s
    s.stop()


def chat(url: str, template: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **({"chat_template": template} if template else {})}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=LIVENESS_S)


def assert_refused(r: httpx.Response, statuses: tuple[int, ...] = (400,)) -> None:
    """A 4xx in OpenAI's error shape that names the request's template."""
    assert r.status_code in statuses, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "chat_template"
    assert error["code"] == r.status_code


def template_workers(server: Server) -> list[int]:
    """The server's template workers: its spawned children without torch (the engine
    core has it; spawn's resource tracker is no spawn_main)."""
    pids = []
    for pid in child_pids(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd and not loads_torch(pid):
                pids.append(pid)
        except FileNotFoundError:  # gone meanwhile
            pass
    return pids


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_issues_hostile_templates_are_400s_naming_chat_template(trusting, template):
    start = time.monotonic()
    r = chat(trusting.url, template)
    assert_refused(r)
    assert time.monotonic() - start < LIVENESS_S
    assert chat(trusting.url, "{{ messages[0].content }}").status_code == 200  # and the next is served


def test_the_server_answers_others_while_seven_endless_templates_render(trusting):
    """The seven take the workers (2) or wait for one, then get 400 (stopped at the
    timeout) or 429 (none free); meanwhile chat, completions and embeddings are answered."""
    with ThreadPoolExecutor(7) as pool:
        hostile = [pool.submit(chat, trusting.url, LOOPS) for _ in range(7)]
        wait_until(lambda: template_workers(trusting), timeout=10)  # (they render)
        with httpx.Client(base_url=trusting.url, timeout=LIVENESS_S) as c:
            assert chat(trusting.url).status_code == 200
            completion = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert completion.status_code == 200, completion.text
            embedding = c.post("/v1/embeddings", json={"model": MODEL, "input": "Hi"})
            assert embedding.status_code == 200, embedding.text
            assert c.get("/health").status_code == 200
        for f in hostile:
            assert_refused(f.result(), (400, 429))
    assert chat(trusting.url, "{{ messages[0].content }}").status_code == 200  # the workers were replaced


@pytest.mark.slow
def test_sigterm_stops_a_server_rendering_endless_templates_and_its_workers():
    server = Server("--trust-request-chat-template", "--drain-timeout", "60")
    try:
        with ThreadPoolExecutor(7) as pool:
            hostile = [pool.submit(chat, server.url, LOOPS) for _ in range(7)]
            wait_until(lambda: len(template_workers(server)) == 2, timeout=10)
            workers = template_workers(server)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(30) == 0  # drained (the renders end at their timeout), not the 60 s drain
            assert time.monotonic() - start < 30
            for f in hostile:
                try:
                    assert_refused(f.result(), (400, 429))
                except httpx.ConnectError:  # sent after the stop began: not admitted
                    pass
        assert wait_until(lambda: not any(process_alive(p) for p in workers), timeout=10)
    finally:
        server.stop()
