"""The scheduler's own time per step under a long queue, no model (issue 57's token shares
and aging are per-step work): 64 running decodes, 1,000 waiting 20-token prompts.

    .venv/bin/python bench/scheduler_cost.py
"""

from __future__ import annotations

import time

from tokenmill.configuration.config import SchedulerConfig
from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.model_input import ModelOutput, SampledToken
from tokenmill.sampling_params import SamplingParams

BLOCK = 16


def scheduler(policy: str) -> Scheduler:
    kv = KVCacheManager(BlockPool(20_000, enable_caching=True), BLOCK)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, scheduling_policy=policy)
    s = Scheduler(config, kv, 4000, frozenset(), None)
    for i in range(64 + 1000):
        s.add(Request(f"r{i}", [(7 * i + j) % 50 for j in range(20)], SamplingParams(max_tokens=10**6, temperature=0)))
    return s


def step(s: Scheduler) -> None:
    """Schedule, then 'sample' token 1 for every sequence that reached its end."""
    out = s.schedule()
    sampled = {
        x.request.request_id: [SampledToken(1)]
        for x in out.seqs
        if x.request.num_computed_tokens + x.num_new_tokens == x.request.num_tokens
    }
    s.update_from_output(out, ModelOutput(sampled=sampled, draft_token_ids={}))


if __name__ == "__main__":
    for policy in ("fcfs", "priority"):
        s = scheduler(policy)
        for _ in range(5):
            step(s)
        start = time.perf_counter()
        for _ in range(200):
            s._shares()
        shares = (time.perf_counter() - start) / 200
        start = time.perf_counter()
        for _ in range(50):
            step(s)
        whole = (time.perf_counter() - start) / 50
        print(f"{policy}: token shares {shares * 1e6:.0f} us; schedule + update {whole * 1e6:.0f} us a step")
