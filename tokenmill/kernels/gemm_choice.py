"""How this machine multiplies bfloat16 batches fastest: from how many rows upcast to
float32, and whether oneDNN's GEMM runs faster on a weight packed once (its blocked
layout) than on the plain one it repacks every call. Measured on the machine, once, and kept.

Which is faster is the machine's answer, not a CPU flag's: on an AVX512_BF16 Xeon,
oneDNN's bfloat16 GEMM reached 161-168 GFLOP/s against 203-306 in float32, so batches
from 128 rows were upcast (1.3-1.45x); on an AVX512_BF16 EPYC Zen 4 the same call in
bfloat16 reached 628-901 GFLOP/s, 4.3x its own float32, and the upcast rule alone cost
a third of the batched-serving gap to vLLM-CPU (issue 58). So ``upcast_rows`` times both
on a weight of a decoder's size at a few batch sizes (about a second, in the process
that loads a model) and keeps the answer in a small JSON file per machine: CPU model,
flags, torch version and threads, so a machine, a torch or a thread count of its own
measures again. ``TOKENMILL_UPCAST_ROWS`` (a row count, or ``never``) overrides it.

The packed weight (vLLM-CPU's ``onednn_mm`` does the same) spares each call oneDNN's reorder of
the whole weight, which weighs most at decode's few rows: on a Zen 4 EPYC, 1.1-1.8x at 16-64
rows on SmolLM2's shapes, a few percent from 256. Its results are PyTorch's bfloat16 GEMM's, bit
for bit (the same kernels; tests/unit/test_gemm_choice.py). ``TOKENMILL_PREPACK`` (``0``/``1``)
overrides the measured answer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.linear import pack, packed_linear, packing_available, upcast_linear

log = logging.getLogger("tokenmill")
PROBE_ROWS = (32, 64, 128, 256, 512)
PROBE_SHAPE = (4096, 1024)  # (out, in) features: an 8 MiB bfloat16 weight, a 1B model's MLP row count
WIN = 0.9  # the upcast must take at most this fraction of the bfloat16 GEMM's time to be chosen
PACKED_WIN = 0.95  # the packed weight: at most this fraction of the plain GEMM's time, the mean over the batches
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
    return measured()["upcast_rows"]


def prepacked() -> bool:
    """Whether bfloat16 batches past the small-batch kernel multiply a weight packed once, on this machine."""
    forced = os.environ.get("TOKENMILL_PREPACK")
    if forced:
        return forced not in ("0", "false", "no")
    return bool(measured().get("prepacked")) and packing_available()


def measured() -> dict:
    """This machine's probe answers: from the cache file, else measured now and kept there."""
    path, key = cache_file(), machine_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), dict) and "prepacked" in known[key]:
        return known[key]
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
    return choice


def probe() -> dict:
    """Time ``F.linear`` in bfloat16 against ``upcast_linear`` and against the packed weight at
    PROBE_ROWS; the answers and the timings (ms), which the JSON file keeps beside them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*PROBE_SHAPE, generator=g).bfloat16()
    packed = pack(weight) if packing_available() else None
    timings, packed_ms = {}, {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=g).bfloat16()
        timings[rows] = (
            best_ms(lambda x=x: torch.nn.functional.linear(x, weight)),
            best_ms(lambda x=x: upcast_linear(x, weight).bfloat16()),
        )
        if packed is not None:
            packed_ms[rows] = best_ms(lambda x=x: packed_linear(x, packed))
    chosen = None
    for rows in reversed(PROBE_ROWS):  # the smallest batch from which the upcast wins at every size
        sixteen, upcast = timings[rows]
        if upcast > WIN * sixteen:
            break
        chosen = rows
    # packed where it beats the plain GEMM over the batches the plain one serves (below the upcast),
    # each batch size weighing the same (its gain is at decode's few rows)
    served = [r for r in PROBE_ROWS if chosen is None or r < chosen]
    ratios = [packed_ms[r] / timings[r][0] for r in served if r in packed_ms]
    use_packed = bool(ratios) and sum(ratios) / len(ratios) <= PACKED_WIN
    ms = {str(r): {"bfloat16": round(a, 3), "float32": round(b, 3)} for r, (a, b) in timings.items()}
    for r, t in packed_ms.items():
        ms[str(r)]["packed"] = round(t, 3)
    log.info(
        "tokenmill: bfloat16 GEMM probe (%s): upcast from %s rows, packed weights %s; ms %s",
        machine_key(),
        chosen,
        use_packed,
        ms,
    )
    return {"upcast_rows": chosen, "prepacked": use_packed, "ms": ms, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def best_ms(call) -> float:
    call()  # warm: first-touch of the output, oneDNN's primitive cache
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
