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
    kv_tokens_held: int  # tokens of running requests in the cache (shared ones counted per request)
    kv_slots_held: int  # slots of the blocks in running requests' tables (likewise)

    @property
    def kv_waste(self) -> float:
        """Share of running requests' slots that hold no token (the partial last blocks)."""
        return 1 - self.kv_tokens_held / self.kv_slots_held if self.kv_slots_held else 0.0
