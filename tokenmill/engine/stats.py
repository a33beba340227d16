"""Per-step statistics, as plain data for metrics and benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, TypedDict


@dataclass(frozen=True, slots=True)  # 100,000 are kept: ~150 bytes each, not ~500 with a __dict__
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


@dataclass
class SpecDecodeStats:
    """Speculative decoding totals: how much of what was drafted the target kept."""

    num_drafts: int = 0  # verification steps (one per speculating sequence per step)
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: accepted drafts plus the target's one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and counters at one moment, as plain data: what a server's
    /metrics, /v1/models and admission control read, whether the core runs in its
    thread or in a process of its own (it travels with every message of the core's)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_step_retries: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # the prefix cache's disk tier (kv_disk.DiskTierStats; zeros without one): bytes on disk, blocks
    # read back, written, and removed past its size
    kv_disk_bytes: int = 0
    kv_disk_hits: int = 0
    kv_disk_stored: int = 0
    kv_disk_evicted: int = 0
    # the host-memory tier (kv_host.HostTierStats; zeros without one): bytes held, blocks read
    # back, copied in, and evicted for newer ones
    kv_host_bytes: int = 0
    kv_host_hits: int = 0
    kv_host_stored: int = 0
    kv_host_evicted: int = 0
    kv_evicted_tokens: int = 0  # tokens whose K/V requests evicted (``KVEviction``), since start
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # tokens per engine step, counted per bucket of ITERATION_TOKEN_BUCKETS (the last: above them all), and summed
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    max_loras: int | None = None  # None: LoRA adapters are off
    loras: dict[str, str] = field(default_factory=dict)  # served adapters: name -> path
    lora_requests: dict[str, int] = field(default_factory=dict)  # requests per adapter since start
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)


def percentiles(xs: list[float]) -> dict:
    """Mean, p50, p90 and p99 of latencies (linear interpolation between ranks; None for
    none): the figures the serving benchmark reports and the live view shows."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


class SeqRecord(NamedTuple):
    """One sequence's part of a step."""

    request_id: str
    kind: str  # "prefill" (prompt or recomputed tokens), "decode", "verify" (drafts checked)
    tokens: int  # tokens it gained: computed, less the drafts rejected
    drafts: int
    accepted: int
    cached: int  # prompt tokens the prefix cache gave it (its first chunk only)
    lora: str | None
    finish_reason: str | None


class StepRecord(TypedDict):
    """One engine step as the live view draws it (engine/core/step_trace.py records it)."""

    step: int
    time: float  # time.perf_counter() at the step's start
    duration: float
    seqs: list[SeqRecord]
    preempted: list[str]
    ended: list[list[str | None]]  # [request id, finish reason]: ended outside the batch
    running: int
    waiting: int
    blocks_used: int
    blocks_cached: int
