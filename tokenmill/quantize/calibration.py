"""Calibration samples: windows of consecutive tokens, spread over unlike texts.

GPTQ and AWQ fit each layer to the inputs they are shown, so a narrow calibration text
gives a model fitted to that text: calibrated on our bundled prose alone, SmolLM2's GPTQ
int4 lost to plain rounding on Python documentation and on the held-out license text
(bench/RESULTS.md, issue 44). The default therefore mixes two unlike sources:

- the bundled text (``data/calibration.txt``, public domain: the United States Declaration
  of Independence, the Constitution's preamble and first three articles, the Bill of
  Rights and the Gettysburg Address): English prose;
- the plain-text documentation of some fifty Python standard-library modules, rendered at
  run time by ``pydoc`` in a fresh interpreter of this Python: technical prose, signatures
  and examples, with nothing downloaded and nothing more in the package (under ``python
  -OO`` the docstrings are gone and the bundled text is used alone).

Samples are shared evenly between the sources, and each source's windows are spread over
the whole text rather than taken from its first pages. A user's file replaces both.
Neither source is the held-out text the perplexity tests and the bench read
(tests/data/heldout.txt), so a quantised model is never scored on what it was calibrated on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import Protocol

from tokenmill.errors import TokenmillError
from tokenmill.quantize.stdlib_pages import SEPARATOR

BUNDLED = "data/calibration.txt"
STDLIB_MODULES = (
    "collections", "itertools", "functools", "pathlib", "json", "re", "argparse", "logging", "subprocess",
    "threading", "asyncio", "datetime", "decimal", "fractions", "statistics", "random", "heapq", "bisect",
    "textwrap", "string", "shutil", "tempfile", "zipfile", "tarfile", "csv", "sqlite3", "unittest", "doctest",
    "inspect", "dataclasses", "typing", "contextlib", "abc", "enum", "io", "os", "socket", "http.client",
    "urllib.parse", "email.message", "hashlib", "hmac", "secrets", "base64", "struct", "array", "queue", "sched",
)  # fmt: skip
SECTION_START = re.compile(r"(?m)^(?=[A-Z][A-Z ]*$)")  # pydoc's section headings: NAME, CLASSES, DATA...
LIVE_SECTIONS = ("DATA", "FILE")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
MIN_DOCS_CHARS = 100_000  # less than this and the docstrings were stripped (python -OO)
RENDER_TIMEOUT_S = 300


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bundled_text() -> str:
    return files("tokenmill.quantize").joinpath(BUNDLED).read_text(encoding="utf-8")


def stdlib_docs() -> str:
    """pydoc's plain-text pages of STDLIB_MODULES as a fresh interpreter of this Python
    renders them (``stdlib_pages.py``, run isolated: not this process's imports and
    patches), less what is live rather than written: the DATA and FILE sections
    (``os.environ``'s contents, ``tempfile.tempdir``, install paths) and memory addresses
    (``<object at 0x...>`` defaults), so that the text, and the quantisation, are the same
    on every call, whatever ran before it."""
    script = files("tokenmill.quantize").joinpath("stdlib_pages.py").read_text(encoding="utf-8")  # a zip too
    flags = ["-OO"] if sys.flags.optimize >= 2 else []  # docstrings stripped here: stripped there
    cmd = [sys.executable, "-I", *flags, "-X", "utf8", "-c", script, str(os.getpid()), *STDLIB_MODULES]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", timeout=RENDER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TokenmillError(f"could not render the standard library's docs for calibration: {e}") from None
    if done.returncode != 0:
        raise TokenmillError(f"rendering the standard library's docs for calibration failed: {done.stderr[-2000:]}")
    pages = []
    for page in done.stdout.split(SEPARATOR)[:-1]:
        sections = SECTION_START.split(page)
        pages.append(ADDRESS.sub("", "".join(p for p in sections if not p.startswith(LIVE_SECTIONS))))
    return "\n\n".join(pages)


def calibration_texts(path: str | Path | None) -> list[str]:
    """The user's text file, or the default sources (the bundled text and the standard
    library's documentation)."""
    if path is None:
        docs = stdlib_docs()
        return [bundled_text(), docs] if len(docs) >= MIN_DOCS_CHARS else [bundled_text()]
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenmillError(f"cannot read calibration text {path}: {e}") from None
    if not text.strip():
        raise TokenmillError(f"calibration text {path} is empty")
    return [text]


def calibration_samples(tokenizer: Encoder, texts: list[str], samples: int, seq_len: int) -> list[list[int]]:
    """``samples`` windows of ``seq_len`` consecutive tokens, shared evenly between ``texts``
    so that each source weighs the same; a text's windows have evenly spaced starts over all
    of it, overlapping where the text holds fewer whole windows than its share (the bundled
    prose does: the same words at other offsets). A text shorter than one window gives
    itself once and leaves the rest of its share to the others; no text that long: the
    longest, once."""
    if samples < 1 or seq_len < 2:
        raise TokenmillError(f"need samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if sum(map(len, ids)) < 2:
        raise TokenmillError("the calibration text has fewer than 2 tokens")
    long = [t for t in ids if len(t) >= seq_len]
    short = [t for t in ids if len(t) < seq_len]
    if not long:
        return [max(ids, key=len)]
    windows = [t for t in short if len(t) >= 2][: max(samples - len(long), 0)]
    left = samples - len(windows)
    for i, t in enumerate(long):
        k = left // len(long) + (i < left % len(long))
        span = len(t) - seq_len
        starts = sorted({round(j * span / max(k - 1, 1)) for j in range(k)}) if k else []
        windows += [t[s : s + seq_len] for s in starts]
    return windows
