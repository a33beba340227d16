"""KV-aware routing from given KV events and loads, against the engine's own block
pool and hashes (no Ray, no model)."""

from __future__ import annotations

from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.kv_manager import KVCacheManager
from tokenmill.engine.core.request import Request
from tokenmill.replicas.replica_router import (
    KVAwareRouter,
    PowerOfTwoRouter,
    ReplicaState,
    RoundRobinRouter,
    prompt_block_hashes,
)
from tokenmill.sampling_params import SamplingParams

BS = 4
SYSTEM = list(range(100, 116))  # a shared system prompt: 4 blocks


def test_the_block_pool_reports_what_enters_and_leaves_its_prefix_cache_by_the_routers_hashes():
    pool = BlockPool(6, record_events=True)
    kv = KVCacheManager(pool, BS)
    req = Request("a", SYSTEM + [1, 2], SamplingParams())
    kv.allocate_slots(req, len(req.prompt_token_ids), [])
    req.num_computed_tokens = len(req.prompt_token_ids)
    kv.cache_computed_blocks(req)
    stored = pool.take_events()
    assert stored == [("stored", h) for h in prompt_block_hashes(SYSTEM + [1, 2], BS)]  # the same chain
    assert pool.take_events() == []
    kv.free(req)
    pool.allocate(6)  # every block: the cached ones are evicted
    assert sorted(pool.take_events()) == sorted(("removed", h) for _, h in stored)
    replica = ReplicaState("r0")
    replica.apply(stored)
    assert replica.matched(prompt_block_hashes(SYSTEM + [7, 7, 7, 7], BS)) == 4
    replica.apply([("removed", stored[1][1])])
    assert replica.matched(prompt_block_hashes(SYSTEM, BS)) == 1  # a chain: the first miss ends it


def replicas(loads: list[int], cached: dict[int, list[int]]) -> list[ReplicaState]:
    out = []
    for i, load in enumerate(loads):
        r = ReplicaState(f"r{i}", num_running=load)
        r.apply([("stored", h) for h in prompt_block_hashes(cached.get(i, []), BS)])
        out.append(r)
    return out


def test_kv_routing_weighs_the_cached_prefix_against_load():
    """A replica's cost: the prompt tokens it would compute plus a price per request in
    flight there (here one block's worth); a prefix below 30% of the prompt does not
    count; load far out of balance overrides; equal loads spread distinct prefixes."""
    router = KVAwareRouter(block_size=BS, load_cost=BS)
    prompt = prompt_block_hashes(SYSTEM + list(range(8)), BS)  # 6 blocks, the first 4 shared
    fleet = replicas([1, 0, 3], {0: SYSTEM})  # costs: r0 8 + 4, r1 24 + 0, r2 24 + 12
    assert router.choose(prompt, fleet) == router.choose(prompt, fleet)
    choice = router.choose(prompt, fleet)
    assert (choice.replica, choice.matched_blocks, choice.reason) == ("r0", 4, "prefix")  # though busier
    busy = replicas([5, 0, 3], {0: SYSTEM})  # r0: 8 + 20 > r1's 24: the idle replica computes the prompt
    assert (router.choose(prompt, busy).replica, router.choose(prompt, busy).reason) == ("r1", "least_loaded")
    short = prompt_block_hashes(SYSTEM[:4] + list(range(40, 60)), BS)  # 1 of 6 blocks cached: below 0.3
    assert router.choose(short, fleet).replica == "r1" and router.choose(short, fleet).reason == "least_loaded"
    hot = replicas([200, 10, 120], {0: SYSTEM})  # r0: 190 more than the idlest and 20x: balance wins
    assert router.choose(prompt, hot).reason == "balance" and router.choose(prompt, hot).replica == "r1"
    tie = replicas([2, 1, 1], {0: SYSTEM, 2: SYSTEM})  # equal matches: the cheaper, less loaded one
    assert router.choose(prompt, tie).replica == "r2"
    assert router.choose([], fleet).replica == "r1"  # a prompt shorter than a block: least loaded
    idle = replicas([0, 0], {0: SYSTEM})  # a new prefix, both idle: the replica holding less gets it
    assert router.choose(prompt_block_hashes(list(range(60, 84)), BS), idle).replica == "r1"
    assert router.decisions["prefix"] == 4 and router.decisions["balance"] == 2


