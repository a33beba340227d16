"""The replicas' KV index: what each replica's prefix cache holds, and its load.

Every replica reports to one index (a Ray actor in ``ray_serve.py``; a plain object
here, so it is tested without Ray): its KV events (block hashes stored and evicted),
its running and waiting requests, the price it measured for a request in flight
(engine/core/load_price.py), its engine snapshot. The router asks the index to
choose a replica for a prompt's block hashes; the server's /metrics reads the
snapshots (one series per replica) and the routing counters from it. One owner for
what the replicas hold: the index; for how busy each is right now, the router's own
count of requests in flight wins over a report that may be a step old.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.engine.stats import EngineSnapshot
from tokenmill.replicas.replica_router import ROUTERS, KVAwareRouter, ReplicaState


@dataclass
class RoutingStats:
    """Counters of the router's work, for /metrics."""

    decisions: Counter = field(default_factory=Counter)  # by reason ("prefix", "least_loaded", ...)
    routed: Counter = field(default_factory=Counter)  # requests sent, by replica
    predicted_hit_blocks: int = 0  # leading blocks the router expected cached where it sent requests
    realised_hit_tokens: int = 0  # prompt tokens those replicas found cached (reported at the end)
    prompt_tokens: int = 0  # prompt tokens of the routed requests that finished
    imported_blocks: int = 0  # disaggregated decode: KV blocks received from prefill replicas and cached
    import_seconds: float = 0.0  # from asking the object store for them to having them in the cache
    # kv routing: replica -> (its price of a request in flight, in prompt tokens; "measured" on the
    # replica, "fixed" by --route-load-cost, or the router's "default" for a replica that reported none)
    load_costs: dict[str, tuple[float, str]] = field(default_factory=dict)


class KVIndex:
    """``load_cost``: kv routing's price of a request in flight, fixed for every replica
    (None: each replica's measured one, as it reports it)."""

    def __init__(
        self, routing: str = "kv", block_size: int = 16, seed: int | None = None, load_cost: int | None = None
    ) -> None:
        if routing not in ROUTERS:
            raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTERS)}")
        if routing == "kv":
            self.policy = ROUTERS[routing](block_size=block_size, load_cost=load_cost)
        else:
            self.policy = ROUTERS[routing](seed=seed) if routing == "pow2" else ROUTERS[routing]()
        self.routing, self.block_size = routing, block_size
        self.replicas: dict[str, ReplicaState] = {}
        self.snapshots: dict[str, EngineSnapshot] = {}
        self.sent_since_report: Counter[str] = Counter()  # requests routed to a replica after its last report
        self.stats = RoutingStats()

    def report(
        self,
        replica: str,
        events: Sequence[tuple[str, bytes]],
        num_running: int,
        num_waiting: int,
        snapshot: EngineSnapshot | None = None,
        finished: Sequence[tuple[int, int]] = (),
        reset: bool = False,
        imported: tuple[int, float] = (0, 0.0),
        load_cost: float | None = None,
    ) -> None:
        """A replica's news: its KV events in order, its load, and for each request that
        ended (prompt tokens, prompt tokens it found cached). ``reset``: a replica that
        (re)started with an empty cache. ``imported``: KV blocks received from prefill
        replicas since the last report, and the seconds that took. ``load_cost``: its
        price of a request in flight, in prompt tokens (None: unchanged)."""
        state = self.replicas.get(replica)
        if state is None or reset:
            state = self.replicas[replica] = ReplicaState(replica)
        state.apply(events)
        state.num_running, state.num_waiting = num_running, num_waiting
        if load_cost is not None:
            state.load_cost = load_cost
        if isinstance(self.policy, KVAwareRouter):
            fixed, measured = self.policy.load_cost, state.load_cost
            source = "fixed" if fixed is not None else "measured" if measured is not None else "default"
            self.stats.load_costs[replica] = (self.policy.price(state), source)
        self.sent_since_report.pop(replica, None)
        if snapshot is not None:
            self.snapshots[replica] = snapshot
        self.stats.imported_blocks += imported[0]
        self.stats.import_seconds += imported[1]
        for prompt_tokens, cached_tokens in finished:
            self.stats.prompt_tokens += prompt_tokens
            self.stats.realised_hit_tokens += cached_tokens

    def remove(self, replica: str) -> None:
        """A replica died or was stopped: nothing is routed to what it held."""
        self.replicas.pop(replica, None)
        self.snapshots.pop(replica, None)
        self.sent_since_report.pop(replica, None)
        self.stats.load_costs.pop(replica, None)

    def choose(self, hashes: Sequence[bytes], candidates: Sequence[tuple[str, int | None]]) -> str:
        """The replica for a prompt, among ``candidates`` (name, requests in flight there
        as the caller counts them, None where it does not know). A replica's load is the
        larger of that count and its last report plus the requests sent it since: a
        burst of requests between two reports is spread, not sent to one replica."""
        states = []
        for name, in_flight in candidates:
            known = self.replicas.get(name) or ReplicaState(name)
            load = max(in_flight or 0, known.load + self.sent_since_report[name])
            # the cached set is shared, not copied
            states.append(ReplicaState(name, known.cached, num_running=load, load_cost=known.load_cost))
        choice = self.policy.choose(hashes, states)
        self.sent_since_report[choice.replica] += 1
        self.stats.decisions[choice.reason] += 1
        self.stats.routed[choice.replica] += 1
        self.stats.predicted_hit_blocks += choice.matched_blocks
        return choice.replica

    def view(self) -> tuple[dict[str, EngineSnapshot], RoutingStats]:
        """The snapshots of live replicas and the routing counters (for /metrics)."""
        return dict(self.snapshots), self.stats


