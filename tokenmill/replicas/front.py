"""The server's engine front when the engines are Ray Serve replicas.

``RayReplicaFront`` is what the HTTP app streams from (a ``StreamingFront``, like the
threaded engine and the core-process client): it hashes each prompt into the block
hashes the replicas' prefix caches use, and calls the deployment through a Ray Serve
handle, whose ``KVRequestRouter`` picks the replica. With disaggregated serving a
request first goes to a prefill replica (its prompt's KV computed and put in Ray's
object store), then to a decode replica with a reference to those blocks.

Failures: a replica that dies before a request's first output is retried on another
one (twice at most); a stream it dies in ends with ``RequestFailedError`` (the app's
error event). Ray Serve restarts the replica.

Ray and Serve are started here (a local cluster, or the one ``RAY_ADDRESS`` names) and
stopped by ``shutdown``; ``ray[serve]`` is an optional extra (``tokenmill[ray]``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.configuration.config import EngineArgs
from tokenmill.configuration.serving_config import ReplicaConfig
from tokenmill.engine.api.streams import RequestFailedError
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import InvalidRequestError, TokenmillError, UnknownModelError
from tokenmill.pooling_params import PoolingParams
from tokenmill.replicas.index import RoutingStats, merge_snapshots
from tokenmill.replicas.replica_router import prompt_block_hashes
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
APP = "tokenmill"
RETRIES = 2  # a request whose replica died before its first output is sent again this many times


def import_ray():
    """ray and ray.serve, or an error that says how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise TokenmillError(
            "engine replicas run on Ray Serve, which is not installed: "
            "pip install 'tokenmill[ray]' (or pip install 'ray[serve]')"
        ) from None
    return ray, serve