def test_the_baselines_ignore_the_cache():
    fleet = replicas([0, 0, 0], {0: SYSTEM})
    prompt = prompt_block_hashes(SYSTEM, BS)
    rr = RoundRobinRouter()
    assert [rr.choose(prompt, fleet).replica for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    p2 = PowerOfTwoRouter(seed=0)
    loaded = replicas([9, 0, 9], {})
    picks = [p2.choose(prompt, loaded).replica for _ in range(30)]
    assert picks.count("r1") >= 15  # the idle r1 wins every pair it is in (2 pairs in 3)


def test_an_engine_reports_kv_events_a_router_can_match_prompts_against():
    """An engine with record_kv_events: after serving a prompt, a router fed its
    events finds the prompt's blocks there, and none on a replica that did not serve it."""
    from tests.helpers import ScriptedRunner, ToyTokenizer
    from tests.helpers import run_to_completion as run
    from tokenmill.engine.engine import Engine, EngineConfig

    engines = [
        Engine.create(
            ScriptedRunner(BS),
            ToyTokenizer(),
            EngineConfig(num_blocks=32, block_size=BS, max_model_len=64, record_kv_events=True),
        )
        for _ in range(2)
    ]
    system = [t % 50 for t in SYSTEM]  # the toy vocabulary's ids
    engines[0].add_request("a", system + [1, 2, 3], SamplingParams(max_tokens=2))
    run(engines[0])
    states = [ReplicaState(f"r{i}") for i in range(2)]
    for engine, state in zip(engines, states, strict=True):
        state.apply(engine.core.kv_transfer.take_events())
    follow_up = prompt_block_hashes(system + [9, 9, 9, 9], BS)
    choice = KVAwareRouter().choose(follow_up, states)
    assert (choice.replica, choice.matched_blocks, choice.reason) == ("r0", 4, "prefix")
    assert engines[0].core.kv_transfer.take_events() == [] and engines[0].core.lora_hash_root("none") is None


def test_the_index_routes_follow_ups_to_the_replica_that_reported_their_prefix():
    """The index the replicas report to: a follow-up goes where its prefix was stored,
    a replica that reports a restart (reset) or is removed has nothing cached, and the
    router's in-flight count overrides a stale reported load."""
    from tokenmill.replicas.index import KVIndex

    index = KVIndex("kv", block_size=BS)
    hashes = prompt_block_hashes(SYSTEM + [1, 2, 3, 4], BS)
    index.report("a", [("stored", h) for h in hashes], 0, 0)
    index.report("b", [], 0, 0)
    assert index.choose(hashes, [("a", 0), ("b", 0)]) == "a"
    assert index.choose(hashes, [("a", 200), ("b", 0)]) == "b"  # 200 in flight vs 0: out of balance
    index.report("a", [], 0, 0, reset=True)  # restarted: its cache is empty
    assert index.choose(hashes, [("a", 0), ("b", 1)]) == "a"  # least loaded, no prefix anywhere
    index.report("b", [("stored", h) for h in hashes[:3]], 0, 0, finished=[(20, 12)])
    index.remove("a")
    assert index.choose(hashes, [("a", None), ("b", None)]) == "b"
    _, stats = index.view()
    assert stats.decisions == {"prefix": 2, "balance": 1, "least_loaded": 1}
    assert stats.predicted_hit_blocks == 5 + 0 + 0 + 3 and (stats.prompt_tokens, stats.realised_hit_tokens) == (20, 12)
    assert stats.routed == {"a": 2, "b": 2}


def test_a_burst_between_two_reports_is_spread_over_the_replicas():
    """Four requests with no cached prefix arrive before either replica reports again:
    the index counts what it sent since each report, so they go two and two."""
    from tokenmill.replicas.index import KVIndex

    index = KVIndex("kv", block_size=BS)
    for name in ("a", "b"):
        index.report(name, [], 0, 0)
    picks = [index.choose(prompt_block_hashes([i] * 8, BS), [("a", None), ("b", None)]) for i in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    index.report("a", [], 4, 0)  # a now reports all four as its own: b is the idle one
    assert index.choose([], [("a", None), ("b", None)]) == "b"


def test_replica_snapshots_merge_into_the_clusters_figures():
    from tokenmill.engine.stats import EngineSnapshot
    from tokenmill.replicas.index import merge_snapshots

    a = EngineSnapshot(
        num_running=2,
        num_waiting=1,
        kv_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        loras={"x": "/x"},
        lora_requests={"x": 2},
    )
    b = EngineSnapshot(
        num_running=3, kv_usage=0.25, prefix_cache_queries=5, prefix_cache_hits=5, lora_requests={"x": 1}
    )
    m = merge_snapshots([a, b])
    assert (m.num_running, m.num_waiting, m.prefix_cache_queries, m.prefix_cache_hits) == (5, 1, 15, 9)
    assert m.kv_usage == 0.375 and m.loras == {"x": "/x"} and m.lora_requests == {"x": 3}


def test_every_counter_of_the_replicas_reaches_the_clusters_figures():
    """Each replica's counters summed (the KV tiers' and eviction's included): a field the
    merge forgets would read 0 on a cluster's /metrics."""
    from dataclasses import fields

    from tokenmill.engine.stats import EngineSnapshot
    from tokenmill.replicas.index import merge_snapshots

    counters = [f.name for f in fields(EngineSnapshot) if f.type == "int" and f.name != "max_loras"]
    one = EngineSnapshot(**{name: i + 1 for i, name in enumerate(counters)})
    m = merge_snapshots([one, one])
    assert {name: getattr(m, name) for name in counters} == {name: 2 * (i + 1) for i, name in enumerate(counters)}


def test_the_serve_deploy_application_takes_our_option_names_and_refuses_others():
    """deploy/ray-serve.yaml's args are tokenmill's options; a typo is an error naming it
    (building the application starts nothing)."""
    from pathlib import Path

    import pytest

    pytest.importorskip("ray.serve")
    import yaml  # Ray's dependency

    from tokenmill.errors import TokenmillError
    from tokenmill.replicas.serve_app import build

    config = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "ray-serve.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "tokenmill.replicas.serve_app:build"
    assert build(app["args"]) is not None
    with pytest.raises(TokenmillError, match="data_paralel_size"):
        build({"data_paralel_size": 2})
    with pytest.raises(TokenmillError, match="both --prefill-replicas and --decode-replicas"):
        build({"prefill_replicas": 1})


def test_replicas_without_ray_say_how_to_install_it(monkeypatch):
    import sys

    import pytest

    from tokenmill.errors import TokenmillError
    from tokenmill.replicas.front import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(TokenmillError, match=r"pip install 'tokenmill\[ray\]'"):
        import_ray()


def test_replica_options_are_checked_before_anything_starts():
    import pytest

    from tokenmill.configuration.args import engine_args
    from tokenmill.configuration.serving_config import ReplicaConfig
    from tokenmill.errors import TokenmillError
    from tokenmill.replicas.front import check_replica_options

    with pytest.raises(ValueError, match="both --prefill-replicas and --decode-replicas"):
        ReplicaConfig(decode_replicas=2)
    with pytest.raises(ValueError, match="replace --data-parallel-size"):
        ReplicaConfig(data_parallel_size=2, prefill_replicas=1, decode_replicas=1)
    assert not ReplicaConfig().enabled and ReplicaConfig(ray=True).enabled
    with pytest.raises(TokenmillError, match="draft model"):
        check_replica_options(
            engine_args(speculative="draft", draft_model="x"), ReplicaConfig(prefill_replicas=1, decode_replicas=1)
        )


def stored(tokens: list[int], bs: int) -> list[tuple[str, bytes]]:
    return [("stored", h) for h in prompt_block_hashes(tokens, bs)]


def test_kv_routing_prices_load_at_what_each_replica_measured():
    """A follow-up turn of 304 tokens whose first 288 (a ~300-token system prompt and the
    chat so far: 18 blocks of 16) are cached on r0, which runs 3 requests; r1 is idle. At
    the old constant, 128 tokens a request in flight, r0 costs 16 + 3 * 128 = 400 > r1's
    304: the request moves away and its prompt is computed whole. At the price r0
    measured (40: its decode steps grow little with the batch) r0 costs 16 + 120 = 136:
    it stays with its prefix. A replica that reported no price is charged the default;
    a fixed price (--route-load-cost) overrides every report."""
    from tokenmill.replicas.replica_router import DEFAULT_LOAD_COST

    bs, shared = 16, list(range(1000, 1288))
    prompt = prompt_block_hashes(shared + list(range(16)), bs)

    def fleet(price: float | None) -> list[ReplicaState]:
        r0 = ReplicaState("r0", num_running=3, load_cost=price)
        r0.apply(stored(shared, bs))
        return [r0, ReplicaState("r1", load_cost=price)]

    measured = KVAwareRouter(block_size=bs).choose(prompt, fleet(40))
    assert (measured.replica, measured.matched_blocks, measured.reason) == ("r0", 18, "prefix")
    assert DEFAULT_LOAD_COST == 128
    unreported = KVAwareRouter(block_size=bs).choose(prompt, fleet(None))  # the old behaviour
    assert (unreported.replica, unreported.reason) == ("r1", "least_loaded")
    fixed = KVAwareRouter(block_size=bs, load_cost=128).choose(prompt, fleet(40))
    assert fixed.replica == "r1"
    router = KVAwareRouter(block_size=bs)
    assert [router.price(r) for r in [*fleet(40), ReplicaState("r2")]] == [40, 40, DEFAULT_LOAD_COST]


def test_the_index_routes_by_the_price_each_replica_reports_with_its_load():
    """The replicas' reported prices reach the router through the index (and /metrics):
    the busy replica holding the prefix keeps the follow-up at its measured 40 tokens,
    not at a fixed 128; a report without a price keeps the last one; a replica that
    never reported one is priced at the default. /metrics shows each price and its source."""
    from tokenmill.replicas.index import KVIndex
    from tokenmill.server.observe.metrics import _routing_metrics

    bs, shared = 16, list(range(1000, 1288))
    hashes = prompt_block_hashes(shared + list(range(16)), bs)
    choices = {}
    for fixed in (None, 128):
        index = KVIndex("kv", block_size=bs, load_cost=fixed)
        index.report("a", stored(shared, bs), 3, 0, load_cost=40)
        index.report("b", [], 0, 0, load_cost=300)
        index.report("a", [], 3, 0)  # no price: the last one stands
        index.report("c", [], 9, 0)  # never reported one
        choices[fixed] = index.choose(hashes, [("a", 3), ("b", 0), ("c", 9)])
        costs = index.view()[1].load_costs
        if fixed is None:
            assert costs == {"a": (40, "measured"), "b": (300, "measured"), "c": (128, "default")}
        else:
            assert costs == {name: (128, "fixed") for name in "abc"}
        gauge = next(
            m
            for m in _routing_metrics(["model_name"], ["m"], {"engine": index.stats})
            if m.name == "tokenmill:router_load_cost_tokens"
        )
        assert {s.labels["replica"]: (s.value, s.labels["source"]) for s in gauge.samples} == costs
    assert choices == {None: "a", 128: "b"}
    index.remove("a")
    assert set(index.view()[1].load_costs) == {"b", "c"}


def test_the_load_price_is_measured_unless_a_number_is_given():
    import pytest

    from tokenmill.configuration.args import replica_config_from_namespace
    from tokenmill.configuration.serving_config import ReplicaConfig
    from tokenmill.entrypoints.cli import build_parser

    assert ReplicaConfig().route_load_cost == "auto" and ReplicaConfig().fixed_load_cost is None
    ns = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--route-load-cost", "64"])
    assert replica_config_from_namespace(ns).fixed_load_cost == 64
    assert ReplicaConfig(route_load_cost=0).fixed_load_cost == 0  # serve deploy's args: a number
    for bad in ("cheap", "-1", 2.5):
        with pytest.raises(ValueError, match="route_load_cost"):
            ReplicaConfig(route_load_cost=bad)
