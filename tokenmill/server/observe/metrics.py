"""Prometheus metrics under vLLM's names, each served twice: with the prefix ``tokenmill:`` (ours,
with what vLLM has not) and with vLLM's own ``vllm:`` and its labels (``model_name``), so that the
Grafana dashboard vLLM ships, its alerts and its autoscalers read a tokenmill server unchanged.

Per-request histograms are observed by the server when a request ends, from the
engine's own timings. Engine-wide gauges and counters (running, waiting, KV usage,
preemptions, prefix cache, speculative tokens) are read from the engine's latest
snapshot at scrape time by a collector, so nothing polls (with the core in its own
process, the snapshot comes with each of its messages). Each server has its own registry: no global
state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import ITERATION_TOKEN_BUCKETS, EngineSnapshot
from tokenmill.host.energy import EnergyMeter

P = "tokenmill:"
VLLM = "vllm:"
# What vLLM's engine-wide families are called under its prefix (where the name differs from ours):
# the gauges and counters a collector reads from the engines at scrape time.
VLLM_ENGINE_FAMILIES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass(frozen=True)
class EngineSource:
    """Where one served model's engine figures come from."""

    snapshot: Callable[[], EngineSnapshot]
    alive: Callable[[], bool] = lambda: True
    # engine replicas: each replica's snapshot, each pool's routing counters, KV transfer
    replicas: Callable[[], tuple[dict[str, EngineSnapshot], dict, Any]] | None = None


class EngineCollector:
    """Gauges and counters read from the engines when /metrics is scraped, one series per
    served model (``model_name``). With engine replicas, every engine series is one per
    replica, labelled ``replica``: their sum is the cluster's figure."""

    def __init__(self, engines: dict[str, EngineSource]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        """Each family once, with one sample per model (and replica): the exposition format
        allows a metric's name once."""
        with_replicas = any(source.replicas is not None for source in self.engines.values())
        label_names = ["model_name", "replica"] if with_replicas else ["model_name"]
        series: list[tuple[list[str], EngineSnapshot]] = []
        pools: list[tuple[str, dict, Any]] = []  # replicas: (model, routing counters, KV transfer)
        for model_name, source in self.engines.items():
            if source.replicas is None:
                series.append(([model_name, ""] if with_replicas else [model_name], source.snapshot()))
            else:
                snaps, routing, transfer = source.replicas()
                series += [([model_name, name], snap) for name, snap in sorted(snaps.items())]
                pools.append((model_name, routing, transfer))

        def family(kind, name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Iterator[Metric]:
            """The family under our prefix, and under vLLM's where vLLM has it."""
            for prefix in (P, VLLM) if name in VLLM_ENGINE_FAMILIES else (P,):
                f = kind(prefix + name, doc, labels=label_names)
                for labels, snap in series:
                    f.add_metric(labels, value(snap))
                yield f

        def gauge(name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Iterator[Metric]:
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Iterator[Metric]:
            return family(CounterMetricFamily, name, doc, value)

        alive = GaugeMetricFamily(
            P + "engine_alive", "1 while the engine loop runs, 0 once it has died.", labels=["model_name"]
        )
        for model_name, source in self.engines.items():
            alive.add_metric([model_name], 1.0 if source.alive() else 0.0)
        yield alive
        yield from gauge("num_requests_running", "Requests in model execution batches.", lambda e: e.num_running)
        yield from gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda e: e.num_waiting)
        yield from gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", lambda e: e.kv_usage)
        vllm_gpu = GaugeMetricFamily(  # vLLM's older name, which its dashboards still plot
            VLLM + "gpu_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", labels=label_names
        )
        for labels, snap in series:
            vllm_gpu.add_metric(labels, snap.kv_usage)
        yield vllm_gpu
        for prefix in (P, VLLM):
            yield _iteration_tokens(prefix, label_names, series)
        yield from counter("num_preemptions", "Cumulative preemptions.", lambda e: e.num_preemptions)
        yield from counter(
            "num_step_retries",
            "Steps that failed as a batch and were re-run one request at a time.",
            lambda e: e.num_step_retries,
        )
        yield from counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda e: e.prefix_cache_queries
        )
        yield from counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda e: e.prefix_cache_hits
        )
        for tier, name, flag, dropped in (
            ("disk", "disk tier", "--kv-disk-cache", "removed from the disk tier past its size"),
            (
                "host",
                "host-memory tier",
                "--kv-host-cache",
                "the host-memory tier dropped for newer ones (its buffer full)",
            ),
        ):
            yield from gauge(
                f"kv_{tier}_cache_bytes",
                f"Bytes of KV blocks the prefix cache's {name} holds ({flag}).",
                lambda e, t=tier: getattr(e, f"kv_{t}_bytes"),
            )
            yield from counter(
                f"kv_{tier}_cache_hits",
                f"KV blocks read back from the {name} on a prefix-cache miss.",
                lambda e, t=tier: getattr(e, f"kv_{t}_hits"),
            )
            yield from counter(
                f"kv_{tier}_cache_stored",
                f"KV blocks stored in the {name}.",
                lambda e, t=tier: getattr(e, f"kv_{t}_stored"),
            )
            yield from counter(
                f"kv_{tier}_cache_evictions", f"KV blocks {dropped}.", lambda e, t=tier: getattr(e, f"kv_{t}_evicted")
            )
        yield from counter(
            "kv_evicted_tokens",
            "Tokens whose K/V requests evicted (kv_eviction: StreamingLLM), their blocks back in the pool.",
            lambda e: e.kv_evicted_tokens,
        )
        yield from counter("spec_decode_num_drafts", "Speculative verification steps.", lambda e: e.spec_num_drafts)
        yield from counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", lambda e: e.spec_num_draft_tokens
        )
        yield from counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda e: e.spec_num_accepted_tokens
        )
        for model_name, routing, transfer in pools:  # (replicas serve one model: a server refuses several with them)
            if routing:
                yield from _routing_metrics(["model_name"], [model_name], routing)
            if transfer is not None:
                yield from _transfer_metrics(["model_name"], [model_name], transfer, routing.get("decode"))
        yield from self._lora_metrics()

    def _lora_metrics(self) -> Iterator[Metric]:
        """vLLM's lora_requests_info (labelled by model too when several are served) and
        requests per adapter."""
        several = len(self.engines) > 1
        info = GaugeMetricFamily(
            P + "lora_requests_info",
            "Running stats on LoRA requests (as vLLM's).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora", *(["model_name"] if several else [])],
        )
        per = CounterMetricFamily(P + "lora_requests", "Requests per LoRA adapter.", labels=["model_name", "lora_name"])
        found = False
        for model_name, source in self.engines.items():
            e = source.snapshot()
            if e.max_loras is None:
                continue
            found = True
            info.add_metric(
                [
                    ",".join(e.running_loras),
                    ",".join(e.waiting_loras),
                    str(e.max_loras),
                    *([model_name] if several else []),
                ],
                time.time(),
            )
            for name, count in sorted(e.lora_requests.items()):
                per.add_metric([model_name, name], count)
        if found:
            yield info
            yield per


