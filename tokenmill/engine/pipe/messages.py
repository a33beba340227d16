"""The messages between the API process and the engine-core process, one type each.

On the pipe a message is a msgpack list, its tag first and then its fields in order
(``encode`` / ``decode``; wire.py packs them and turns requests, deltas, snapshots and
errors into plain values): only strings, numbers, lists and maps cross, never a pickled
object, so a message means the same on both sides whatever either has imported, and
decoding one cannot run code. msgpack stayed by measurement (bench/wire_formats.py,
bench/RESULTS.md). ``WIRE_VERSION`` changes with any message's fields, the engine snapshot's
or the sampling parameters'; the test that round-trips every message pins them. The core's
first message (``Ready``) says its version, and the API process refuses another
(``check_ready``): both sides must come from one installation.

    API -> core   Add, Abort, Stop (the API found a stop string), Call (a method of the
                  core run between steps, by name: CoreLoop's table), Shutdown
    core -> API   Ready | Failed (once, at start); Accepted | Rejected; Out (one per step);
                  Reply (to a Call); Stats (after commands that changed the gauges);
                  Dead (the loop failed: nothing more follows)

Every core -> API message after Ready but Dead carries the engine's snapshot (gauges),
which may hold, once recording is on, "kv_events" (prefix-cache changes) and "steps"
(each step's batch, for the live view), each since the previous message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

WIRE_VERSION = 2


@dataclass
class Add:
    TAG: ClassVar[str] = "add"
    request_id: str
    prompt_ids: list[int]
    params: dict[str, Any]  # wire.params_to_wire
    lora: str | None


@dataclass
class Abort:
    TAG: ClassVar[str] = "abort"
    request_id: str


@dataclass
class Stop:
    TAG: ClassVar[str] = "stop"
    seq_id: str
    stop_string: str


@dataclass
class Call:
    TAG: ClassVar[str] = "call"
    call_id: int
    method: str
    args: list[Any]


@dataclass
class Shutdown:
    TAG: ClassVar[str] = "shutdown"


@dataclass
class Ready:
    TAG: ClassVar[str] = "ready"
    wire_version: int  # WIRE_VERSION of the core's side
    info: dict[str, Any]  # what the API process should know of the core (max_model_len, model_path, ...)
    snapshot: dict[str, Any]


@dataclass
class Failed:
    TAG: ClassVar[str] = "failed"
    message: str
    error: dict[str, Any]  # wire.error_to_wire


@dataclass
class Accepted:
    TAG: ClassVar[str] = "accepted"
    request_id: str
    snapshot: dict[str, Any]


@dataclass
class Rejected:
    TAG: ClassVar[str] = "rejected"
    request_id: str
    error: dict[str, Any]
    snapshot: dict[str, Any]


@dataclass
class Out:
    TAG: ClassVar[str] = "out"
    deltas: list[list[Any]]  # wire.delta_to_wire, one per sequence that moved
    snapshot: dict[str, Any]


@dataclass
class Reply:
    TAG: ClassVar[str] = "reply"
    call_id: int
    error: dict[str, Any] | None
    result: Any
    snapshot: dict[str, Any]


@dataclass
class Stats:
    TAG: ClassVar[str] = "stats"
    snapshot: dict[str, Any]


@dataclass
class Dead:
    TAG: ClassVar[str] = "dead"
    message: str


TO_CORE: tuple[type, ...] = (Add, Abort, Stop, Call, Shutdown)
TO_API: tuple[type, ...] = (Ready, Failed, Accepted, Rejected, Out, Reply, Stats, Dead)
_BY_TAG = {cls.TAG: cls for cls in TO_CORE + TO_API}


def encode(msg: Any) -> list[Any]:
    """A message as its wire list: the tag, then the fields in order."""
    return [msg.TAG, *(getattr(msg, f.name) for f in fields(msg))]


def decode(wire: list[Any]) -> Any:
    """The message a wire list holds; ValueError for an unknown tag or a wrong field count."""
    cls = _BY_TAG.get(wire[0]) if wire else None
    if cls is None:
        raise ValueError(f"unknown engine-core message {wire[:1]!r}")
    if len(wire) - 1 != len(fields(cls)):
        raise ValueError(f"engine-core message {wire[0]!r} has {len(wire) - 1} fields, not {len(fields(cls))}")
    return cls(*wire[1:])


def check_ready(wire: list[Any]) -> Ready | Failed:
    """The core's first message, decoded: a ``Ready`` of this side's ``WIRE_VERSION`` (or a
    ``Failed``); anything else a clear error naming both versions."""
    version = wire[1] if len(wire) > 1 and wire[0] == Ready.TAG and isinstance(wire[1], int) else None
    if wire and wire[0] == Ready.TAG and version != WIRE_VERSION:
        raise ValueError(
            f"the engine-core process speaks wire version {version if version is not None else 'unknown (< 2)'}, "
            f"this API process {WIRE_VERSION}: both must come from one tokenmill installation"
        )
    msg = decode(wire)
    if not isinstance(msg, Ready | Failed):
        raise ValueError(f"the engine core's first message must be ready or failed, not {wire[0]!r}")
    return msg
