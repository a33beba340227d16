"""A process tokenmill starts ends with its parent, however the parent ends.

The engine-core process (``core_process.py``) and the workers of a split model
(``distributed/rank_process.py``) call ``exit_with_parent`` first thing. A clean shutdown
never needs it (the parent tells its children to stop and waits for them), but a
parent killed by SIGKILL, or by a SIGTERM it does not handle, cannot; a child left
behind keeps a model in memory (or a GPU) and serves nobody. Each child watches its
own direct parent, so a chain (API process -> engine core -> workers) comes down link
by link. Two guards:

- Linux's parent-death signal, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills
  the child the moment its parent goes, even one stuck in native code holding the
  GIL. It fires when the parent *thread* that started the child ends, though, not
  the process: a child started from a thread that returns would die with a healthy
  parent. So it is armed only when the parent's main thread started the child (whose
  end is the process's end); the child reads that in ``/proc``.
- A daemon thread that compares ``os.getppid()`` with the parent's pid every
  ``POLL_S`` and exits when they differ (the child was handed to init or a
  subreaper): on every POSIX system, whichever thread started the child.

The parent's pid is the one the parent recorded, never ``os.getppid()`` read in the
child: a parent that died while its child was still importing torch would be taken
for init, and watched forever. Checked right after the signal is armed, it also
catches a parent that died before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

POLL_S = 0.5
EXIT_STATUS = 1
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A tokenmill command started by another as a plain subprocess (tune's servers) finds its
# parent's pid here and calls exit_with_parent first thing.
EXIT_WITH_PARENT_ENV = "TOKENMILL_EXIT_WITH_PARENT"


def exit_with_parent(parent_pid: int) -> None:
    """End this process when the process ``parent_pid`` (the one that started it) ends."""
    if sys.platform.startswith("linux") and _started_by_main_thread(parent_pid):
        _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # gone already (before the signal was armed: it will never come)
        _exit(parent_pid)
    threading.Thread(target=_watch, args=(parent_pid,), name="tokenmill-parent-watch", daemon=True).start()


def _started_by_main_thread(parent_pid: int) -> bool:
    """Whether this process is a child of the parent's main thread (whose task id is the
    parent's pid). False where /proc does not say (no CONFIG_PROC_CHILDREN): then only
    the watchdog guards."""
    try:
        with open(f"/proc/{parent_pid}/task/{parent_pid}/children") as f:
            return str(os.getpid()) in f.read().split()
    except OSError:
        return False


def _set_parent_death_signal(sig: int) -> None:
    """Arm the parent-death signal, where libc has prctl (else the watchdog alone guards)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _exit(parent_pid)


def _exit(parent_pid: int) -> None:
    """Leave at once: no cleanup that could wait on a parent that is gone (os._exit)."""
    try:
        os.write(2, f"tokenmill: parent process {parent_pid} is gone; process {os.getpid()} exits\n".encode())
    except OSError:  # stderr went with the parent
        pass
    os._exit(EXIT_STATUS)
