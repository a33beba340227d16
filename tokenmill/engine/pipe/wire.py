"""What crosses the pipe between the API process and the engine-core process, as plain
values: sampling parameters, deltas, snapshots and errors to and from lists and maps,
and msgpack itself (``pack`` / ``unpack``). The messages are engine/pipe/messages.py's.

Only plain values cross (strings, numbers, lists, maps): never a pickled object, so
a message means the same on both sides whatever either has imported, and decoding
one cannot run code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenmill.engine.model_input import SampledToken
from tokenmill.engine.outputs import SeqDelta
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError, UnknownModelError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.constraint import StructuredOutputs


def pack(msg: list[Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ------------------------------------------------------------------- requests


def params_to_wire(p: SamplingParams | PoolingParams) -> dict[str, Any]:
    """A request's parameters as a map of their fields (an embedding request's: ``pooling_type`` alone)."""
    d = dataclasses.asdict(p)
    if isinstance(p, PoolingParams):
        return d  # the structured spec becomes a map of its fields
    if d["structured"] is not None:
        d["structured"] = {k: v for k, v in d["structured"].items() if v not in (None, False)}
    return d


def params_from_wire(d: dict[str, Any]) -> SamplingParams | PoolingParams:
    """Validated again on the way in (an unknown field is an error, never dropped)."""
    try:
        if "pooling_type" in d:
            return PoolingParams(**d)
        if isinstance(d.get("structured"), dict):  # every field of the spec (a client's dict takes fewer)
            d = {**d, "structured": StructuredOutputs(**d["structured"])}
        return SamplingParams(**d)
    except TypeError as e:
        raise InvalidRequestError(f"bad sampling parameters: {e}") from e


# -------------------------------------------------------------------- outputs


def delta_to_wire(d: SeqDelta) -> list[Any]:
    toks = d.new_tokens
    logprobs = [t.logprob for t in toks] if toks and toks[0].logprob is not None else None
    tops = [t.top_logprobs for t in toks] if logprobs is not None else None
    return [
        d.seq_id,
        [t.token_id for t in toks],
        logprobs,
        tops,
        d.finish_reason,
        d.stop_reason,
        d.error,
        d.first_scheduled,
        d.num_cached_tokens,
        d.prompt_logprobs,
        d.embedding,
    ]


def delta_from_wire(w: list[Any]) -> SeqDelta:
    seq_id, ids, logprobs, tops, finish_reason, stop_reason, error, first_scheduled, num_cached, prompt_lps, emb = w
    if logprobs is None:
        toks = [SampledToken(t) for t in ids]
    else:
        toks = [SampledToken(t, lp, [(a, b) for a, b in top]) for t, lp, top in zip(ids, logprobs, tops, strict=True)]
    if prompt_lps is not None:
        prompt_lps = [(lp, rank, [(a, b) for a, b in top]) for lp, rank, top in prompt_lps]
    return SeqDelta(seq_id, toks, finish_reason, stop_reason, error, first_scheduled, num_cached, prompt_lps, emb)


def snapshot_to_wire(s: EngineSnapshot) -> dict[str, Any]:
    return dataclasses.asdict(s)


def snapshot_from_wire(d: dict[str, Any]) -> EngineSnapshot:
    return EngineSnapshot(**d)


# --------------------------------------------------------------------- errors


def error_to_wire(e: BaseException) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "param": getattr(e, "param", None),
        "user": isinstance(e, TokenmillError),
    }


def error_from_wire(d: dict[str, Any]) -> Exception:
    """The core's error as the API process raises it: a request's fault stays an
    InvalidRequestError (a 400 naming its parameter), another user-facing error (a bad
    adapter: LoRAError) a TokenmillError with the core's message, anything else a
    RuntimeError."""
    if d["type"] == "InvalidRequestError":
        return InvalidRequestError(d["message"], param=d.get("param"))
    if d["type"] == "UnknownModelError":
        return UnknownModelError(d["message"], param=d.get("param"))
    if d["type"] == "EngineDeadError":
        return EngineDeadError(d["message"])
    if d.get("user"):
        return TokenmillError(d["message"])
    return RuntimeError(f"{d['type']}: {d['message']}")
