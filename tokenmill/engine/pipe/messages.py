"""The messages between the API process and the engine-core process, one type each.

Every field is typed to the last value it holds: sampling parameters as ``SamplingParams``,
gauges as ``EngineSnapshot``, a step's output as ``WireDelta``s, errors as ``WireError``, what the
core tells of itself as ``CoreInfo``. On the pipe a message is a msgpack list, its tag first and
then its fields in order, each dataclass in it a list of its own fields (``encode`` / ``decode``,
by wire.py's typed codec, which rebuilds each value by its declared type): only strings,
numbers, bytes, lists and maps cross, never a pickled object, so a message means the same on
both sides whatever either has imported, and decoding one cannot run code. msgpack stayed by measurement (bench/wire_formats.py,
bench/RESULTS.md). ``WIRE_VERSION`` changes with any message's fields, the engine snapshot's
or the sampling parameters'; the test that round-trips every message pins them. The core's
first message (``Ready``) says its version, and the API process refuses another
(``check_ready``): both sides must come from one installation.

    API -> core   Add, Abort, Stop (the API found a stop string), the calls (``CALLS``: one
                  message each, run between steps: AddLora, RemoveLora, StartKvEvents,
                  StepTrace, MeasureLoadPrice, BlockStates, LoraHashRoots, ExportKv,
                  ImportKv), Shutdown
    core -> API   Ready | Failed (once, at start); Accepted | Rejected; Out (one per step);
                  Reply (to a call, its result of the call's RESULT type); Stats (after
                  commands that changed the gauges);
                  Dead (the loop failed: nothing more follows)

Every core -> API message after Ready but Dead carries a ``Report``: the engine's snapshot
(gauges) and, once recording is on, the prefix cache's changes (``kv_events``: a replica's
router follows them) and the steps traced (``steps``: the live view draws them), each since
the previous message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from tokenmill.engine.pipe.wire import WireDelta, WireError, from_plain, to_plain
from tokenmill.engine.stats import EngineSnapshot, StepRecord
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

WIRE_VERSION = 5


@dataclass
class Report:
    """What rides with every core -> API message: the gauges now, and what was recorded since
    the previous message."""

    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    kv_events: list[tuple[str, bytes]] = field(default_factory=list)  # ("stored" | "removed", block hash)
    steps: list[StepRecord] = field(default_factory=list)


@dataclass
class CoreInfo:
    """What the API process should know of the core it started."""

    max_model_len: int
    num_blocks: int
    block_size: int
    model_path: str


@dataclass
class Add:
    """A request: sampling ``params``, or ``pooling`` for an embedding (one of the two)."""

    TAG: ClassVar[str] = "add"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | None
    pooling: PoolingParams | None
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


# Calls: what the API process asks of the core between steps, one message each, answered by a
# ``Reply`` of the same ``call_id`` whose result the asker reads by the call's ``RESULT`` type.


@dataclass
class AddLora:
    """Serve an adapter under a new name (read and checked off the step loop)."""

    TAG: ClassVar[str] = "add_lora"
    RESULT: ClassVar[Any] = None
    call_id: int
    name: str
    path: str


@dataclass
class RemoveLora:
    TAG: ClassVar[str] = "remove_lora"
    RESULT: ClassVar[Any] = None
    call_id: int
    name: str


@dataclass
class StartKvEvents:
    """Record the prefix cache's changes from now on (each Report carries them: a replica's router)."""

    TAG: ClassVar[str] = "start_kv_events"
    RESULT: ClassVar[Any] = None
    call_id: int


@dataclass
class StepTrace:
    """Trace each step's batch (Reports carry them: the live view), or stop."""

    TAG: ClassVar[str] = "step_trace"
    RESULT: ClassVar[Any] = None
    call_id: int
    on: bool


@dataclass
class MeasureLoadPrice:
    """Measure what a token of load costs against a cached one (an idle core; a replica starting):
    the fields of ``engine/core/load_price.LoadPrice``."""

    TAG: ClassVar[str] = "measure_load_price"
    RESULT: ClassVar[Any] = dict[str, float]
    call_id: int