@dataclass
class OutputRecord:
    """A sequence's output rebuilt from the deltas a replica streams (the replica keeps
    the full record; sending it with every token would cost O(n) per token)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] | None = None
    top_logprobs: list | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.delta_token_ids)
        self.text += out.delta_text
        if out.delta_logprobs is not None:
            if self.logprobs is None or self.top_logprobs is None:
                self.logprobs, self.top_logprobs = [], []
            self.logprobs.extend(out.delta_logprobs)
            self.top_logprobs.extend(out.delta_top_logprobs or [[] for _ in out.delta_logprobs])

    def text_prefix(self, num_chars: int) -> str:
        return self.text[:num_chars]


@dataclass
class DisaggregationStats:
    """KV moved from prefill to decode replicas."""

    requests: int = 0
    blocks: int = 0
    bytes: int = 0
    prefill_seconds: float = 0.0
    fallbacks: int = 0  # prefills that failed: the decode replica computed the prompt


class RayReplicaFront:
    """Streams requests from pools of engine replicas through their Ray Serve handles
    (``handles``: "engine", or "prefill" and "decode"; ``indexes``: each pool's index
    actor). ``on_shutdown`` stops what was started for it (Serve, Ray). A
    ``StreamingFront`` (engine/api/streams.py) that never dies: Serve replaces a dead replica,
    and the requests it had fail alone."""

    def __init__(
        self,
        handles: dict[str, Any],
        indexes: dict[str, Any],
        tokenizer,
        info: dict,
        on_shutdown: Callable[[], None] = lambda: None,
    ) -> None:
        import ray

        self._ray = ray
        self._handles, self._indexes = handles, indexes
        self.disaggregated = "prefill" in handles
        self.tokenizer = tokenizer
        self.info = info
        self.block_size = info["block_size"]
        self.lora_roots: dict[str, bytes | None] = info["lora_roots"]
        self.disaggregation = DisaggregationStats()
        self._on_shutdown = on_shutdown
        self._view: tuple[dict[str, EngineSnapshot], dict[str, RoutingStats]] = ({}, {})
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="tokenmill-replica-view", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        ids = list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        if lora is not None and lora not in self.lora_roots:
            raise UnknownModelError(f"the model {lora!r} does not exist", param="model")
        hashes = prompt_block_hashes(ids, self.block_size, self.lora_roots.get(lora))
        kv = None
        if self.disaggregated and hashes and isinstance(params, SamplingParams) and params.prompt_logprobs is None:
            kv = await self._prefill(request_id, ids, params, lora, hashes)
        handle = self._handles["decode" if self.disaggregated else "engine"]
        remaining, attempt = params.n, 0
        records: dict[int, OutputRecord] = {}
        while True:
            gen = handle.options(stream=True).generate.remote(
                request_id=request_id, prompt=ids, params=params, lora=lora, block_hashes=hashes, kv=kv
            )
            sent = False
            try:
                async for out in gen:
                    sent = True
                    if out.error is not None:
                        raise RequestFailedError(f"request {request_id} failed: {out.error}")
                    for c in out.outputs:
                        record = records.setdefault(c.index, OutputRecord())
                        record.add(out)
                        c._source = record
                    yield out
                    if out.finished:
                        remaining -= 1
                        if remaining == 0:
                            return
                raise RequestFailedError(f"request {request_id}: the replica's stream ended early")
            except self._ray.exceptions.RayActorError as e:
                if sent or attempt >= RETRIES:
                    raise RequestFailedError(
                        f"request {request_id}: its engine replica died ({type(e).__name__})"
                    ) from e
                attempt += 1
                logger.warning("replica died before request %s started; retrying (%d)", request_id, attempt)
            except self._ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, Exception) else e
                raise cause from None
            finally:
                if remaining:  # left early (or failed): the replica aborts the request
                    gen.cancel()

    async def _prefill(
        self, request_id: str, ids: list[int], params: SamplingParams, lora: str | None, hashes: list[bytes]
    ) -> dict | None:
        """The prompt's KV from a prefill replica (None: it failed; the decode replica
        will compute the prompt itself)."""
        try:
            kv = await self._handles["prefill"].prefill.remote(
                request_id=f"{request_id}-prefill", prompt=ids, params=params, lora=lora, block_hashes=hashes
            )
        except self._ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, InvalidRequestError):
                raise e.cause from None
            logger.warning("prefill of %s failed; decoding from scratch", request_id, exc_info=True)
            self.disaggregation.fallbacks += 1
            return None
        except Exception:
            logger.warning("prefill of %s failed; decoding from scratch", request_id, exc_info=True)
            self.disaggregation.fallbacks += 1
            return None
        d = self.disaggregation
        d.requests += 1
        d.blocks += len(kv["hashes"])
        d.bytes += kv["nbytes"]
        d.prefill_seconds += kv["seconds"]
        return kv

    def abort(self, request_id: str) -> None:
        """Requests are aborted by cancelling their stream (``generate``'s caller leaving)."""

    async def add_lora(self, name: str, path: str) -> None:
        raise InvalidRequestError(
            "adapters are loaded at start with replicas (--lora-modules); runtime loading "
            "is not supported with --data-parallel-size",
            param="lora_name",
        )

    async def remove_lora(self, name: str) -> None:
        await self.add_lora(name, "")

    # ------------------------------------------------------------------ gauges

    def _poll(self) -> None:
        """Every replica's snapshot and the routers' counters, from the indexes (so
        that /metrics never waits on Ray)."""
        while not self._stopped.wait(1.0):
            try:
                snaps, stats = {}, {}
                for role, index in self._indexes.items():
                    s, r = self._ray.get(index.view.remote(), timeout=5)
                    snaps.update(s)
                    stats[role] = r
                self._view = (snaps, stats)
            except Exception:
                logger.debug("replica view failed", exc_info=True)

    def replica_view(self) -> tuple[dict[str, EngineSnapshot], dict[str, RoutingStats], DisaggregationStats | None]:
        """Each live replica's last snapshot, each pool's routing counters, and (with
        disaggregated serving) the KV moved from prefill to decode replicas."""
        return (*self._view, self.disaggregation if self.disaggregated else None)

    async def start_step_trace(self) -> bool:
        return False  # the replicas' steps are theirs: no live view of them here

    async def stop_step_trace(self) -> None:
        pass

    def take_step_trace(self) -> list[dict]:
        return []

    async def block_states(self) -> bytes | None:
        return None

    @property
    def death(self) -> BaseException | None:
        return None

    @property
    def is_dead(self) -> bool:
        return False

    def snapshot(self) -> EngineSnapshot:
        snaps = self._view[0]
        if not snaps:
            return EngineSnapshot(loras={name: "" for name in self.lora_roots})
        return merge_snapshots(list(snaps.values()))

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self._view[0].values())

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stopped.set()
        self._on_shutdown()