def _iteration_tokens(prefix: str, label_names: list[str], series: list) -> HistogramMetricFamily:
    """vLLM's iteration_tokens_total: a histogram of the tokens each engine step computed."""
    h = HistogramMetricFamily(prefix + "iteration_tokens_total", "Tokens per engine step.", labels=label_names)
    for labels, snap in series:
        counts = list(snap.iteration_tokens) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        running, buckets = 0, []
        for bound, n in zip([*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"], counts, strict=True):
            running += n
            buckets.append((bound, running))
        h.add_metric(labels, buckets, snap.iteration_tokens_sum)
    return h


def _routing_metrics(names: list[str], values: list[str], routing: dict) -> Iterator[Metric]:
    """The replica routers' counters, per pool ("engine", or "prefill" and "decode")."""
    labels = [*names, "pool"]
    decisions = CounterMetricFamily(
        P + "router_decisions",
        "Requests routed, by the reason for the replica chosen (prefix, least_loaded, balance, random, round_robin).",
        labels=[*labels, "reason"],
    )
    routed = CounterMetricFamily(P + "router_requests", "Requests routed to each replica.", labels=[*labels, "replica"])
    predicted = CounterMetricFamily(
        P + "router_predicted_hit_blocks",
        "Prompt blocks the router expected cached on the replica it chose.",
        labels=labels,
    )
    realised = CounterMetricFamily(
        P + "router_realised_hit_tokens",
        "Prompt tokens the chosen replicas found cached (requests finished).",
        labels=labels,
    )
    prompts = CounterMetricFamily(
        P + "router_prompt_tokens", "Prompt tokens of the routed requests that finished.", labels=labels
    )
    load_cost = GaugeMetricFamily(
        P + "router_load_cost_tokens",
        "kv routing's price of a request in flight on each "
        "replica, in prompt tokens, by source (measured on its engine at start, fixed by "
        "--route-load-cost, or the default for a replica that reported none).",
        labels=[*labels, "replica", "source"],
    )
    for pool, stats in sorted(routing.items()):
        for reason, n in sorted(stats.decisions.items()):
            decisions.add_metric([*values, pool, reason], n)
        for replica, n in sorted(stats.routed.items()):
            routed.add_metric([*values, pool, replica], n)
        predicted.add_metric([*values, pool], stats.predicted_hit_blocks)
        realised.add_metric([*values, pool], stats.realised_hit_tokens)
        prompts.add_metric([*values, pool], stats.prompt_tokens)
        for replica, (tokens, source) in sorted(stats.load_costs.items()):
            load_cost.add_metric([*values, pool, replica, source], tokens)
    yield from (decisions, routed, predicted, realised, prompts, load_cost)


def _transfer_metrics(names: list[str], values: list[str], transfer: Any, decode: Any) -> Iterator[Metric]:
    """Disaggregated serving: the KV that prefill replicas computed and decode replicas received."""
    for name, doc, value in (
        ("kv_transfer_requests", "Requests whose prompt KV a prefill replica computed.", transfer.requests),
        ("kv_transfer_blocks", "KV blocks shipped from prefill to decode replicas.", transfer.blocks),
        ("kv_transfer_bytes", "Bytes of KV shipped from prefill to decode replicas.", transfer.bytes),
        ("kv_transfer_prefill_seconds", "Seconds prefill replicas spent on shipped prompts.", transfer.prefill_seconds),
        ("kv_transfer_fallbacks", "Prefills that failed: the decode replica computed the prompt.", transfer.fallbacks),
        (
            "kv_transfer_imported_blocks",
            "KV blocks decode replicas received and cached.",
            decode.imported_blocks if decode else 0,
        ),
        (
            "kv_transfer_import_seconds",
            "Seconds decode replicas spent fetching and caching KV blocks.",
            decode.import_seconds if decode else 0.0,
        ),
    ):
        c = CounterMetricFamily(P + name, doc, labels=names)
        c.add_metric(values, value)
        yield c


class CacheCollector:
    """The response cache's counters and size, read at scrape time."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        stats = self.cache.stats
        hits = CounterMetricFamily(
            P + "response_cache_hits",
            "Requests answered from the response cache, by kind (exact, semantic).",
            labels=["kind"],
        )
        for kind, n in sorted(stats.hits.items()):
            hits.add_metric([kind], n)
        yield hits
        for name, doc, value in (
            ("response_cache_misses", "Cacheable requests the response cache did not hold.", stats.misses),
            ("response_cache_evictions", "Answers dropped to stay within --response-cache-memory.", stats.evictions),
            ("response_cache_expirations", "Answers dropped when their TTL passed.", stats.expirations),
        ):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], value)
            yield c
        size = GaugeMetricFamily(P + "response_cache_bytes", "Bytes the response cache holds.")
        size.add_metric([], self.cache.bytes)
        yield size
        entries = GaugeMetricFamily(P + "response_cache_entries", "Answers the response cache holds.")
        entries.add_metric([], len(self.cache.entries))
        yield entries


class EnergyCollector:
    """The server's energy since it started (its process and the engine processes it
    started), read at scrape time, labelled measured (RAPL, NVML) or estimated; and the
    machine's price per hour where one was given."""

    def __init__(self, meter: EnergyMeter, price_per_hour: float | None) -> None:
        self.meter, self.price_per_hour = meter, price_per_hour

    def collect(self) -> Iterator[Metric]:
        reading = self.meter.read()
        energy = CounterMetricFamily(
            P + "energy_joules",
            "Energy the server used since it started: measured (RAPL, NVML; machine-wide) or estimated "
            "(W per busy CPU x its processes' CPU seconds).",
            labels=["source"],
        )
        energy.add_metric([reading.source], reading.joules)
        yield energy
        if self.price_per_hour is not None:
            yield GaugeMetricFamily(P + "price_per_hour_dollars", "The machine's price per hour.", self.price_per_hour)


class ServerMetrics:
    def __init__(
        self,
        engines: dict[str, EngineSource],
        routers: list[str] | None = None,
        cache: Any = None,
        energy: EnergyMeter | None = None,
        price_per_hour: float | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engines))
        if energy is not None:
            self.registry.register(EnergyCollector(energy, price_per_hour))
        if cache is not None:
            self.registry.register(CacheCollector(cache))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets) -> _Both:
            return _Both([Histogram(p + name, doc, labels, buckets=buckets, registry=self.registry) for p in (P, VLLM)])

        def count(name: str, doc: str, more: tuple[str, ...] = ()) -> _Both:
            return _Both([Counter(p + name, doc, [*labels, *more], registry=self.registry) for p in (P, VLLM)])

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first.", TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a request.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        self.prefill = hist(
            "request_prefill_time_seconds", "Time from first scheduling to first token.", LATENCY_BUCKETS
        )
        self.decode = hist("request_decode_time_seconds", "Time from first token to the last.", LATENCY_BUCKETS)
        self.inference = hist(
            "request_inference_time_seconds", "Time from first scheduling to the end.", LATENCY_BUCKETS
        )
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS)
        self.max_gen = hist("request_max_num_generation_tokens", "The max_tokens of finished requests.", TOKEN_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = count("generation_tokens", "Tokens generated.")
        self.success = count("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.context_shifts = Counter(
            P + "context_shift_requests",
            "Chats whose oldest turns were dropped to fit the context (--context-shift).",
            labels,
            registry=self.registry,
        )
        self.context_shift_tokens = Counter(
            P + "context_shift_dropped_prompt_tokens",
            "Prompt tokens the context shift dropped.",
            labels,
            registry=self.registry,
        )
        for name in engines:  # at zero from the start, not from the first shift
            self.context_shifts.labels(name)
            self.context_shift_tokens.labels(name)
        self.routes = None
        if routers:
            self.routes = Counter(
                P + "model_router_requests",
                "Requests a model router sent to each model, by reason "
                "(classifier, tools, response_format, logprobs, long_prompt, confident, low_confidence).",
                ["router", "model_name", "reason"],
                registry=self.registry,
            )

    def observe_context_shift(self, model_name: str, dropped_prompt_tokens: int) -> None:
        self.context_shifts.labels(model_name).inc()
        self.context_shift_tokens.labels(model_name).inc(dropped_prompt_tokens)

    def observe_route(self, router: str, route: Any) -> None:
        if self.routes is not None:
            self.routes.labels(router, route.model, route.reason).inc()

    def observe_finished(self, out: RequestOutput, model_name: str, max_tokens: int | None = None) -> None:
        """One sequence of the model ``model_name`` ended (a request with n > 1 reports each of its n);
        ``max_tokens``: what it was allowed."""
        m = model_name
        c = out.outputs[0]
        t = out.timings[0]
        self.success.labels(m, c.finish_reason or "abort").inc()
        self.generation_tokens.labels(m).inc(len(c.token_ids))
        self.gen_len.labels(m).observe(len(c.token_ids))
        if c.index == 0:  # the prompt is shared by the n sequences: count it once
            self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
            self.prompt_len.labels(m).observe(len(out.prompt_token_ids))
        if t.ttft is not None:
            self.ttft.labels(m).observe(t.ttft)
        if t.tpot is not None:
            self.tpot.labels(m).observe(t.tpot)
        if t.e2e is not None:
            self.e2e.labels(m).observe(t.e2e)
        if t.first_scheduled is not None:
            self.queue.labels(m).observe(t.first_scheduled - t.arrival)
            if t.first_token is not None:
                self.prefill.labels(m).observe(t.first_token - t.first_scheduled)
            if t.finished is not None:
                self.inference.labels(m).observe(t.finished - t.first_scheduled)
        if t.first_token is not None and t.finished is not None:
            self.decode.labels(m).observe(max(t.finished - t.first_token, 0.0))
        for a, b in itertools.pairwise(t.token_times):
            self.itl.labels(m).observe(b - a)
        if max_tokens is not None:
            self.max_gen.labels(m).observe(max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Both:
    """One metric under both prefixes, observed once: ``labels(...)`` hands back each's child."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def labels(self, *values: str) -> _Both:
        return _Both([m.labels(*values) for m in self.metrics])

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def inc(self, value: float = 1) -> None:
        for m in self.metrics:
            m.inc(value)