def merge_snapshots(snaps: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The replicas as one engine: counts summed, KV usage averaged, adapters united."""
    total = EngineSnapshot()
    for s in snaps:
        total = EngineSnapshot(
            num_running=total.num_running + s.num_running,
            num_waiting=total.num_waiting + s.num_waiting,
            kv_usage=total.kv_usage + s.kv_usage / len(snaps),
            num_preemptions=total.num_preemptions + s.num_preemptions,
            num_step_retries=total.num_step_retries + s.num_step_retries,
            prefix_cache_queries=total.prefix_cache_queries + s.prefix_cache_queries,
            prefix_cache_hits=total.prefix_cache_hits + s.prefix_cache_hits,
            kv_disk_bytes=total.kv_disk_bytes + s.kv_disk_bytes,  # replicas sharing a directory: each its count
            kv_disk_hits=total.kv_disk_hits + s.kv_disk_hits,
            kv_disk_stored=total.kv_disk_stored + s.kv_disk_stored,
            kv_disk_evicted=total.kv_disk_evicted + s.kv_disk_evicted,
            kv_host_bytes=total.kv_host_bytes + s.kv_host_bytes,
            kv_host_hits=total.kv_host_hits + s.kv_host_hits,
            kv_host_stored=total.kv_host_stored + s.kv_host_stored,
            kv_host_evicted=total.kv_host_evicted + s.kv_host_evicted,
            kv_evicted_tokens=total.kv_evicted_tokens + s.kv_evicted_tokens,
            spec_num_drafts=total.spec_num_drafts + s.spec_num_drafts,
            spec_num_draft_tokens=total.spec_num_draft_tokens + s.spec_num_draft_tokens,
            spec_num_accepted_tokens=total.spec_num_accepted_tokens + s.spec_num_accepted_tokens,
            iteration_tokens=[
                a + b for a, b in itertools.zip_longest(total.iteration_tokens, s.iteration_tokens, fillvalue=0)
            ],
            iteration_tokens_sum=total.iteration_tokens_sum + s.iteration_tokens_sum,
            max_loras=s.max_loras,
            loras={**total.loras, **s.loras},
            lora_requests=dict(Counter(total.lora_requests) + Counter(s.lora_requests)),
            running_loras=sorted(set(total.running_loras) | set(s.running_loras)),
            waiting_loras=sorted(set(total.waiting_loras) | set(s.waiting_loras)),
        )
    return total
