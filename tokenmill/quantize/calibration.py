"""Calibration samples: consecutive windows of a text's tokens.

The bundled text (``data/calibration.txt``) is public domain: the United States Declaration
of Independence, the Constitution's preamble and first three articles, the Bill of Rights
and the Gettysburg Address. It is deliberately not the held-out text the perplexity tests
read (tests/data/heldout.txt), so a quantised model is never scored on what it was
calibrated on.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Protocol

from tokenmill.errors import TokenmillError

BUNDLED = "data/calibration.txt"


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def calibration_text(path: str | Path | None) -> str:
    """The user's text file, or the bundled one."""
    if path is None:
        return files("tokenmill.quantize").joinpath(BUNDLED).read_text(encoding="utf-8")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenmillError(f"cannot read calibration text {path}: {e}") from None
    if not text.strip():
        raise TokenmillError(f"calibration text {path} is empty")
    return text


def calibration_samples(tokenizer: Encoder, text: str, samples: int, seq_len: int) -> list[list[int]]:
    """Up to ``samples`` windows of ``seq_len`` consecutive tokens (no overlap, in order);
    as many whole windows as the text holds, at least one (shorter, if the text is)."""
    if samples < 1 or seq_len < 2:
        raise TokenmillError(f"need samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise TokenmillError("the calibration text has fewer than 2 tokens")
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:samples]
    return windows or [ids[:seq_len]]
