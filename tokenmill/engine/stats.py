"""Per-step statistics, as plain data for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    time: float  # perf_counter at the start of the step
    duration: float
    num_seqs: int
    num_prefill_tokens: int  # prompt (or recomputed) tokens computed this step
    num_decode_tokens: int
    num_preempted: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int  # includes the cached ones, which can be evicted
    kv_blocks_cached: int  # free blocks that still hold reusable prefix content
