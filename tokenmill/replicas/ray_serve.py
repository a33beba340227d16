"""Engine replicas as a Ray Serve deployment, routed by what their KV caches hold.

Three pieces, each a Ray Serve (or Ray) object:

- ``EngineReplica``: one engine per replica (an engine-core process of its own, driven
  through ``AsyncCoreClient`` from the replica's process). ``generate`` streams a request's outputs; a replica reports its
  prefix cache's events, its load, its price of load (measured on its engine at start,
  engine/core/load_price.py) and its snapshot to the index (every 0.5 s, and
  before the last output of a request leaves it, so that a follow-up turn is routed
  knowing what the previous one cached). In disaggregated serving a replica is a
  prefill one (``prefill``: compute the prompt's KV, put its blocks in Ray's object
  store) or a decode one (``generate(kv=...)``: import those blocks into its prefix
  cache, then run the request as on a cache hit).
- ``KVIndexActor``: ``index.KVIndex`` in a named actor, one per deployment.
- ``KVRequestRouter``: Ray Serve's request router for the deployment. For a call that
  carries ``block_hashes`` it asks the index which replica to use, giving Ray's own
  count of requests in flight per replica; Ray then sends the request there unless
  that replica is full (``max_ongoing_requests``), when the least loaded one gets it.

Start-up, the front that the HTTP app talks to, and shutdown are in ``front.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tokenmill.configuration.config import EngineArgs
from tokenmill.engine.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.replicas.index import KVIndex
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NAMESPACE = "tokenmill"
REPORT_PERIOD_S = 0.5  # load, gauges and the events of requests still running; a request's end reports at once


def replica_key(replica_id: ReplicaID) -> str:
    """A replica's name in the index and in /metrics: deployment/unique id."""
    return f"{replica_id.deployment_id.name}/{replica_id.unique_id}"


def index_name(app: str, pool: str) -> str:
    return f"{app}-{pool}-kv-index"


KVIndexActor = ray.remote(num_cpus=0)(KVIndex)


def get_index(name: str, routing: str, block_size: int, load_cost: int | None = None):
    """The pool's index actor, created by whoever asks first (the front, or a replica
    deployed by ``serve deploy``, where no front starts first)."""
    return KVIndexActor.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote(
        routing, block_size, load_cost=load_cost
    )


class KVRequestRouter(RequestRouter):
    """Routes ``generate``/``prefill`` calls by the index's choice (``--routing``)."""

    def initialize_state(self, index: str = "", **_: Any) -> None:
        self._index_name = index
        self._index = None

    def _get_index(self):
        if self._index is None:
            self._index = ray.get_actor(self._index_name, namespace=NAMESPACE)
        return self._index

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hashes = None if pending_request is None else pending_request.kwargs.get("block_hashes")
        if hashes is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        loads = [(k, self.replica_queue_len_cache.get(r.replica_id)) for k, r in by_key.items()]
        try:
            chosen = await self._get_index().choose.remote(hashes, loads)
        except Exception:
            logger.warning("KV index unreachable; routing by load", exc_info=True)
            self._index = None
            return [candidate_replicas]
        return [[by_key[chosen]], candidate_replicas]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        try:
            self._get_index().remove.remote(replica_key(replica_id))
        except Exception:
            pass


