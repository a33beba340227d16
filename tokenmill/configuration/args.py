"""Options from the config dataclasses: CLI flags, ``LLM`` keywords, one mapping.

Each option is a field of a frozen config in ``tokenmill.configuration.config``; its keyword (and
flag, with dashes) is the field's name, or the ``flag`` in its metadata. This module
turns those fields into argparse flags and turns keywords or parsed flags back into
an ``EngineArgs``, so an option is declared once, with its default and help.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.configuration.config import (
    CacheConfig,
    EngineArgs,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredConfig,
)
from tokenmill.configuration.serving_config import ReplicaConfig, ServerConfig
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
_TITLES = {
    "load": "model",
    "cache": "KV cache",
    "scheduler": "scheduling",
    "speculative": "speculative decoding",
    "lora": "LoRA adapters",
    "structured": "structured output",
    "parallel": "parallelism",
}


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
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return ServerConfig(**{**values, **overrides})
    except ValueError as e:
        raise TokenmillError(str(e)) from None


def replica_config_from_namespace(ns: argparse.Namespace) -> ReplicaConfig:
    values = {f.name: getattr(ns, f.name) for f in _fields(ReplicaConfig) if getattr(ns, f.name, None) is not None}
    try:
        return ReplicaConfig(**values)
    except ValueError as e:
        raise TokenmillError(str(e)) from None


def add_engine_arguments(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """``several_models``: ``--model`` may be given once per model (`tokenmill serve`)."""
    for section, cls in ENGINE_SECTIONS.items():
        add_config_arguments(parser.add_argument_group(_TITLES[section]), cls, several_models)


def add_config_arguments(group: Any, cls: type, several_models: bool = False) -> None:
    """One flag per field of ``cls``. Flags default to None ("not given"), so that the
    dataclass's own default applies: defaults live only in the dataclass; a field's
    check (``opt(..., check=...)``) is its flag's type, so a bad value fails at parsing."""
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        kw = keyword(f)
        flag = "--" + kw.replace("_", "-")
        meta: Mapping[str, Any] = f.metadata
        if several_models and cls is LoadConfig and f.name == "model":
            group.add_argument(
                flag,
                dest=kw,
                action="append",
                default=None,
                metavar="[NAME=]PATH[,OPTION=VALUE...]",
                help=meta["help"] + "; several models: NAME=PATH once per model, each its own engine, "
                "with engine options of its own after commas (NAME=PATH,dtype=float32)",
            )
            continue
        base = _base_type(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        shown = f" (default: {default})" if default not in (None, "") and base is not bool else ""
        if base is bool:
            if meta.get("negative"):
                group.add_argument(
                    "--" + meta["negative"], dest=kw, action="store_const", const=False, help=meta["help"]
                )
            else:
                group.add_argument(flag, dest=kw, action="store_const", const=True, help=meta["help"])
            continue
        if typing.get_origin(hints[f.name]) is tuple:  # a list of values: --flag a --flag b, or --flag a b c
            if meta.get("repeat"):
                group.add_argument(flag, dest=kw, action="append", default=None, help=meta["help"])
            else:
                group.add_argument(flag, dest=kw, nargs="+", default=None, help=meta["help"])
            continue
        choices = meta.get("choices")
        if cls is SpeculativeConfig and f.name == "method":
            choices, shown = ("none", *choices), " (default: none)"
        kind = meta.get("check") or base  # a declared check: the flag's value is refused as it is parsed
        group.add_argument(flag, dest=kw, type=kind, choices=choices, default=None, help=meta["help"] + shown)


def _base_type(hint: Any) -> type:
    """int for ``int | None``; str for a union of several types (parsed later)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` of `tokenmill serve`: the name clients send (None: the single-model
    form, named by --served-model-name or the file), its path (None: the default model)
    and the engine options it sets for itself."""

    name: str | None
    path: str | None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def model_specs(values: list[str] | None) -> list[ModelSpec]:
    """``--model`` values: one PATH as ever, or NAME=PATH[,OPTION=VALUE...] once per model."""
    if not values:
        return [ModelSpec(None, None)]
    if len(values) == 1 and not _named(values[0]):
        return [ModelSpec(None, values[0])]
    specs = []
    for value in values:
        if not _named(value):
            raise TokenmillError(f"--model {value!r}: with several models, each is NAME=PATH (PATH may be 'default')")
        name, _, rest = value.partition("=")
        path, *options = rest.split(",")
        specs.append(ModelSpec(name, None if path in ("", "default") else path, _model_options(name, options)))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TokenmillError(f"--model: the name {twice[0]!r} is given twice")
    return specs


def _named(value: str) -> bool:
    name, eq, _ = value.partition("=")
    return bool(eq) and MODEL_NAME.fullmatch(name) is not None


def _model_options(name: str, options: list[str]) -> dict[str, Any]:
    """OPTION=VALUE pairs as engine keywords with typed values."""
    known = engine_keywords()
    out: dict[str, Any] = {}
    for item in options:
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known or key == "model":
            raise TokenmillError(
                f"--model {name}=...: {item!r} is not OPTION=VALUE with an engine option "
                f"(such as dtype=float32, kv_cache_memory=512MiB)"
            )
        section, field_name = known[key]
        hint = typing.get_type_hints(ENGINE_SECTIONS[section])[field_name]
        out[key] = _typed(_base_type(hint), text.strip(), f"--model {name}=...,{key}")
    return out


def _typed(kind: type, text: str, where: str) -> Any:
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise TokenmillError(f"{where}: {text!r} is not true or false")
        return text.lower() in ("true", "1", "yes")
    try:
        return kind(text)
    except ValueError:
        raise TokenmillError(f"{where}: {text!r} is not a {kind.__name__}") from None


def engine_args_for(ns: argparse.Namespace, spec: ModelSpec, kv_cache_memory: Any = None) -> EngineArgs:
    """One served model's EngineArgs: the command line's engine flags, then its own options;
    ``kv_cache_memory``: its share of the KV budget, unless it sets its own."""
    given = {kw: getattr(ns, kw) for kw in engine_keywords() if getattr(ns, kw, None) is not None and kw != "model"}
    if kv_cache_memory is not None:
        given["kv_cache_memory"] = kv_cache_memory
    return engine_args(**{**given, **spec.options, "model": spec.path})


def served_models(ns: argparse.Namespace) -> list[tuple[ModelSpec, EngineArgs]]:
    """Each ``--model``'s EngineArgs. Several models share the KV budget (--kv-cache-memory,
    or its default) equally, but for those that set their own kv_cache_memory."""
    from tokenmill.configuration.memory import parse_memory

    specs = model_specs(ns.model if isinstance(ns.model, list) or ns.model is None else [ns.model])
    if len(specs) == 1:
        return [(specs[0], engine_args_for(ns, specs[0]))]
    sharing = [s for s in specs if "kv_cache_memory" not in s.options]
    share = parse_memory(ns.kv_cache_memory) // max(len(sharing), 1)
    return [(s, engine_args_for(ns, s, share if s in sharing else None)) for s in specs]
