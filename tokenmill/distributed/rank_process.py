"""A worker rank of a split model: load a shard, then follow the driver step by step.

Started by the driver on one machine (``python -m tokenmill.distributed.rank_process``, its
``WorkerSpec`` on stdin, as plain values), or by torchrun on any machine (``tokenmill serve``
on a rank other than 0 ends up in ``run_torchrun_worker``). It holds no scheduler, no
tokenizer and no sampler: a ``ModelRunner`` whose forward is its ``PipelineStage``,
kept in step with the driver's by the records it receives.

A failure is written to the store (the driver names it in its error) and ends the
process with status 1; a worker whose parent process dies exits at once (host/lifetime.py).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
from torch.distributed import Store, TCPStore

from tokenmill.distributed.cluster import STORE_TIMEOUT, WorkerSpec, rank_device, threads_per_rank
from tokenmill.distributed.groups import CommStats, ControlChannel, ParallelGroups
from tokenmill.distributed.rank_messages import Forward, Load, Setup, Shutdown, Step, decode
from tokenmill.distributed.stage import parallel_stage
from tokenmill.host.lifetime import exit_with_parent
from tokenmill.model.loader import load_checkpoint
from tokenmill.model.shard_plan import ModelShard
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.model_setup import LoadPlan, load_shard, resolve_device


def serve_rank(store: Store, rank: int, world_size: int, local_rank: int, local_world_size: int) -> int:
    """Run one worker rank until the driver says stop; the exit status."""
    try:
        store.set(f"hello/{rank}", "1")
        control = ControlChannel(store, rank, world_size, CommStats())
        load = decode(control.receive())
        if isinstance(load, Shutdown):
            return 0
        assert isinstance(load, Load), f"expected Load, got {type(load).__name__}"
        runner = _build(load, store, control, rank, local_rank, local_world_size)
        while True:
            msg = decode(control.receive())
            if isinstance(msg, Step):
                runner.follow(msg.batch, msg.committed)
            elif isinstance(msg, Forward):
                runner.all_logits([s.seq_input() for s in msg.seqs])
            elif isinstance(msg, Shutdown):
                return 0
            else:
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
    except Exception:
        text = traceback.format_exc()
        print(f"tokenmill worker rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        try:
            store.set(f"error/{rank}", text)
        except Exception:
            pass
        return 1


def _build(
    load: Load, store: Store, control: ControlChannel, rank: int, local_rank: int, local_world_size: int
) -> ModelRunner:
    args, parallel = load.args, load.args.parallel
    device = rank_device(resolve_device(args.load.device), local_rank)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(local_world_size))
    shard = ModelShard.of_rank(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    plan = LoadPlan.decide(args.load, device, parallel.world_size)  # (several ranks: blocks never kept)
    ckpt = load_checkpoint(args.load.model, load.torch_dtype, progress=False, **plan.checkpoint_options())
    config = ckpt.config
    model = load_shard(config, ckpt.weights, shard, args.load, device, plan)
    del ckpt
    setup = decode(control.receive())
    assert isinstance(setup, Setup), f"expected Setup, got {type(setup).__name__}"
    cache = args.cache
    kv_caches = allocate_kv_cache(
        shard.local_config(config), setup.num_blocks, cache.block_size, load.torch_dtype, device, cache.kv_cache_dtype
    )
    groups = ParallelGroups(store, shard, device, control.stats)
    stage = parallel_stage(groups, model, kv_caches, cache.block_size, device, config)
    return ModelRunner(model, kv_caches, cache.block_size, device, stage=stage)


def run_torchrun_worker() -> int:
    """A rank other than 0 under torchrun: the store is torchrun's rendezvous."""
    import torch.distributed as dist

    store, rank, world_size = next(dist.rendezvous("env://"))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return serve_rank(store, rank, world_size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def main() -> int:
    try:
        spec = WorkerSpec.read(sys.stdin.buffer.read())
    except ValueError:  # the driver died before it said who we are
        return 1
    exit_with_parent(spec.parent_pid)  # the driver's pid as it recorded it: it may be gone already
    store = TCPStore(spec.host, spec.port, spec.world_size, False, timeout=STORE_TIMEOUT)
    return serve_rank(store, spec.rank, spec.world_size, spec.rank, spec.local_world_size)


if __name__ == "__main__":
    sys.exit(main())
