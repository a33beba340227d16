"""What crosses the pipe between the API process and the engine-core process, as plain
values: the typed codec (``to_plain`` / ``from_plain``: every dataclass a message holds, by its
declared fields and types), the shapes made for the crossing (``WireDelta``: a step's tokens by
column; ``WireError``: an exception), and msgpack itself (``pack`` / ``unpack``). The messages
are engine/pipe/messages.py's.

Only plain values cross (strings, numbers, bytes, lists, maps): never a pickled object, so
a message means the same on both sides whatever either has imported, and decoding
one cannot run code.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from tokenmill.engine.model_input import SampledToken
from tokenmill.engine.outputs import SeqDelta
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError, UnknownModelError

# --------------------------------------------------------------- the typed codec


def to_plain(value: Any) -> Any:
    """A message's contents as plain values: a dataclass as the list of its fields in
    declaration order (so both sides must agree on them: WIRE_VERSION), written by their
    declared types; maps, lists and tuples as msgpack carries them; strings, numbers, bytes
    and None as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _writer(type(value))(value)
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(tp: Any, value: Any) -> Any:
    """``to_plain``'s inverse, read by the declared type ``tp``: dataclasses rebuilt field by
    field (their own checks run again: a value that fails them is an error, never dropped),
    tuples made tuples again. A list of the wrong length for its dataclass is a ValueError.
    ``value`` is consumed: a dataclass's list is rebuilt in place."""
    return _reader(tp)(value)


def _as_is(v: Any) -> Any:
    return v


def _members(tp: Any) -> list[Any] | None:
    """A union's members but None (None: ``tp`` is no union)."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return None


@functools.cache
def _writer(tp: Any) -> Callable[[Any], Any]:
    """How to write a value of declared type ``tp`` (built once per type; identity wherever
    msgpack carries the value as it is, which is everywhere but dataclasses and what holds them)."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        writers = [_writer(hints[n]) for n in names]
        special = [(i, w) for i, w in enumerate(writers) if w is not _as_is]
        if not names:
            return lambda v: []
        get = operator.attrgetter(*names)
        if len(names) == 1:
            only = writers[0]
            return lambda v: [only(get(v))]

        def write_dataclass(v: Any) -> list[Any]:
            out = list(get(v))
            for i, w in special:
                out[i] = w(out[i])
            return out

        return write_dataclass
    members = _members(tp)
    if members is not None:
        if len(members) == 1:
            inner = _writer(members[0])
            return _as_is if inner is _as_is else lambda v: None if v is None else inner(v)
        return to_plain if any(_writer(a) is not _as_is for a in members) else _as_is
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple) and args:
        inner = _writer(args[0]) if len(args) == 1 or args[1] is Ellipsis else to_plain
        return _as_is if inner is _as_is else lambda v: [inner(x) for x in v]
    if origin is dict and args:
        inner = _writer(args[1])
        return _as_is if inner is _as_is else lambda v: {k: inner(x) for k, x in v.items()}
    if tp is Any or tp is object:
        return to_plain  # declared loosely (a Call's arguments): written by what it holds
    return _as_is


@functools.cache
def _reader(tp: Any) -> Callable[[Any], Any]:
    """How to read a plain value of declared type ``tp`` (built once per type)."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        special = [(i, r) for i, n in enumerate(names) if (r := _reader(hints[n])) is not _as_is]
        count = len(names)

        def read_dataclass(v: Any) -> Any:
            if not isinstance(v, list) or len(v) != count:
                raise ValueError(f"{tp.__name__} takes {count} fields ({', '.join(names)}), not {v!r:.80}")
            for i, r in special:  # in place: the plain value is the reader's (msgpack's fresh lists)
                v[i] = r(v[i])
            return tp(*v)

        return read_dataclass
    members = _members(tp)
    if members is not None:
        if len(members) == 1:
            inner = _reader(members[0])
            return _as_is if inner is _as_is else lambda v: None if v is None else inner(v)
        if any(_reader(a) is not _as_is for a in members):
            raise TypeError(f"{tp} cannot cross the pipe: a union of containers is ambiguous")
        return _as_is  # str | int, ...: plain values already
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        inner = _reader(args[0])
        return _as_is if inner is _as_is else lambda v: [inner(x) for x in v]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _reader(args[0])
            return tuple if inner is _as_is else lambda v: tuple(inner(x) for x in v)
        each = [_reader(a) for a in args]
        return lambda v: tuple(r(x) for r, x in zip(each, v, strict=True))
    if origin is dict:
        inner = _reader(args[1])
        return _as_is if inner is _as_is else lambda v: {k: inner(x) for k, x in v.items()}
    return _as_is  # int, float, str, bytes, bool, Any, a TypedDict (plain data already)


def pack(msg: list[Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# -------------------------------------------------------------------- outputs


@dataclass(slots=True)
class WireDelta:
    """A ``SeqDelta`` as it crosses: its new tokens by column (ids, logprobs, top-k), so a
    step's deltas are a few flat lists; the rest field for field."""

    seq_id: str
    token_ids: list[int]
    logprobs: list[float | None] | None  # None: the request asked for none
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    error: str | None
    first_scheduled: float | None
    num_cached_tokens: int
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None
    embedding: list[float] | None


def delta_to_wire(d: SeqDelta) -> WireDelta:
    toks = d.new_tokens
    logprobs = [t.logprob for t in toks] if toks and toks[0].logprob is not None else None
    return WireDelta(  # positional (a step writes one per sequence): the fields in their order above
        d.seq_id,
        [t.token_id for t in toks],
        logprobs,
        [t.top_logprobs for t in toks] if logprobs is not None else None,
        d.finish_reason,
        d.stop_reason,
        d.error,
        d.first_scheduled,
        d.num_cached_tokens,
        d.prompt_logprobs,
        d.embedding,
    )


def delta_from_wire(w: WireDelta) -> SeqDelta:
    if w.logprobs is None or w.top_logprobs is None:
        toks = [SampledToken(t) for t in w.token_ids]
    else:
        toks = [SampledToken(t, lp, top) for t, lp, top in zip(w.token_ids, w.logprobs, w.top_logprobs, strict=True)]
    return SeqDelta(
        w.seq_id,
        toks,
        w.finish_reason,
        w.stop_reason,
        w.error,
        w.first_scheduled,
        w.num_cached_tokens,
        w.prompt_logprobs,
        w.embedding,
    )


# --------------------------------------------------------------------- errors


@dataclass
class WireError:
    """An exception as it crosses: its class's name, message, the request field at fault, and
    whether it is a user-facing ``TokenmillError`` (its message shown as it is)."""

    type: str
    message: str
    param: str | None
    user: bool


def error_to_wire(e: BaseException) -> WireError:
    return WireError(type(e).__name__, str(e), getattr(e, "param", None), isinstance(e, TokenmillError))


def error_from_wire(w: WireError) -> Exception:
    """The core's error as the API process raises it: a request's fault stays an
    InvalidRequestError (a 400 naming its parameter), another user-facing error (a bad
    adapter: LoRAError) a TokenmillError with the core's message, anything else a
    RuntimeError."""
    if w.type == "InvalidRequestError":
        return InvalidRequestError(w.message, param=w.param)
    if w.type == "UnknownModelError":
        return UnknownModelError(w.message, param=w.param)
    if w.type == "EngineDeadError":
        return EngineDeadError(w.message)
    if w.user:
        return TokenmillError(w.message)
    return RuntimeError(f"{w.type}: {w.message}")