class EngineReplica:
    """One engine in a Ray Serve replica (``role``: "engine", "prefill" or "decode").

    As ``tokenmill serve``, two processes: the replica's (the Ray worker: streaming,
    detokenising, reporting) and the engine core's, spawned by it (core_loop.py), so
    that Ray's threads never hold the GIL the model steps need."""

    async def __init__(
        self,
        engine_args: EngineArgs,
        index: str,
        threads: int,
        role: str = "engine",
        routing: str = "kv",
        load_cost: int | None = None,
    ) -> None:
        import functools
        import os

        from tokenmill.core_process import run_engine_core
        from tokenmill.engine.api.core_client import AsyncCoreClient
        from tokenmill.engine.core.load_price import LoadPrice, LoadPricer
        from tokenmill.model.paths import resolve_model_path
        from tokenmill.model.tokenizer import load_tokenizer

        os.environ["OMP_NUM_THREADS"] = str(threads)  # the core's torch threads (Ray set 1 for this actor)
        self.role = role
        tokenizer = load_tokenizer(resolve_model_path(engine_args.load.model))
        self.engine = AsyncCoreClient(functools.partial(run_engine_core, engine_args), tokenizer)
        self.name = replica_key(serve.get_replica_context().replica_id)
        self.pricer: LoadPricer | None = None  # None: the index's fixed price, or its default
        if routing == "kv" and load_cost is None:  # before start_kv_events: the index never hears of its blocks
            try:
                self.pricer = LoadPricer(LoadPrice(**await self.engine.measure_load_price()))
                logger.info(
                    "replica %s: a request in flight costs %d prompt tokens (%s)",
                    self.name,
                    self.pricer.tokens,
                    self.pricer.measured,
                )
            except Exception:
                logger.warning("could not measure the load price; the router's default applies", exc_info=True)
        await self.engine.start_kv_events()
        self.lora_roots = await self.engine.lora_hash_roots()
        self.index = get_index(index, routing, self.engine.info.block_size, load_cost)
        self._report_lock = threading.Lock()  # events are taken and sent in order
        self._imported = (0, 0.0)  # blocks received and seconds taken, not reported yet
        await self._report(reset=True)
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_periodically, name="tokenmill-kv-report", daemon=True)
        self._reporter.start()

    def info(self) -> dict[str, Any]:
        """What the front needs: the context length, the block size, the adapters' hash roots."""
        return {**dataclasses.asdict(self.engine.info), "lora_roots": self.lora_roots, "replica": self.name}

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
        kv: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. ``kv``: blocks a prefill replica computed
        (``{"hashes": [...], "data": [ObjectRef]}``), imported into the prefix cache first;
        any that fail to arrive are recomputed."""
        if kv is not None:
            await self._import(kv)
        remaining = params.n
        async for out in self.engine.generate(request_id, prompt, params, lora):
            if out.finished:
                remaining -= 1
                if self.pricer is not None:
                    self.pricer.request_finished(len(out.token_ids))  # one sequence's answer
                if remaining == 0:  # the index hears of this request's blocks before its caller does
                    await self._report(finished=[(len(out.prompt_token_ids), out.num_cached_tokens)])
            # Deltas only: the sequence's whole record (and the tokenizer it holds) stays
            # here; the front rebuilds it from the deltas (front.OutputRecord).
            yield replace(out, outputs=[replace(c, _source=None) for c in out.outputs])

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
        block_hashes: Sequence[bytes] = (),
    ) -> dict:
        """Compute the prompt's KV (one token generated, then dropped) and put its full
        blocks in the object store: ``{"hashes", "data": [ObjectRef], "nbytes", "seconds"}``."""
        import numpy as np

        loop = asyncio.get_running_loop()
        start = loop.time()
        one = SamplingParams(max_tokens=1, temperature=0.0, seed=params.seed)
        async for _ in self.engine.generate(request_id, prompt, one, lora):
            pass
        n, data = await self.engine.export_kv(list(block_hashes))
        await self._report()
        if n == 0:
            return {"hashes": [], "data": [], "nbytes": 0, "seconds": loop.time() - start}
        array = np.frombuffer(data, dtype=np.uint8)  # Ray keeps numpy arrays in shared memory on a node
        return {
            "hashes": list(block_hashes[:n]),
            "data": [ray.put(array)],
            "nbytes": array.nbytes,
            "seconds": loop.time() - start,
        }

    async def _import(self, kv: dict) -> None:
        if not kv.get("hashes"):
            return
        start = time.perf_counter()
        try:
            array = await kv["data"][0]
            n = await self.engine.import_kv(kv["hashes"], array.tobytes())
            with self._report_lock:
                self._imported = (self._imported[0] + n, self._imported[1] + time.perf_counter() - start)
            if n < len(kv["hashes"]):
                logger.info("imported %d of %d blocks (too few free); the rest is recomputed", n, len(kv["hashes"]))
        except Exception:
            logger.warning("KV blocks from the prefill replica did not arrive; recomputing", exc_info=True)

    def _report(self, finished: Sequence[tuple[int, int]] = (), reset: bool = False):
        with self._report_lock:
            events = self.engine.take_kv_events()
            snap = self.engine.snapshot()
            imported, self._imported = self._imported, (0, 0.0)
            price = None if self.pricer is None else self.pricer.tokens
            return self.index.report.remote(
                self.name, events, snap.num_running, snap.num_waiting, snap, list(finished), reset, imported, price
            )

    def _report_periodically(self) -> None:
        while not self._stop.wait(REPORT_PERIOD_S):
            try:
                self._report()
            except Exception:
                logger.debug("KV report failed", exc_info=True)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.engine.shutdown()


def deployment(
    name: str,
    engine_args: EngineArgs,
    index: str,
    replicas: int,
    threads: int,
    cpus: float,
    gpus: float,
    routing: str,
    max_replicas: int | None = None,
    target_ongoing_requests: float = 8.0,
    load_cost: int | None = None,
):
    """One pool of engine replicas, bound (``name``: its role, "engine", "prefill" or "decode";
    ``load_cost``: kv routing's fixed price of load, None to measure it on each replica)."""
    from ray.serve.config import RequestRouterConfig

    scaling: dict[str, Any] = {"num_replicas": replicas}
    if max_replicas is not None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
                "upscale_delay_s": 2.0,
                "downscale_delay_s": 60.0,
            }
        }
    return (
        serve.deployment(EngineReplica, name=name)
        .options(
            max_ongoing_requests=1024,  # the engine batches and queues; Serve's default (5) would queue in the router
            ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
            request_router_config=RequestRouterConfig(
                request_router_class="tokenmill.replicas.ray_serve:KVRequestRouter",
                request_router_kwargs={"index": index},
                request_routing_stats_period_s=60.0,  # the index carries what routing needs
            ),
            health_check_period_s=2.0,
            graceful_shutdown_timeout_s=5.0,
            **scaling,
        )
        .bind(replace(engine_args), index, threads, name, routing, load_cost)
    )
