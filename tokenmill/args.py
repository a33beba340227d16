"""Options from the config dataclasses: CLI flags, ``LLM`` keywords, one mapping.

Each option is a field of a frozen config in ``tokenmill.config``; its keyword (and
flag, with dashes) is the field's name, or the ``flag`` in its metadata. This module
turns those fields into argparse flags and turns keywords or parsed flags back into
an ``EngineArgs``, so an option is declared once, with its default and help.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from tokenmill.config import (
    CacheConfig,
    EngineArgs,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    StructuredConfig,
)
from tokenmill.errors import TokenmillError

ENGINE_SECTIONS: dict[str, type] = {
    "load": LoadConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "lora": LoRAConfig,
    "structured": StructuredConfig,
    "parallel": ParallelConfig,
}
_TITLES = {"load": "model", "cache": "KV cache", "scheduler": "scheduling", "speculative": "speculative decoding",
           "lora": "LoRA adapters", "structured": "structured output", "parallel": "parallelism"}  # fmt: skip


def keyword(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f.name


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def engine_keywords() -> dict[str, tuple[str, str]]:
    """keyword -> (section, field name), for every engine option."""
    return {keyword(f): (section, f.name) for section, cls in ENGINE_SECTIONS.items() for f in _fields(cls)}


def engine_args(**kwargs: Any) -> EngineArgs:
    """EngineArgs from ``LLM``-style keywords (``max_num_seqs=32, speculative="ngram"``).
    Speculative options are ignored unless ``speculative`` names a method."""
    known = engine_keywords()
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    sections: dict[str, dict[str, Any]] = {s: {} for s in ENGINE_SECTIONS}
    for kw, value in kwargs.items():
        section, name = known[kw]
        sections[section][name] = value
    try:
        spec = sections.pop("speculative")
        built = {s: ENGINE_SECTIONS[s](**v) for s, v in sections.items()}
        method = spec.get("method")
        speculative = None if method in (None, "none") else SpeculativeConfig(**spec)
    except ValueError as e:
        raise TokenmillError(str(e)) from None
    return EngineArgs(speculative=speculative, **built)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from flags added by ``add_engine_arguments`` (unset ones keep their defaults)."""
    return engine_args(**{kw: getattr(ns, kw) for kw in engine_keywords() if getattr(ns, kw, None) is not None})


def server_config_from_namespace(ns: argparse.Namespace, **overrides: Any) -> ServerConfig:
    values = {f.name: getattr(ns, f.name) for f in _fields(ServerConfig) if getattr(ns, f.name, None) is not None}
    return ServerConfig(**{**values, **overrides})


def replica_config_from_namespace(ns: argparse.Namespace) -> ReplicaConfig:
    values = {f.name: getattr(ns, f.name) for f in _fields(ReplicaConfig) if getattr(ns, f.name, None) is not None}
    try:
        return ReplicaConfig(**values)
    except ValueError as e:
        raise TokenmillError(str(e)) from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for section, cls in ENGINE_SECTIONS.items():
        add_config_arguments(parser.add_argument_group(_TITLES[section]), cls)


def add_config_arguments(group: Any, cls: type) -> None:
    """One flag per field of ``cls``. Flags default to None ("not given"), so that the
    dataclass's own default applies: defaults live only in the dataclass."""
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        kw = keyword(f)
        flag = "--" + kw.replace("_", "-")
        meta: Mapping[str, Any] = f.metadata
        base = _base_type(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        shown = f" (default: {default})" if default not in (None, "") and base is not bool else ""
        if base is bool:
            if meta.get("negative"):
                group.add_argument("--" + meta["negative"], dest=kw, action="store_const", const=False, help=meta["help"])
            else:
                group.add_argument(flag, dest=kw, action="store_const", const=True, help=meta["help"])
            continue
        if typing.get_origin(hints[f.name]) is tuple:  # a list of values: --flag a b c
            group.add_argument(flag, dest=kw, nargs="+", default=None, help=meta["help"])
            continue
        choices = meta.get("choices")
        if cls is SpeculativeConfig and f.name == "method":
            choices, shown = ("none", *choices), " (default: none)"
        group.add_argument(flag, dest=kw, type=base, choices=choices, default=None, help=meta["help"] + shown)


def _base_type(hint: Any) -> type:
    """int for ``int | None``; str for a union of several types (parsed later)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint
