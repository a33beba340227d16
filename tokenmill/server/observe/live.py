"""The live view of the served engines: what the web page draws, as JSON of our own.

    GET /tokenmill/live?since=N          one state (steps after N only)
    GET /tokenmill/live/events           the same as server-sent events, every LIVE_EVERY_S

Each engine records its steps once someone first asks (``start_step_trace``): which
sequence got how many tokens of which kind (prefill chunk, decode, drafts verified
and kept), who was preempted, and the KV pool as one state per block. This module
keeps what a viewer needs of that, bounded whatever the traffic: the last
STEPS_KEPT steps, SERIES_KEPT half-second buckets of the queue and of throughput,
the latest LATENCIES_KEPT time-to-first-token and inter-token latencies.

Nothing private leaves: no text, no token, no request id (a sequence is "r17", a
number this view gives it), only counts, timings and the names of served models
and adapters, which /v1/models lists anyway.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import EngineSnapshot, percentiles
from tokenmill.host.energy import EnergyMeter
from tokenmill.server.gateway.models import ServedModel

STEPS_KEPT = 240  # the Gantt's steps
SERIES_BUCKET_S = 0.5
SERIES_KEPT = 240  # two minutes of buckets
LATENCIES_KEPT = 512  # per kind (TTFT, inter-token)
LABELS_KEPT = 4096  # sequences named at once (the oldest names are forgotten first)
BLOCKS_FRESH_S = 0.4  # viewers within this share one read of the block states
THROUGHPUT_WINDOW_S = 10.0
LIVE_EVERY_S = 0.5  # the events stream's period
BLOCKS_TIMEOUT_S = 1.0  # an engine inside a long step answers between steps: show the last picture meanwhile
UNWATCHED_S = 30.0  # nobody has asked for this long: the engines stop recording steps


@dataclass
class _Bucket:
    """Half a second of steps."""

    start: float
    running: int = 0  # most at once
    waiting: int = 0
    preempted: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0  # decodes and drafts kept
    steps: int = 0

    def wire(self, now: float) -> list:
        return [
            round(self.start - now, 2),
            self.running,
            self.waiting,
            self.preempted,
            self.prefill_tokens,
            self.decode_tokens,
            self.steps,
        ]


class ModelLive:
    """One served model's recent past, fed from its engine's step trace."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.started: bool | None = None  # None: not asked yet; False: this engine cannot trace
        self.steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        self.series: deque[_Bucket] = deque(maxlen=SERIES_KEPT)
        self.ttft: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.itl: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.finished: dict[str, int] = {}  # finish reason -> sequences, since the view started
        self._labels: OrderedDict[str, str] = OrderedDict()
        self._next_label = 0
        self._blocks: tuple[float, str] | None = None  # (when read, states as digits)
        self._blocks_lock = asyncio.Lock()

    async def start(self) -> None:
        if self.started is None:
            self.started = False  # concurrent viewers ask once
            try:
                self.started = await self.model.engine.start_step_trace()
            except Exception:
                self.started = None

    async def stop(self) -> None:
        if self.started:
            self.started = None
            try:
                await self.model.engine.stop_step_trace()
            except Exception:
                pass

    def label(self, seq_id: str) -> str:
        name = self._labels.get(seq_id)
        if name is not None:
            self._labels.move_to_end(seq_id)  # the least recently seen are forgotten first
        else:
            self._next_label += 1
            name = self._labels[seq_id] = f"r{self._next_label}"
            if len(self._labels) > LABELS_KEPT:
                self._labels.popitem(last=False)
        return name

    def take_steps(self) -> None:
        for step in self.model.engine.take_step_trace():
            seqs = [
                [self.label(sid), kind, tokens, drafts, accepted, cached, lora, finish]
                for sid, kind, tokens, drafts, accepted, cached, lora, finish in step["seqs"]
            ]
            ended = [[self.label(sid), reason] for sid, reason in step["ended"]]
            for reason in [s[7] for s in seqs] + [reason for _, reason in ended]:
                if reason is not None:
                    self.finished[reason] = self.finished.get(reason, 0) + 1
            preempted = [self.label(sid) for sid in step["preempted"]]
            self.steps.append({**step, "seqs": seqs, "preempted": preempted, "ended": ended})
            self._bucket(step, seqs, len(preempted))

    def _bucket(self, step: dict, seqs: list, preempted: int) -> None:
        """Count the step in the buckets it spans (a long step keeps its requests running
        through all of them); its tokens and preemptions in the last."""
        first = math.floor(step["time"] / SERIES_BUCKET_S)
        last = math.floor((step["time"] + step["duration"]) / SERIES_BUCKET_S)
        for i in range(max(first, last - SERIES_KEPT + 1), last + 1):
            if not self.series or self.series[-1].start < i * SERIES_BUCKET_S - 1e-9:
                self.series.append(_Bucket(i * SERIES_BUCKET_S))
            b = self.series[-1]
            b.running = max(b.running, step["running"])
            b.waiting = max(b.waiting, step["waiting"])
        b.preempted += preempted
        b.steps += bool(seqs)  # (a record of ends between steps is no step)
        for _, kind, tokens, *_ in seqs:
            if kind == "prefill":
                b.prefill_tokens += tokens
            else:
                b.decode_tokens += tokens

    def observe(self, out: RequestOutput) -> None:
        """A sequence ended: its time to first token and gaps between tokens."""
        t = out.timings[0] if out.timings else None
        if t is None:
            return
        if t.ttft is not None:
            self.ttft.append(t.ttft)
        times = t.token_times[-LATENCIES_KEPT - 1 :]
        self.itl.extend(b - a for a, b in zip(times, times[1:], strict=False))

    async def blocks(self) -> str | None:
        """The KV pool, one digit per block (block_pool: 0 free, 1 cached, 2 used, 3 shared,
        +4 a prefix-cache hit took it since the last read); read at most every
        BLOCKS_FRESH_S whatever the number of viewers."""
        async with self._blocks_lock:
            now = time.monotonic()
            if self._blocks is None or now - self._blocks[0] > BLOCKS_FRESH_S:
                try:
                    states = await asyncio.wait_for(self.model.engine.block_states(), BLOCKS_TIMEOUT_S)
                except TimeoutError:  # in a long step: the last picture, asked again next time
                    return None if self._blocks is None else self._blocks[1]
                except Exception:
                    states = None
                if states is None:
                    return None
                self._blocks = (now, "".join(map(str, states)))  # digits: compact in JSON, easy in JS
            return self._blocks[1]

    async def state(self, since: int, now: float) -> dict[str, Any]:
        self.take_steps()
        snap = self.model.engine.snapshot()
        recent = [b for b in self.series if now - b.start <= THROUGHPUT_WINDOW_S]  # buckets: any step rate
        decode = sum(b.decode_tokens for b in recent) / THROUGHPUT_WINDOW_S
        prefill = sum(b.prefill_tokens for b in recent) / THROUGHPUT_WINDOW_S
        steps = [
            {**s, "time": round(s["time"] - now, 4), "duration": round(s["duration"], 5)}
            for s in self.steps
            if s["step"] > since
        ]
        return {
            "name": self.model.name,
            "alive": not self.model.engine.is_dead,
            "traced": bool(self.started),
            "max_model_len": self.model.max_model_len,
            "gauges": {
                "running": snap.num_running,
                "waiting": snap.num_waiting,
                "kv_usage": round(snap.kv_usage, 4),
                "preemptions": snap.num_preemptions,
                "prefix_cache_hit_rate": round(snap.prefix_cache_hits / snap.prefix_cache_queries, 4)
                if snap.prefix_cache_queries
                else None,
                "spec_acceptance": round(snap.spec_num_accepted_tokens / snap.spec_num_draft_tokens, 4)
                if snap.spec_num_draft_tokens
                else None,
                # the prefix cache's tiers (--kv-disk-cache, --kv-host-cache), once one holds or read anything
                "kv_disk": _tier(snap, "disk"),
                "kv_host": _tier(snap, "host"),
                "kv_evicted_tokens": snap.kv_evicted_tokens,  # by requests' kv_eviction, since start
                "generation_tokens_per_s": round(decode, 1),
                "prompt_tokens_per_s": round(prefill, 1),
            },
            "latency_ms": {"ttft": _percentiles(self.ttft), "itl": _percentiles(self.itl)},
            "finished": dict(self.finished),
            "adapters": [
                {
                    "name": name,
                    "running": name in snap.running_loras,
                    "waiting": name in snap.waiting_loras,
                    "requests": snap.lora_requests.get(name, 0),
                }
                for name in sorted(snap.loras)
            ]
            if snap.max_loras is not None
            else None,
            "series": [b.wire(now) for b in self.series if now - b.start <= SERIES_KEPT * SERIES_BUCKET_S],
            "last_step": self.steps[-1]["step"] if self.steps else 0,
            "steps": steps,
            "blocks": await self.blocks(),
        }


