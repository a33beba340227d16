"""Memory sizes as users write them, and the memory this machine has free: torch-free,
so that the API process can split a KV budget between models before any loads."""

from __future__ import annotations

import ctypes
import os

from tokenmill.configuration.flag_types import BadValue
from tokenmill.errors import TokenmillError


def available_memory() -> int:
    """Bytes of memory free now (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_kv_cache_memory() -> int:
    """A tenth of the memory available now, between 256 MiB and 2 GiB."""
    return min(max(available_memory() // 10, 256 << 20), 2 << 30)


def parse_memory(value: int | float | str | None) -> int:
    """Bytes from 1073741824, '1GiB', '512MiB', '2GB' or a float of GiB such as 1.5."""
    if value is None:
        return default_kv_cache_memory()
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) and value >= 1 << 20 else int(value * (1 << 30))
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    text = value.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    try:
        return parse_memory(float(text) if "." in text else int(text))
    except ValueError:
        raise TokenmillError(f"cannot read memory size {value!r}; use e.g. 1GiB, 512MiB or bytes") from None


def memory_size(value: int | float | str) -> int | float | str:
    """A memory size flag's or config field's check (``opt(..., check=memory_size)``):
    readable by ``parse_memory`` and above 0 bytes. The value is kept as written."""
    try:
        size = parse_memory(value)
    except (TokenmillError, ValueError, OverflowError):  # (also 'nanGiB', '1e999GiB')
        raise BadValue(f"cannot read memory size {value!r}; use e.g. 1GiB, 512MiB or bytes") from None
    if size <= 0:
        raise BadValue(f"must be above 0 bytes, got {value}")
    return value


# glibc's malloc gives freed blocks over 128 KiB back to the system (munmap, or trimming the
# heap's top) and faults fresh pages in on the next allocation: a CPU step allocates and frees
# megabytes of activations per layer, so a prefill spent ~7% of its time clearing pages. Kept for
# reuse: prefill +20% (135M F16) and +14% (the bundled Q4_1) on a 2-core AVX2 EPYC, decode the
# same (bench/RESULTS.md). What it keeps: at most 256 MiB free at the heap's top.
MALLOC_OPTIONS = (("M_MMAP_THRESHOLD", -3, 32 << 20), ("M_TRIM_THRESHOLD", -1, 256 << 20), ("M_TOP_PAD", -2, 64 << 20))


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocations (``MALLOC_OPTIONS``);
    False where the C library is not glibc or the user set malloc options of their own
    (``MALLOC_*_``, ``GLIBC_TUNABLES``)."""
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(code, value) == 1 for _, code, value in MALLOC_OPTIONS)