def start_replicas(engine_args: EngineArgs, config: ReplicaConfig, start_timeout: float = 600.0):
    """Ray (the cluster RAY_ADDRESS names, else a local one), Serve without its HTTP
    proxy (our app is the front), each pool's index and deployment: the front, the
    tokenizer, the context length and the model's path, as ``serve`` needs them."""
    from pathlib import Path

    from tokenmill.model.paths import resolve_model_path
    from tokenmill.model.tokenizer import load_tokenizer

    check_replica_options(engine_args, config)
    ray, serve = import_ray()
    from tokenmill.replicas import ray_serve

    tokenizer = load_tokenizer(resolve_model_path(engine_args.load.model))
    started_ray = not ray.is_initialized()
    if started_ray:
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, namespace=ray_serve.NAMESPACE, log_to_driver=False)
        else:  # Ray starts workers at nice 15 (its driver first): the replicas are the work here
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(
                address="local",
                num_cpus=os.cpu_count() or 1,
                include_dashboard=False,
                namespace=ray_serve.NAMESPACE,
                object_store_memory=512 << 20,
                log_to_driver=False,
            )
    indexes: dict[str, Any] = {}

    def stop() -> None:
        """Serve, the indexes and (if started here) Ray, each given a bounded time: a
        cluster whose raylet has died would make ``serve.shutdown`` wait for ever."""

        def stop_serve() -> None:
            try:
                serve.shutdown()
            except Exception:
                logger.debug("serve.shutdown failed", exc_info=True)
            for index in indexes.values():
                try:
                    ray.kill(index)
                except Exception:
                    pass

        stopper = threading.Thread(target=stop_serve, name="tokenmill-serve-shutdown", daemon=True)
        stopper.start()
        stopper.join(30)
        if stopper.is_alive():
            logger.warning("Ray Serve did not shut down within 30 s; leaving it")
        if started_ray:
            ray.shutdown()

    try:
        serve.start(proxy_location="Disabled")
        cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        node_cpus = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]), default=cores)
        pools = replica_pools(config)
        total = sum(pools.values())
        threads = config.replica_threads or max(1, cores // total)
        cpus = config.replica_cpus if config.replica_cpus is not None else min(threads, cores / total, node_cpus)
        handles = {}
        for role, n in pools.items():
            name = ray_serve.index_name(APP, role)
            indexes[role] = ray_serve.get_index(
                name, config.routing, engine_args.cache.block_size, config.fixed_load_cost
            )
            app = ray_serve.deployment(
                role,
                engine_args,
                name,
                n,
                threads,
                cpus,
                config.replica_gpus,
                config.routing,
                config.max_replicas if role == "engine" else None,
                config.target_ongoing_requests,
                config.fixed_load_cost,
            )
            start = time.perf_counter()
            (handles[role],) = serve.run_many(
                [serve.RunTarget(app, name=f"{APP}-{role}", route_prefix=None)], wait_for_applications_running=False
            )
            wait_until_running(
                serve, f"{APP}-{role}", start_timeout, fail_unschedulable=not os.environ.get("RAY_ADDRESS")
            )
            logger.info("%d %s replica(s) running after %.1f s", n, role, time.perf_counter() - start)
        info = handles["decode" if config.disaggregated else "engine"].info.remote().result(timeout_s=start_timeout)
    except BaseException:
        stop()
        raise
    front = RayReplicaFront(handles, indexes, tokenizer, info, on_shutdown=stop)
    return front, tokenizer, info["max_model_len"], Path(info["model_path"])


def wait_until_running(serve, app: str, timeout: float, fail_unschedulable: bool) -> None:
    """Until the application's replicas run (``serve.run`` would wait for ever when they
    cannot be placed). On a cluster of our own (``fail_unschedulable``), replicas that
    Ray cannot schedule are an error after a minute, with Ray's reason; a cluster that
    may autoscale gets the whole ``timeout``."""
    start = time.perf_counter()
    said = ""
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        messages = "; ".join(d.message for d in (status.deployments.values() if status else ()) if d.message)
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise TokenmillError(f"the engine replicas failed to start: {status.message or messages}")
        waited = time.perf_counter() - start
        if messages and messages != said:
            logger.info("waiting for %s: %s", app, messages)
            said = messages
        if waited > timeout or (fail_unschedulable and waited > 60 and "to be scheduled" in messages):
            raise TokenmillError(
                f"the engine replicas did not start within {waited:.0f} s: {messages or 'no reason given'}"
                " (fewer replicas, or --replica-cpus / --replica-gpus the nodes have)"
            )
        time.sleep(0.5)


def replica_pools(config: ReplicaConfig) -> dict[str, int]:
    """Pool -> replicas: decode and prefill (disaggregated), else one "engine" pool."""
    if config.disaggregated:
        return {"decode": config.decode_replicas, "prefill": config.prefill_replicas}
    return {"engine": config.data_parallel_size}


def check_replica_options(engine_args: EngineArgs, config: ReplicaConfig) -> None:
    if config.disaggregated and engine_args.parallel.world_size > 1:
        raise TokenmillError("disaggregated serving runs one process per replica: drop --tensor/pipeline-parallel-size")
    if config.disaggregated and engine_args.speculative is not None and engine_args.speculative.method == "draft":
        raise TokenmillError("disaggregated serving cannot ship a draft model's KV: use another --speculative method")
