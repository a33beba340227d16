"""The process groups one rank talks through, built from a store every rank reaches.

Ranks are stage-major: stage ``s`` holds ranks ``s * tp .. s * tp + tp - 1``, and the
driver (scheduler, sampling, outputs) is rank 0, the first stage's first TP rank.
Three groups, none of them torch.distributed's global default (so that nothing in
the process is global and an engine can be built and closed many times):

- ``control``: gloo over all ranks; the driver broadcasts each step's record
  (ids and counts as plain values, rank_messages.py) on it. Its timeout is long: workers wait on it while a
  server idles.
- ``tp``: the ranks of this rank's stage, for the all-reduces of row-parallel layers
  and the gather of vocabulary-parallel logits (gloo on the CPU, NCCL on GPUs).
- ``world``: all ranks, for point-to-point sends between stages (hidden states
  forward, logits back to the driver).

Every call counts its bytes and the seconds it waited (``CommStats``), which is how
bench/parallel.py splits a step into communication and compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from tokenmill.model.shard_plan import ModelShard

CONTROL_TIMEOUT = timedelta(days=30)  # workers wait here between requests
DATA_TIMEOUT = timedelta(minutes=10)  # one layer's or one stage's compute at most


@dataclass
class CommStats:
    """Bytes this rank sent or contributed, and seconds it spent in collectives."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds.clear()
        self.calls.clear()


def _backend(store: Store, prefix: str, rank: int, size: int, device: torch.device, timeout: timedelta) -> Any:
    store = PrefixStore(prefix, store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        return ProcessGroupNCCL(store, rank, size, ProcessGroupNCCL.Options())
    return ProcessGroupGloo(store, rank, size, timeout)


class StageGroup:
    """The tensor-parallel ranks of one pipeline stage (``TensorParallelGroup``)."""

    def __init__(self, pg: Any, rank: int, size: int, stats: CommStats) -> None:
        self.pg, self.rank, self.size, self.stats = pg, rank, size, stats

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self.stats.add("all_reduce", x.numel() * x.element_size(), time.perf_counter() - t0)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """Each rank's [rows, cols] -> on the stage's first rank, [rows, width] (the ranks'
        columns side by side, cut to ``width``); None on the others."""
        x = x.contiguous()
        t0 = time.perf_counter()
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.pg.gather(out, x, 0).wait()
        self.stats.add("gather", x.numel() * x.element_size(), time.perf_counter() - t0)
        return torch.cat(out, dim=-1)[..., :width] if self.rank == 0 else None


class ControlChannel:
    """The driver's broadcasts to every worker (gloo; each an encoded rank message)."""

    def __init__(self, store: Store, rank: int, world_size: int, stats: CommStats) -> None:
        self.rank, self.world_size, self.stats = rank, world_size, stats
        self.pg = _backend(store, "control", rank, world_size, torch.device("cpu"), CONTROL_TIMEOUT)

    def broadcast(self, message: bytes) -> None:
        """Driver: send one message to every worker."""
        payload = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        t0 = time.perf_counter()
        self.pg.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), 0).wait()
        self.pg.broadcast(payload, 0).wait()
        self.stats.add("control", payload.numel() + 8, time.perf_counter() - t0)

    def receive(self) -> bytes:
        """Worker: the driver's next message (blocks until it comes)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(payload, 0).wait()
        return payload.numpy().tobytes()


class ParallelGroups:
    """One rank's data groups (built collectively: every rank constructs its own at once)."""

    def __init__(self, store: Store, shard: ModelShard, device: torch.device, stats: CommStats) -> None:
        self.shard = shard
        self.rank = shard.rank
        self.world_size = shard.tp_size * shard.pp_size
        self.stats = stats
        self.world = _backend(store, "world", self.rank, self.world_size, device, DATA_TIMEOUT)
        tp_pg = _backend(store, f"tp{shard.pp_rank}", shard.tp_rank, shard.tp_size, device, DATA_TIMEOUT)
        self.tp = StageGroup(tp_pg, shard.tp_rank, shard.tp_size, stats)

    def send(self, x: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending (returns the work; keep ``x`` alive until it is waited on)."""
        self.stats.add("send", x.numel() * x.element_size(), 0.0)
        return self.world.send([x], dst, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.world.recv([x], src, tag).wait()
        self.stats.add("recv", x.numel() * x.element_size(), time.perf_counter() - t0)
        return x

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.shard.tp_size + tp_rank
