"""Build and load the C++ CPU kernels (``csrc/*.cpp``), once per machine.

The sources are compiled by ``torch.utils.cpp_extension`` with ``-march=native`` on the
machine that runs it, under a name holding the CPU's ISA tag and a hash of the sources,
flags and torch version, so an AVX2-only machine and an AVX-512 one sharing a home
directory each get (and keep) their own build. ``make install`` builds it ahead
(``python -m tokenmill.kernels``); otherwise the first model load does (~1 min).
Where there is no compiler or the build fails, ``load_native`` says so in one line
and returns False: the pure-torch reference path then runs everything.

A build must survive being killed half-way (issue 57): torch's own ``lock`` file outlives
a killed holder, and every later start then waited on it forever. So a build runs under
an OS file lock (which dies with its holder, however it dies), in a folder of its own,
moved into place whole when it is done: a finished build is one folder with its library,
anything else is what a killed build left, removed (with one line saying so) by the next
build. The sources are compiled from a copy in the build folder, named by their hash, so
two checkouts of the same sources share one build instead of rebuilding each other's.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from tokenmill.kernels.cpu import cpu_info

log = logging.getLogger("tokenmill")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "cpu_ops.cpp",
        "quant_ops.cpp",
        "ggml_ops.cpp",
        "ggml_groups.cpp",
        "ggml_bands.cpp",
        "ggml_amx.cpp",
        "decode_loop.cpp",
        "gemm.cpp",
    )
]
# -fopenmp: at::parallel_for is inline OpenMP, compiled into our code (without it, one thread)
BASE_CFLAGS = ["-O3", "-fopenmp", "-Wno-unused-function"]
# How long to wait for another live process's build before running without the kernels:
# far beyond a build on a busy machine, short of forever (a holder that died frees it at once).
BUILD_WAIT_S = 1800.0
PARTIAL = ".partial-"  # <name>.partial-<pid>: a build under way, or one its process did not finish


def target_arch() -> str:
    """``-march`` value: the machine itself, unless TOKENMILL_MARCH names another (e.g.
    ``haswell``, to build and test the AVX2-only path on an AVX-512 machine)."""
    return os.environ.get("TOKENMILL_MARCH", "native")


def cflags() -> list[str]:
    return [*BASE_CFLAGS, f"-march={target_arch()}"]


def source_files() -> dict[str, bytes]:
    """What a build compiles, by file name: the C++ files and every header beside them."""
    return {p.name: p.read_bytes() for p in [*SOURCES, *sorted(CSRC.glob("*.h"))]}


def build_name(sources: dict[str, bytes] | None = None) -> str:
    """The build's name: the ISA it targets and a hash of everything that makes its library
    differ (the sources, the flags, torch's headers, and for ``-march=native`` the CPU it was
    compiled on), never the checkout's path."""
    h = hashlib.sha256()
    for file, data in sorted((sources or source_files()).items()):
        h.update(f"{file}\0{len(data)}\0".encode() + data)
    h.update(f"{' '.join(cflags())}\0{torch.__version__}".encode())
    native = target_arch() == "native"
    if native:  # -march=native is this CPU's code: another CPU of the same ISA tag builds its own
        h.update(f"\0{cpu_info().model}\0{' '.join(cpu_info().flags)}".encode())
    arch = cpu_info().isa_tag if native else target_arch().replace("-", "_")
    return f"tokenmill_cpu_{arch}_{h.hexdigest()[:10]}"


@cache
def load_native(verbose: bool = False) -> bool:
    """Load the kernels (compiling them first where no finished build exists); True when
    torch.ops.tokenmill has them.

    ``TOKENMILL_NATIVE=0`` in the environment skips them (the reference path runs)."""
    if os.environ.get("TOKENMILL_NATIVE", "1") == "0":
        return False
    if hasattr(torch.ops, "tokenmill") and hasattr(torch.ops.tokenmill, "decode_layers"):
        return True
    reason = _missing_tool()
    if reason is None:
        try:
            _load_or_build(verbose)
            return True
        except Exception as e:
            reason = f"build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
    log.warning("tokenmill: native CPU kernels unavailable, %s; using the pure-torch path (slower)", reason)
    return False


