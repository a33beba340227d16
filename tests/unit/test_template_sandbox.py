"""The workers that render request chat templates (server/jobs/template_sandbox.py): a render
past the timeout or the memory limit is a 400 naming ``chat_template`` and its worker
is replaced, a pool whose workers are all held answers 429, and the workers end with
the process that started them, however it ends. Real worker processes, no model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import process_alive
from tokenmill.errors import InvalidRequestError
from tokenmill.model.chat_template import TemplateLimits
from tokenmill.server.jobs.template_sandbox import RequestTemplates
from tokenmill.server.protocol.error_responses import APIError

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
LIVENESS_S = 60  # far more than any of these takes: only a render nobody stops gets there
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def render(pool: RequestTemplates, template: str) -> str:
    return asyncio.run(pool.run(lambda r: r(template, CHAT)))


def worker_pids(pool: RequestTemplates) -> list[int]:
    return [w.process.pid for w in pool._workers if w.process is not None]


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while process_alive(pid):
        assert time.monotonic() < deadline, f"worker {pid} is still alive"
        time.sleep(0.05)


@pytest.fixture()
def pool():
    p = RequestTemplates(TemplateLimits(timeout=1.0, memory=256 << 20, max_chars=1 << 20), workers=1)
    yield p
    p.close()


def test_a_render_past_the_timeout_is_stopped_and_the_next_gets_a_fresh_worker(pool):
    assert render(pool, "{{ messages[0].content }}") == "Hi"
    first = worker_pids(pool)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="did not render within 1 s") as e:
        render(pool, LOOPS)
    assert e.value.param == "chat_template" and time.monotonic() - start < LIVENESS_S
    wait_gone(first[0])
    assert render(pool, "{{ messages[0].content }}!") == "Hi!"
    assert worker_pids(pool) != first


def test_a_worker_runs_at_the_lowest_cpu_priority(pool):
    """A render is one client's input: a template that loops until its timeout must take
    only the CPU the engine's steps leave (nice 19), not a core from them."""
    assert render(pool, "{{ messages[0].content }}") == "Hi"
    stat = Path(f"/proc/{worker_pids(pool)[0]}/stat").read_text()
    assert int(stat.rsplit(")", 1)[1].split()[16]) == 19  # field 19 of stat: nice
    assert os.nice(0) < 19  # and the server's own priority is left as it was


def test_memory_past_the_limit_is_a_400_and_the_worker_is_replaced(pool):
    """``center`` builds its string in one call, which no operator check sees: the
    worker's address-space limit does."""
    with pytest.raises(InvalidRequestError, match="more memory than a render may take") as e:
        render(pool, "{{ 'a'|center(1000000000) }}")
    assert e.value.param == "chat_template"
    assert render(pool, "{{ messages[0].role }}") == "user"


def test_a_template_error_is_a_400_naming_chat_template(pool):
    with pytest.raises(InvalidRequestError, match="Range too big") as e:
        render(pool, "{% for i in range(100001) %}{% endfor %}")
    assert e.value.param == "chat_template"


def test_with_every_worker_held_a_request_waits_out_the_timeout_then_gets_429(pool):
    held, release = threading.Event(), threading.Event()

    def hold(_render):
        held.set()
        release.wait(LIVENESS_S)
        return "held"

    async def go():
        holder = asyncio.create_task(pool.run(hold))
        while not held.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(APIError) as e:
            await pool.run(lambda r: r("{{ 1 }}", CHAT))
        release.set()
        after = await pool.run(lambda r: r("{{ messages[0].content }}", CHAT))
        return e.value, await holder, after

    try:
        busy, holder, after = asyncio.run(go())
    finally:
        release.set()
    assert (busy.status, busy.param) == (429, "chat_template") and "busy" in busy.message
    assert (holder, after) == ("held", "Hi")


def test_close_ends_the_workers(pool):
    render(pool, "{{ 1 }}")
    pid = worker_pids(pool)[0]
    pool.close()
    assert not process_alive(pid)


# a process that renders once, says its worker's pid and waits to be killed
KILLED = (
    "import asyncio, time\n"
    "from tokenmill.model.chat_template import TemplateLimits\n"
    "from tokenmill.server.jobs.template_sandbox import RequestTemplates\n"
    "if __name__ == '__main__':\n"
    "    pool = RequestTemplates(TemplateLimits(5.0, 256 << 20, 1000), 1)\n"
    "    assert asyncio.run(pool.run(lambda r: r('{{ 1 }}', {}))) == '1'\n"
    "    print(pool._workers[0].process.pid, flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_worker_ends_with_its_killed_server():
    """SIGKILL: nothing of the server's runs, yet its worker goes (host/lifetime.py)."""
    server = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(server.stdout.readline())
        os.kill(server.pid, signal.SIGKILL)
        server.wait(LIVENESS_S)
        wait_gone(pid)
    finally:
        server.kill()
        server.wait()
