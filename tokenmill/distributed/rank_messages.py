"""What the driver broadcasts to its workers: ids, counts and options, no tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.configuration.config import EngineArgs
from tokenmill.engine.model_input import ModelInput
from tokenmill.worker.inputs import SeqInput
from tokenmill.worker.model_runner import Committed


@dataclass
class Load:
    """Load your shard: the driver's options (every rank runs what the driver runs)."""

    args: EngineArgs
    dtype: torch.dtype


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
class Forward:
    """Logits at every position of these sequences (scoring; no request state changes)."""

    seqs: list[SeqInput]


@dataclass
class Shutdown:
    pass
