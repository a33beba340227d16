"""A CPU engine's process keeps freed memory for its next allocations (memory.keep_freed_memory):
a freed 8 MiB block stays in glibc's heap instead of going back to the system, so the next
step's activations are not faulted in afresh. Each case in a fresh interpreter (the options
are the process's)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

try:
    GLIBC = hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
except OSError:
    GLIBC = False

PROBE = """
import ctypes, sys
from tokenmill.configuration.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
p = libc.malloc(8 << 20)
ctypes.memset(p, 1, 8 << 20)
libc.free(p)
print(kept, libc.mallinfo2().fordblks)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_memory_stays_in_the_heap_once_kept():
    def free_bytes(mode: str) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": "/usr/bin:/bin"},
        ).stdout.split()
        return out[0], int(out[1])

    kept, after = free_bytes("keep")
    _, default = free_bytes("default")
    assert kept == "True" and after >= 8 << 20  # the block is free in the heap, ready for the next one
    assert default < 8 << 20  # glibc's default: an 8 MiB block is mapped and unmapped


def test_the_users_own_malloc_options_win(monkeypatch):
    from tokenmill.configuration.memory import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    assert keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576")
    assert keep_freed_memory() is False
