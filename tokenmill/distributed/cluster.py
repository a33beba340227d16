"""The driver's side of a split model: its worker processes and what it tells them.

On one machine the driver starts ranks 1..N-1 itself (``python -m
tokenmill.distributed.rank_process``, a fresh interpreter each: nothing of the caller's
process is forked) and hosts the store they meet at. Under ``torchrun`` every rank
was started by torchrun and the store is its rendezvous; rank 0 is the driver.

The conversation, every message a broadcast from the driver (``rank_messages.py``):
``Load`` (the engine's options and dtype: every rank loads its shard), ``Setup``
(the KV pool's size), then one ``Step`` per engine step (or ``Forward`` for a
scoring pass), and ``Shutdown``.

A worker that raises stores its traceback in the store and exits; one that is
killed simply disappears. Either way the driver's next collective fails at once (the
peer's sockets close), and ``failure`` turns that into an ``EngineDeadError`` naming
the rank and why, after stopping every other worker. A worker whose parent dies exits
too, however the parent died (``host/lifetime.py``), so no process is left behind.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import Store, TCPStore

from tokenmill.distributed.env import torchrun_rank, under_torchrun
from tokenmill.distributed.groups import CommStats, ControlChannel, ParallelGroups
from tokenmill.distributed.rank_messages import RankMessage, Shutdown, encode
from tokenmill.engine.pipe.wire import from_plain, pack, to_plain, unpack
from tokenmill.errors import EngineDeadError, TokenmillError
from tokenmill.model.shard_plan import ModelShard

logger = logging.getLogger(__name__)
STORE_TIMEOUT = timedelta(minutes=5)
START_TIMEOUT = 300.0  # seconds for every worker to start and say hello


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker started by the driver needs to find the others."""

    host: str
    port: int
    rank: int
    world_size: int
    local_world_size: int
    parent_pid: int  # the driver's: the worker ends when it does (host/lifetime.py)

    def write(self) -> bytes:
        """As plain values (msgpack), for the worker's stdin."""
        return pack(to_plain(self))

    @classmethod
    def read(cls, data: bytes) -> WorkerSpec:
        """``write``'s inverse; a ValueError for anything else (an empty stdin: the driver died)."""
        try:
            return from_plain(cls, unpack(data))
        except Exception as e:
            raise ValueError(f"not a worker spec ({e})") from e


def threads_per_rank(local_world_size: int) -> int:
    """This machine's cores shared among its ranks (each rank's intra-op threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_world_size)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A GPU per rank on its machine; the CPU is shared."""
    return torch.device("cuda", local_rank) if device.type == "cuda" and device.index is None else device


class Cluster:
    def __init__(self, store: Store, world_size: int, procs: list[subprocess.Popen], local_world_size: int) -> None:
        self.store = store
        self.world_size = world_size
        self.procs = procs  # ranks 1.. when the driver started them; empty under torchrun
        self.local_world_size = local_world_size
        self.stats = CommStats()
        self.control: ControlChannel | None = None
        self.closed = False
        self._threads_before: int | None = None  # the driver process's intra-op threads, given back at shutdown

    @classmethod
    def launch(cls, world_size: int) -> Cluster:
        """Start (or, under torchrun, join) the other ranks; returns once the store is up."""
        if under_torchrun():
            import torch.distributed as dist

            if torchrun_rank() != 0:
                raise TokenmillError(
                    "under torchrun only rank 0 builds the engine; the other ranks run "
                    "tokenmill.distributed.rank_process.run_torchrun_worker() (the CLI does this itself)"
                )
            store, rank, world = next(dist.rendezvous("env://"))
            if world != world_size:
                raise TokenmillError(
                    f"torchrun started {world} processes but tensor_parallel_size x "
                    f"pipeline_parallel_size = {world_size}"
                )
            return cls(store, world_size, [], int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        store = TCPStore("127.0.0.1", 0, world_size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        procs = []
        try:
            for rank in range(1, world_size):
                spec = WorkerSpec("127.0.0.1", store.port, rank, world_size, world_size, os.getpid())
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tokenmill.distributed.rank_process"], stdin=subprocess.PIPE
                )
                assert proc.stdin is not None
                proc.stdin.write(spec.write())
                proc.stdin.close()
                procs.append(proc)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        return cls(store, world_size, procs, world_size)

    def share_cores(self, threads: int) -> None:
        """Run the driver on its share of the cores while the workers live (the caller's
        setting comes back at shutdown: the process is not left changed)."""
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)

    def connect(self) -> ControlChannel:
        """Wait for every worker to come up, then open the control channel."""
        deadline = time.monotonic() + START_TIMEOUT
        waiting = set(range(1, self.world_size))
        while waiting:
            waiting = {r for r in waiting if not self.store.check([f"hello/{r}"])}
            dead = self._dead_workers()
            if dead or time.monotonic() > deadline:
                raise self.failure(None, "while starting")
            time.sleep(0.02)
        self.control = ControlChannel(self.store, 0, self.world_size, self.stats)
        return self.control

    def groups(self, shard: ModelShard, device: torch.device) -> ParallelGroups:
        return ParallelGroups(self.store, shard, device, self.stats)

    def broadcast(self, message: RankMessage) -> None:
        assert self.control is not None
        if self.closed:
            raise EngineDeadError("the model's worker processes have been shut down")
        try:
            self.control.broadcast(encode(message))
        except Exception as e:
            raise self.failure(e) from e

    def failure(self, cause: BaseException | None, when: str = "") -> EngineDeadError:
        """What went wrong, as the error that ends the engine; stops every worker."""
        time.sleep(0.2)  # a worker that raised stores its traceback before it exits
        reasons = []
        for rank in range(1, self.world_size):
            key = f"error/{rank}"
            try:
                if self.store.check([key]):
                    last = self.store.get(key).decode().strip().splitlines()[-1]
                    reasons.append(f"worker rank {rank} failed: {last}")
            except Exception:
                pass
        for rank, code in self._dead_workers():
            if not any(f"rank {rank} " in r for r in reasons):
                reasons.append(f"worker rank {rank} exited with code {code}")
        if not reasons:
            reasons.append(
                f"{type(cause).__name__}: {cause}" if cause is not None else "a worker did not start in time"
            )
        message = "; ".join(reasons) + (f" ({when})" if when else "")
        logger.error("tensor/pipeline-parallel engine stopped: %s", message)
        self.shutdown(timeout=1.0)
        return EngineDeadError(message)

    def _dead_workers(self) -> list[tuple[int, int]]:
        return [(rank, p.returncode) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the workers to stop, wait for them, kill what is left."""
        if self.closed:
            return
        self.closed = True
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        if self.control is not None and not self._dead_workers():
            try:
                self.control.broadcast(encode(Shutdown()))
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