class EnergyWindow:
    """The server's power over the last THROUGHPUT_WINDOW_S (the throughput tiles' window),
    from the energy meter read at each look, and the machine's price: the page divides them
    by the tokens per second for joules per token and $ per 1M tokens."""

    def __init__(self, meter: EnergyMeter, price_per_hour: float | None) -> None:
        self.meter, self.price_per_hour = meter, price_per_hour
        self.samples: deque[tuple[float, float]] = deque()  # (monotonic time, joules)

    def state(self) -> dict[str, Any]:
        reading = self.meter.read()
        now = time.monotonic()
        self.samples.append((now, reading.joules))
        while len(self.samples) > 2 and now - self.samples[1][0] >= THROUGHPUT_WINDOW_S:
            self.samples.popleft()
        (t0, j0), (t1, j1) = self.samples[0], self.samples[-1]
        return {
            "source": reading.source,
            "how": reading.how,
            "joules": round(reading.joules, 1),
            "watts": round((j1 - j0) / (t1 - t0), 2) if t1 > t0 else None,
            "price_per_hour": self.price_per_hour,
        }


class LiveView:
    """Every served model's ``ModelLive``; ``epoch`` changes with each server start, so
    that a page left open learns that step numbers start afresh."""

    def __init__(
        self, models: dict[str, ServedModel], energy: EnergyMeter | None = None, price_per_hour: float | None = None
    ) -> None:
        self.models = {name: ModelLive(m) for name, m in models.items()}
        self.energy = EnergyWindow(energy, price_per_hour) if energy is not None else None
        self.epoch = uuid.uuid4().hex[:12]
        self.last_read = 0.0  # time.monotonic() of the latest state asked for
        self._watch: asyncio.Task | None = None

    def observe(self, out: RequestOutput, model_name: str) -> None:
        live = self.models.get(model_name)
        if live is not None:
            live.observe(out)

    async def state(self, since: dict[str, int] | None = None) -> dict[str, Any]:
        """Every model's state; ``since`` (model -> step): only the steps after it."""
        self.last_read = time.monotonic()
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._stop_when_unwatched())
        await asyncio.gather(*(live.start() for live in self.models.values()))
        now = time.perf_counter()  # the clock the engines stamp steps with (monotonic, shared by processes)
        since = since or {}
        models = await asyncio.gather(*(live.state(since.get(name, 0), now) for name, live in self.models.items()))
        return {
            "epoch": self.epoch,
            "series_bucket_s": SERIES_BUCKET_S,
            "models": list(models),
            "energy": self.energy.state() if self.energy is not None else None,
        }

    async def _stop_when_unwatched(self) -> None:
        """Tracing costs the engines a little every step: once nobody has looked for
        UNWATCHED_S, they stop (the next look starts them again)."""
        while time.monotonic() - self.last_read < UNWATCHED_S:
            await asyncio.sleep(max(0.05, UNWATCHED_S - (time.monotonic() - self.last_read)))
        for live in self.models.values():
            await live.stop()


def _percentiles(values: deque[float]) -> dict[str, float] | None:
    """Milliseconds, as `tokenmill bench serve` computes them, and how many there were."""
    if not values:
        return None
    return {**{k: round(1000 * v, 2) for k, v in percentiles(list(values)).items()}, "count": len(values)}


def _tier(snap: EngineSnapshot, tier: str) -> dict[str, int] | None:
    """A prefix-cache tier's size and counts (``kv_disk_*``, ``kv_host_*``); None while it has
    held and read nothing (or the server has none)."""
    counts = {k: getattr(snap, f"kv_{tier}_{k}") for k in ("bytes", "hits", "stored", "evicted")}
    return counts if counts["bytes"] or counts["hits"] or counts["stored"] else None
