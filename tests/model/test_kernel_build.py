"""The native kernels' first build, in a fresh extensions folder (``TORCH_EXTENSIONS_DIR``),
as a user meets it (issue 57): killed half-way, the next start must take over and finish,
not wait forever on the killed build's lock; two checkouts of the same sources must share
one build, not rebuild each other's on every switch. The test compiles once (minutes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_pids, process_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]  # this checkout
BUILD_TIMEOUT_S = 900  # a liveness bound: a build takes 1-3 minutes on two busy cores
COMPILING = "compiling the native CPU kernels"
# What a start runs: the kernels load, from this checkout, and compute what their reference does.
CHECK = """
import os, torch
from tokenmill.kernels import native
assert native.load_native(), 'the native kernels did not load'
x, w = torch.randn(5, 64), torch.randn(64)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
torch.testing.assert_close(torch.ops.tokenmill.rms_norm(x, w, 1e-6), ref)
print('loaded from', os.path.realpath(native.__file__))
"""


def start(checkout: Path, extensions: Path, *args: str) -> subprocess.Popen:
    """A fresh interpreter importing tokenmill from ``checkout``, in a session of its own
    (so that everything it starts can be found and killed)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=str(checkout))
    env.pop("TOKENMILL_NATIVE", None)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def compiling(pid: int) -> bool:
    """True once ninja, under ``pid``, runs a compiler: the build is under way."""
    return any(child_pids(n) for n in descendants(pid) if comm(n) == "ninja")


def kill_tree(proc: subprocess.Popen) -> str:
    """SIGKILL a process and everything under it (ninja puts each compiler in a process group
    of its own), stopping them first so that none starts another meanwhile; then wait for all.
    Returns what it had written to stderr."""
    stopped: set[int] = set()
    while pending := {proc.pid, *descendants(proc.pid)} - stopped:
        for pid in pending:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= pending
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, err = proc.communicate()
    assert wait_until(lambda: not any(process_alive(p) for p in stopped), 60, 0.1)
    return err


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """The start's exit code, stdout and stderr; a start still running after the bound hung."""
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        err = kill_tree(proc)
        raise AssertionError(f"the start hung: still running after {BUILD_TIMEOUT_S} s; it said:\n{err}") from None
    return proc.returncode, out, err


def test_a_killed_first_build_is_taken_over_then_shared_by_another_checkout(tmp_path):
    """Kill ``python -m tokenmill.kernels`` (the set-up step) while it compiles; the next start
    says in one line that it takes over the killed build, builds, and the kernels load. Then
    start from a copy of the checkout elsewhere and from this one again: neither recompiles,
    and each loads its own checkout's code. (One compile for both: each takes minutes.)"""
    extensions = tmp_path / "extensions"
    first = start(ROOT, extensions, "-m", "tokenmill.kernels")
    assert wait_until(lambda: compiling(first.pid) or first.poll() is not None, BUILD_TIMEOUT_S, 0.2)
    assert first.poll() is None, "the first build ended before it could be killed"
    kill_tree(first)

    code, out, err = finish(start(ROOT, extensions, "-c", CHECK))
    assert code == 0, err[-3000:]
    assert out.strip() == f"loaded from {ROOT / 'tokenmill' / 'kernels' / 'native.py'}", out
    assert COMPILING in err and "native CPU kernels built in" in err, err
    taken_over = [line for line in err.splitlines() if f"process {first.pid}" in line]
    assert len(taken_over) == 1, err

    other = tmp_path / "other-checkout"
    shutil.copytree(ROOT / "tokenmill", other / "tokenmill", ignore=shutil.ignore_patterns("__pycache__"))
    for checkout in (other, ROOT, other):
        started = time.monotonic()
        code, out, err = finish(start(checkout, extensions, "-c", CHECK))
        assert code == 0, err[-3000:]
        assert out.strip() == f"loaded from {checkout / 'tokenmill' / 'kernels' / 'native.py'}"
        assert COMPILING not in err, f"rebuilt for {checkout} ({time.monotonic() - started:.0f} s): {err}"
