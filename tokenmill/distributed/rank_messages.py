"""What the driver broadcasts to its workers: ids, counts and options, no tensors.

Every message crosses as plain values (engine/pipe/wire.py's typed codec, msgpack), never
pickled: a worker started by torchrun on another machine may run another install, so each
message carries ``RANK_WIRE_VERSION`` and a worker that speaks another refuses it by name;
and decoding one cannot run code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.configuration.config import EngineArgs
from tokenmill.engine.model_input import ModelInput
from tokenmill.engine.pipe.wire import from_plain, pack, to_plain, unpack
from tokenmill.errors import TokenmillError
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput
from tokenmill.worker.model_runner import Committed

# The messages below, field by field: a change to any of them (or to what they hold) is a new
# version. tests/unit/test_rank_messages.py pins them.
RANK_WIRE_VERSION = 1


class RankWireError(TokenmillError):
    """A message from a driver that speaks another version, or not a rank message at all."""


@dataclass
class Load:
    """Load your shard: the driver's options (every rank runs what the driver runs)."""

    args: EngineArgs
    dtype: str  # the torch dtype's name: "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise RankWireError(f"Load names no torch dtype: {self.dtype!r}")
        return dtype


@dataclass
class Setup:
    """The KV pool the driver's scheduler manages: every rank holds this many blocks."""

    num_blocks: int


@dataclass
class Step:
    """One engine step (``batch``, its grammar masks left on the driver), after the
    results of the step before, which only the driver sampled."""

    batch: ModelInput
    committed: Committed


@dataclass
class ScoredSeq:
    """A sequence of a scoring forward as it crosses: ids and counts (a ``SeqInput`` that
    samples nothing and carries no tensors)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]

    @classmethod
    def of(cls, seq: SeqInput) -> ScoredSeq:
        plain = (
            seq.positions is None
            and seq.tree_mask is None
            and seq.pooling is None
            and not seq.spec_token_ids
            and seq.num_evicted_tokens == 0
            and seq.position_offset == 0
        )
        if not plain:
            raise ValueError(f"sequence {seq.request_id!r}: a split model scores plain sequences only")
        return cls(seq.request_id, list(seq.token_ids), seq.num_computed_tokens, list(seq.block_table))

    def seq_input(self) -> SeqInput:
        return SeqInput(
            self.request_id, self.token_ids, self.num_computed_tokens, self.block_table, False, SamplingParams(), [], []
        )


@dataclass
class Forward:
    """Logits at every position of these sequences (scoring; no request state changes)."""

    seqs: list[ScoredSeq]


@dataclass
class Shutdown:
    pass


RankMessage = Load | Setup | Step | Forward | Shutdown
MESSAGES: tuple[type, ...] = (Load, Setup, Step, Forward, Shutdown)


def encode(message: RankMessage) -> bytes:
    """[version, the message's kind, its fields as plain values], msgpack."""
    if type(message) not in MESSAGES:
        raise TypeError(f"{type(message).__name__} is no rank message")
    return pack([RANK_WIRE_VERSION, MESSAGES.index(type(message)), to_plain(message)])


def decode(data: bytes) -> RankMessage:
    """``encode``'s inverse; another version, or what is no rank message, a RankWireError."""
    try:
        items = unpack(data)
    except Exception as e:
        raise RankWireError(f"not a rank message ({e})") from e
    if not isinstance(items, list) or len(items) != 3 or not isinstance(items[1], int):
        raise RankWireError(f"not a rank message: {items!r:.80}")
    version, kind, plain = items
    if version != RANK_WIRE_VERSION:
        raise RankWireError(
            f"the driver speaks rank wire version {version!r} and this worker {RANK_WIRE_VERSION}: "
            "run the same tokenmill on every rank"
        )
    if not 0 <= kind < len(MESSAGES):
        raise RankWireError(f"unknown rank message kind {kind}")
    return from_plain(MESSAGES[kind], plain)