def _load_or_build(verbose: bool) -> None:
    sources = source_files()
    name = build_name(sources)
    final = _builds() / name
    if not _library(final).is_file():
        with _exclusive(final.with_name(f"{name}.lock")):
            if not _library(final).is_file():  # else another process finished it while we waited
                _build(final, sources, verbose)  # (which loads it)
                return
    torch.ops.load_library(str(_library(final)))


def _build(final: Path, sources: dict[str, bytes], verbose: bool) -> None:
    """Compile into ``<name>.partial-<pid>`` and rename it to ``<name>`` once the library
    builds and loads. Called holding the build's lock: any partial folder is a dead process's."""
    name = final.name
    _remove_leftovers(final)
    partial = final.with_name(f"{name}{PARTIAL}{os.getpid()}")
    (partial / "src").mkdir(parents=True)
    for file, data in sources.items():
        (partial / "src" / file).write_bytes(data)
    _say(  # minutes of silence otherwise (issue 43): say what, why and how long
        f"tokenmill: compiling the native CPU kernels for this machine ({name}, {len(SOURCES)} C++ files, "
        "-march=" + target_arch() + "); once per machine and source, usually 1-2 minutes on two idle "
        "cores, longer on a busy machine ..."
    )
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        load(  # builds in `partial` and loads the library from there
            name=name,
            sources=[str(partial / "src" / p.name) for p in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(partial),
            is_python_module=False,
            verbose=verbose,
        )
    except BaseException:  # a failed or interrupted build leaves nothing behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(final)  # whole, at once: a finished build is a folder holding its library
    _say(f"tokenmill: native CPU kernels built in {time.perf_counter() - started:.0f} s (cached in {final})")


def _remove_leftovers(final: Path) -> None:
    """What killed builds of this name left (their processes are gone: we hold the lock),
    removed with one line saying so."""
    left = sorted(final.parent.glob(f"{final.name}{PARTIAL}*"))
    if final.exists():  # a folder without its library: not ours to trust
        left.append(final)
    if not left:
        return
    pids = [p.name.rpartition(PARTIAL)[2] for p in left if PARTIAL in p.name]
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    who = f"process {', '.join(pids)}" if pids else "a process"
    _say(
        f"tokenmill: a native-kernel build by {who} was stopped before it finished; "
        f"removed what it left ({', '.join(str(p) for p in left)}) and building again"
    )


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """This process alone, across processes, until the block ends or the process dies: an
    ``flock`` (the OS drops it with its holder, unlike a file that says "locked"). The file
    holds the holder's pid, for the line that says whom a waiting start waits for."""
    with open(lock, "a+") as f:  # opened close-on-exec: the compilers do not inherit it
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            _say(f"tokenmill: waiting for process {holder}, which is compiling the native CPU kernels ({lock}) ...")
            deadline = time.monotonic() + BUILD_WAIT_S
            while True:
                time.sleep(0.5)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"process {holder} still compiling after {BUILD_WAIT_S / 60:.0f} min ({lock})"
                        ) from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(line: str) -> None:
    """A progress line on stderr, whatever the logging set-up (the CLI's, a server's, none)."""
    print(line, file=sys.stderr, flush=True)


def _builds() -> Path:
    """Our folder in torch's extension cache (``TORCH_EXTENSIONS_DIR`` where set): a
    ``<name>`` folder per finished build, a ``<name>.lock`` file per build name."""
    from torch.utils.cpp_extension import _get_build_directory  # no public name for the cache's place

    return Path(_get_build_directory("tokenmill", verbose=False))


def _library(build: Path) -> Path:
    return build / f"{build.name}.so"


def _built(name: str) -> bool:
    """Whether a finished build of this name is in the cache (then loading takes a second)."""
    return _library(_builds() / name).is_file()


def _missing_tool() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return "no C++ compiler found (install g++)"
    if not is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None
