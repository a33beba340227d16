"""Which engine replica serves a request: KV-aware routing, and the baselines.

Each replica reports what its prefix cache holds as events (``BlockPool.take_events``:
a block hash stored, a block hash evicted) and its load (requests running and
waiting). A request's prompt is hashed into the same chain of block hashes the
engine computes (``prompt_block_hashes``), so the router knows exactly, not by
guess, how many of its leading blocks each replica holds.

``KVAwareRouter`` starts from vllm-router's and sglang's ``cache_aware`` policy (a
prefix must cover ``min_match`` of the prompt's blocks to count; load out of balance,
the busiest replica with ``balance_abs`` more requests than the idlest and
``balance_rel`` times as many, sends to the least loaded) and, as llm-d does, scores
the prefix and the load together: a replica's cost is the prompt tokens it would
compute plus a price per request already there. Their rule alone (the longest prefix
wins until 64 requests of imbalance) put every chat of a benchmark on one replica of
two, the other idle, at 8 concurrent sessions (bench/RESULTS.md). The price is each
replica's own, measured on its engine when it starts (engine/core/load_price.py: what a
request in flight adds to a newcomer's decode steps, in prompt tokens) and reported
with its load; ``DEFAULT_LOAD_COST`` stands in for a replica that reported none, and a
fixed price (``--route-load-cost``) overrides them all. ``PowerOfTwoRouter`` (Ray
Serve's default) and ``RoundRobinRouter`` are the baselines it is measured against.
No Ray here: the policies are plain objects, tested from given events and loads.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.engine.core.kv_manager import hash_block

DEFAULT_LOAD_COST = 128  # tokens per request in flight, where a replica has not reported its measured price


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, root: bytes | None = None) -> list[bytes]:
    """The hashes of the prompt's full blocks, chained as the engine's prefix cache
    chains them (``root``: an adapter's, whose blocks are shared only among its requests)."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(
            hash_block(hashes[-1] if hashes else root, list(token_ids[i * block_size : (i + 1) * block_size]))
        )
    return hashes


@dataclass
class ReplicaState:
    """What the router knows of one replica: its cached block hashes, its load, and the
    price in prompt tokens it measured for a request in flight (None: not reported)."""

    name: str
    cached: set[bytes] = field(default_factory=set)
    num_running: int = 0
    num_waiting: int = 0
    load_cost: float | None = None

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    def apply(self, events: Sequence[tuple[str, bytes]]) -> None:
        """The replica's prefix-cache events, in the order they happened."""
        for kind, block_hash in events:
            if kind == "stored":
                self.cached.add(block_hash)
            elif kind == "removed":
                self.cached.discard(block_hash)
            else:
                raise ValueError(f"unknown KV event {kind!r}")

    def matched(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the prompt this replica holds (a chain: the first miss ends it)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Choice:
    replica: str
    matched_blocks: int  # the prefix-cache hit the router expects there
    reason: (
        str  # "prefix", "least_loaded", "balance" (load out of balance overrode the prefix), "random", "round_robin"
    )


class KVAwareRouter:
    """Cache hits weighed against load. Each replica's cost for a prompt is the tokens
    it would have to compute (the prompt past its cached run) plus its price per
    request already there (``price``); the cheapest wins. Below ``min_match`` of the
    prompt cached anywhere, or with load out of balance, the least loaded wins; between
    equally loaded replicas, the one holding fewer blocks, so that distinct prefixes
    (system prompts) spread over the replicas instead of piling onto the first.
    ``load_cost``: one price for every replica (None: each replica's reported one)."""

    def __init__(
        self,
        min_match: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        block_size: int = 16,
        load_cost: int | None = None,
    ) -> None:
        self.min_match, self.balance_abs, self.balance_rel = min_match, balance_abs, balance_rel
        self.block_size, self.load_cost = block_size, load_cost
        self.decisions: Counter[str] = Counter()

    def price(self, replica: ReplicaState) -> float:
        """Prompt tokens one request in flight on ``replica`` costs a newcomer: the fixed
        ``load_cost``, else what the replica measured, else ``DEFAULT_LOAD_COST``."""
        if self.load_cost is not None:
            return self.load_cost
        return DEFAULT_LOAD_COST if replica.load_cost is None else replica.load_cost

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> Choice:
        if not replicas:
            raise ValueError("no replica to route to")
        least = min(replicas, key=lambda r: (r.load, len(r.cached), r.name))
        busiest = max(r.load for r in replicas)
        matches = {r.name: r.matched(hashes) for r in replicas}
        top = max(matches.values())
        if busiest - least.load > self.balance_abs and busiest > self.balance_rel * least.load:
            choice = Choice(least.name, matches[least.name], "balance")
        elif hashes and top >= self.min_match * len(hashes):

            def cost(r: ReplicaState) -> tuple:
                return (
                    (len(hashes) - matches[r.name]) * self.block_size + self.price(r) * r.load,
                    -matches[r.name],
                    len(r.cached),
                    r.name,
                )

            pick = min(replicas, key=cost)
            choice = Choice(pick.name, matches[pick.name], "prefix" if matches[pick.name] == top else "least_loaded")
        else:
            choice = Choice(least.name, matches[least.name], "least_loaded")
        self.decisions[choice.reason] += 1
        return choice


class PowerOfTwoRouter:
    """Two replicas at random, the less loaded of them (Ray Serve's default)."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.decisions: Counter[str] = Counter()

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> Choice:
        if not replicas:
            raise ValueError("no replica to route to")
        pair = self.rng.sample(list(replicas), min(2, len(replicas)))
        pick = min(pair, key=lambda r: r.load)
        self.decisions["random"] += 1
        return Choice(pick.name, pick.matched(hashes), "random")


class RoundRobinRouter:
    def __init__(self) -> None:
        self._turn = itertools.count()
        self.decisions: Counter[str] = Counter()

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> Choice:
        if not replicas:
            raise ValueError("no replica to route to")
        pick = sorted(replicas, key=lambda r: r.name)[next(self._turn) % len(replicas)]
        self.decisions["round_robin"] += 1
        return Choice(pick.name, pick.matched(hashes), "round_robin")


ROUTERS = {"kv": KVAwareRouter, "pow2": PowerOfTwoRouter, "round-robin": RoundRobinRouter}