@dataclass
class BlockStates:
    """A byte per KV block (free, cached, used, shared, just hit): the live view's map."""

    TAG: ClassVar[str] = "block_states"
    RESULT: ClassVar[Any] = bytes
    call_id: int


@dataclass
class LoraHashRoots:
    """Each served adapter's block-hash root (None: the base model's), for a router hashing prompts."""

    TAG: ClassVar[str] = "lora_hash_roots"
    RESULT: ClassVar[Any] = dict[str, bytes | None]
    call_id: int


@dataclass
class ExportKv:
    """The cached blocks of the leading ``hashes`` the pool holds: (how many, their raw bytes or None)."""

    TAG: ClassVar[str] = "export_kv"
    RESULT: ClassVar[Any] = tuple[int, bytes | None]
    call_id: int
    hashes: list[bytes]


@dataclass
class ImportKv:
    """Blocks another engine exported, cached here under ``hashes``: how many were taken."""

    TAG: ClassVar[str] = "import_kv"
    RESULT: ClassVar[Any] = int
    call_id: int
    hashes: list[bytes]
    data: bytes


CALLS: tuple[type, ...] = (
    AddLora,
    RemoveLora,
    StartKvEvents,
    StepTrace,
    MeasureLoadPrice,
    BlockStates,
    LoraHashRoots,
    ExportKv,
    ImportKv,
)


@dataclass
class Shutdown:
    TAG: ClassVar[str] = "shutdown"


@dataclass
class Ready:
    TAG: ClassVar[str] = "ready"
    wire_version: int  # WIRE_VERSION of the core's side
    info: CoreInfo
    report: Report


@dataclass
class Failed:
    TAG: ClassVar[str] = "failed"
    message: str
    error: WireError


@dataclass
class Accepted:
    TAG: ClassVar[str] = "accepted"
    request_id: str
    report: Report


@dataclass
class Rejected:
    TAG: ClassVar[str] = "rejected"
    request_id: str
    error: WireError
    report: Report


@dataclass
class Out:
    TAG: ClassVar[str] = "out"
    deltas: list[WireDelta]  # one per sequence that moved
    report: Report


@dataclass
class Reply:
    """How a call went: ``result`` is what the call's ``RESULT`` type says (read by it: ``result_of``)."""

    TAG: ClassVar[str] = "reply"
    call_id: int
    error: WireError | None
    result: Any
    report: Report


@dataclass
class Stats:
    TAG: ClassVar[str] = "stats"
    report: Report


@dataclass
class Dead:
    TAG: ClassVar[str] = "dead"
    message: str


TO_CORE: tuple[type, ...] = (Add, Abort, Stop, *CALLS, Shutdown)
TO_API: tuple[type, ...] = (Ready, Failed, Accepted, Rejected, Out, Reply, Stats, Dead)
_BY_TAG = {cls.TAG: cls for cls in TO_CORE + TO_API}


def encode(msg: Any) -> list[Any]:
    """A message as its wire list: the tag, then the fields in order, as plain values."""
    return [msg.TAG, *to_plain(msg)]


def decode(wire: list[Any]) -> Any:
    """The message a wire list holds, every field rebuilt by its type; ValueError for an
    unknown tag or a wrong field count, InvalidRequestError for a value its type's own checks
    refuse (naming the field)."""
    cls = _BY_TAG.get(wire[0]) if wire else None
    if cls is None:
        raise ValueError(f"unknown engine-core message {wire[:1]!r}")
    if len(wire) - 1 != len(fields(cls)):
        raise ValueError(f"engine-core message {wire[0]!r} has {len(wire) - 1} fields, not {len(fields(cls))}")
    try:
        return from_plain(cls, list(wire[1:]))
    except InvalidRequestError:  # a value its own checks refuse (SamplingParams'): the request's fault
        raise
    except (TypeError, ValueError) as e:
        raise ValueError(f"engine-core message {wire[0]!r}: {e}") from e


def result_of(call: type, result: Any) -> Any:
    """A ``Reply``'s result read by the type its call declares."""
    return None if call.RESULT is None else from_plain(call.RESULT, result)


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
