"""A child that calls ``exit_with_parent`` ends when its parent is killed (SIGKILL: no
cleanup of the parent's can run), whichever of the parent's threads started it; it
outlives a thread of a live parent; and a parent already gone ends it at once.

Plain Python children (no torch, no model): the engine-core and worker processes that
make the same call are tested in tests/model/test_parallel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import process_alive

pytestmark = pytest.mark.subprocess

CHILD = (
    "import sys, time\n"
    "from tokenmill.host.lifetime import exit_with_parent\n"
    "exit_with_parent(int(sys.argv[1]))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
# starts CHILD from its main thread or from another thread, which ends once the child
# has armed its guards (a thread that ends is what fires a parent-death signal)
PARENT = (
    "import os, subprocess, sys, threading, time\n"
    "def start():\n"
    "    child = subprocess.Popen([sys.executable, '-c', sys.argv[2], str(os.getpid())], stdout=subprocess.PIPE)\n"
    "    assert child.stdout.readline() == b'ready\\n'\n"
    "    print(child.pid, flush=True)\n"
    "if sys.argv[1] == 'main':\n"
    "    start()\n"
    "else:\n"
    "    threading.Thread(target=start).start()\n"
    "time.sleep(60)\n"
)


def wait_gone(pid: int, timeout: float) -> None:
    """Wait for the process to end; fail (and kill it) after ``timeout`` s."""
    start = time.monotonic()
    while process_alive(pid):
        if time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"process {pid} outlived its parent by {timeout} s")
        time.sleep(0.02)


@pytest.mark.parametrize("started_by", ["main", "thread"])
def test_child_ends_with_its_killed_parent(started_by):
    """Started by the main thread, the kernel's parent-death signal ends it, even stopped
    (as stuck as a process gets: no thread of its own runs); started by another thread,
    it survives that thread's end (the signal is not armed then) and the watchdog ends it."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, started_by, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the starting thread gone, two watchdog turns
        assert process_alive(child), "the child died with its parent alive"
        if started_by == "main":
            os.kill(child, signal.SIGSTOP)
    finally:
        parent.kill()
        parent.wait()
    wait_gone(child, timeout=3.0)


def test_parent_gone_before_the_child_watches():
    """The parent died while the child was starting: the child exits at once, and says why."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = subprocess.run([sys.executable, "-c", CHILD, str(gone.pid)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "ready" not in out.stdout
    assert f"parent process {gone.pid} is gone" in out.stderr
