"""Memory sizes as users write them, and the memory this machine has free: torch-free,
so that the API process can split a KV budget between models before any loads."""

from __future__ import annotations

import os

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
