"""Build and load the C++ CPU kernels (``csrc/*.cpp``), once per machine.

The sources are compiled by ``torch.utils.cpp_extension`` with ``-march=native`` on the
machine that runs it, under a name holding the CPU's ISA tag and a hash of the source,
so an AVX2-only machine and an AVX-512 one sharing a home directory each get (and
keep, in torch's extension cache) their own build. ``make install`` builds it ahead
(``python -m tokenmill.kernels``); otherwise the first model load does (~1 min).
Where there is no compiler or the build fails, ``load_native`` says so in one line
and returns False: the pure-torch reference path then runs everything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from functools import cache
from pathlib import Path

import torch

from tokenmill.kernels.cpu import cpu_info

log = logging.getLogger("tokenmill")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("cpu_ops.cpp", "quant_ops.cpp", "ggml_ops.cpp", "ggml_groups.cpp", "decode_loop.cpp", "gemm.cpp")
]
# -fopenmp: at::parallel_for is inline OpenMP, compiled into our code (without it, one thread)
BASE_CFLAGS = ["-O3", "-fopenmp", "-Wno-unused-function"]


def target_arch() -> str:
    """``-march`` value: the machine itself, unless TOKENMILL_MARCH names another (e.g.
    ``haswell``, to build and test the AVX2-only path on an AVX-512 machine)."""
    return os.environ.get("TOKENMILL_MARCH", "native")


def cflags() -> list[str]:
    return [*BASE_CFLAGS, f"-march={target_arch()}"]


def build_name() -> str:
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in [*SOURCES, *sorted(CSRC.glob("*.h"))]) + " ".join(cflags()).encode()
    ).hexdigest()[:10]
    arch = cpu_info().isa_tag if target_arch() == "native" else target_arch().replace("-", "_")
    return f"tokenmill_cpu_{arch}_{digest}"


@cache
def load_native(verbose: bool = False) -> bool:
    """Compile (or find in the cache) and load the kernels; True when torch.ops.tokenmill has them.

    ``TOKENMILL_NATIVE=0`` in the environment skips them (the reference path runs)."""
    if os.environ.get("TOKENMILL_NATIVE", "1") == "0":
        return False
    if hasattr(torch.ops, "tokenmill") and hasattr(torch.ops.tokenmill, "decode_layers"):
        return True
    reason = _missing_tool()
    if reason is None:
        name, started = build_name(), time.perf_counter()
        building = not _built(name)
        if building:  # minutes of silence otherwise (issue 43): say what, why and how long
            _say(
                f"tokenmill: compiling the native CPU kernels for this machine ({name}, {len(SOURCES)} C++ files, "
                "-march=" + target_arch() + "); once per machine and source, usually 1-2 minutes on two idle "
                "cores, longer on a busy machine ..."
            )
        try:
            from torch.utils.cpp_extension import load

            load(
                name=build_name(),
                sources=[str(p) for p in SOURCES],
                extra_cflags=cflags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=verbose,
            )
            if building:
                _say(f"tokenmill: native CPU kernels built in {time.perf_counter() - started:.0f} s (cached)")
            return True
        except Exception as e:
            reason = f"build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
    log.warning("tokenmill: native CPU kernels unavailable, %s; using the pure-torch path (slower)", reason)
    return False


def _say(line: str) -> None:
    """A progress line on stderr, whatever the logging set-up (the CLI's, a server's, none)."""
    print(line, file=sys.stderr, flush=True)


def _built(name: str) -> bool:
    """Whether torch's extension cache holds this build, up to date for these sources (then
    loading takes a second): its library newer than every source, built from these paths
    (ninja rebuilds for a new checkout of the same sources, or one with newer files)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # no public name for the cache's place

        where = Path(_get_build_directory(name, verbose=False))
        library, rules = where / f"{name}.so", where / "build.ninja"
        if not library.is_file() or not rules.is_file():
            return False
        newest = max(p.stat().st_mtime for p in [*SOURCES, *CSRC.glob("*.h")])
        text = rules.read_text()
        return library.stat().st_mtime >= newest and all(str(p) in text for p in SOURCES)
    except Exception:  # another torch: say nothing rather than guess
        return True


def _missing_tool() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return "no C++ compiler found (install g++)"
    if not is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None
