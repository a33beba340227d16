"""Checked flag values: argparse types that refuse a bad value where the flag is declared.

A flag declared with one of these (``type=POSITIVE_INT`` by hand, or a config field's
``opt(..., check=PORT)``, which ``tokenmill.configuration.args`` makes the generated flag's type) fails
while the command line is parsed: one line, ``tokenmill serve: error: argument --port:
must be in [1, 65535], got 99999``, and exit 2 (argparse's, as ``cli.Parser`` words it),
before anything loads or starts. Unchecked, a bad number reached the run and surfaced as a
ZeroDivisionError, an OverflowError from the socket, or a tune that priced tokens in
negative dollars. The same check serves a config dataclass built from keywords
(``check_fields`` in its ``__post_init__``), so each bound is written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BadValue(ValueError, argparse.ArgumentTypeError):
    """A value outside what its flag or field takes. argparse reports an ArgumentTypeError
    as the flag's own error line; a config's ``__post_init__`` raises ValueErrors."""


@dataclass(frozen=True)
class Number:
    """An int, or a finite float, within a range; ``open_low`` / ``open_high``: that end
    excluded (``> 0`` rather than ``>= 0``)."""

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __call__(self, value: str | int | float) -> int | float:
        number = value
        if isinstance(value, str):
            try:
                number = self.kind(value)
            except ValueError:
                raise BadValue(f"{value!r} is not {'a whole number' if self.kind is int else 'a number'}") from None
        if self.kind is int and (not isinstance(number, int) or isinstance(number, bool)):
            raise BadValue(f"{value!r} is not a whole number")
        if not math.isfinite(number):
            raise BadValue(f"must be a finite number, got {value}")
        if not self._within(number):
            raise BadValue(f"must be {self.range}, got {value}")
        return number

    def _within(self, x: float) -> bool:
        low_ok = self.low is None or (x > self.low if self.open_low else x >= self.low)
        high_ok = self.high is None or (x < self.high if self.open_high else x <= self.high)
        return low_ok and high_ok

    @property
    def range(self) -> str:
        """'>= 1', '> 0', 'in [1, 65535]', 'in [0, 1)'."""
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.open_high else '<='} {self.high:g}"
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


POSITIVE_INT = Number(int, 1)  # counts of things that must exist: tokens, prompts, requests
NON_NEGATIVE_INT = Number(int, 0)  # counts where 0 means none
POSITIVE_FLOAT = Number(float, 0, open_low=True)  # seconds, rates, watts, bandwidth
NON_NEGATIVE_FLOAT = Number(float, 0)  # prices, reservations
PORT = Number(int, 1, 65535)  # the server prints and binds the port it is given: no ephemeral 0
PROBABILITY = Number(float, 0, 1)  # a share or a threshold, both ends allowed


def existing_file(value: str) -> str:
    """A file the command will read: it must be there, be a file and be readable."""
    path = Path(value)
    if not path.exists():
        raise BadValue(f"no such file: {value}")
    if not path.is_file():
        raise BadValue(f"not a file: {value}")
    if not os.access(path, os.R_OK):
        raise BadValue(f"cannot read {value}")
    return value


@dataclass(frozen=True)
class NameOrFile:
    """One of some names (a built-in workload) or else a file to read."""

    names: tuple[str, ...]

    def __call__(self, value: str) -> str:
        if value in self.names:
            return value
        try:
            return existing_file(value)
        except BadValue as e:
            raise BadValue(f"{', '.join(self.names)} or a file; {e}") from None


def text_or_file(value: str) -> str:
    """Text as given, or ``@FILE``: the file's text, read now so that a missing file is
    this flag's error rather than one from the middle of the run."""
    if not value.startswith("@"):
        return value
    try:
        return Path(existing_file(value[1:])).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BadValue(f"cannot read {value[1:]}: {e}") from None


@dataclass(frozen=True)
class NumberList:
    """Comma-separated numbers, each checked by ``each`` (``inf`` too where allowed). The
    text is kept as given: its command splits it again."""

    each: Number
    allow_inf: bool = False

    def __call__(self, value: str) -> str:
        for part in (p.strip() for p in value.split(",")):
            if self.allow_inf and part == "inf":
                continue
            try:
                self.each(part)
            except BadValue as e:
                raise BadValue(f"{part!r} of {value!r}: {e}") from None
        return value


def check_fields(config: Any) -> None:
    """Run each field's declared check (``opt(..., check=...)``) on its value; the first
    that fails is a ValueError naming the field. None (unset) passes."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        value = getattr(config, f.name)
        if check is not None and value is not None:
            try:
                check(value)
            except BadValue as e:
                raise ValueError(f"{f.name} {e}") from None
