"""The engine core: requests, blocks and the step loop's body, as token ids.

One step, top to bottom (``run_step``): the scheduler decides who computes how many
tokens and writes the runner's record of what changed; the runner computes and
samples; the scheduler applies the results (``update_from_output``); each sequence's
new tokens and end go back as a ``SeqDelta`` (plain data). Text is not the core's:
the output processor detokenises, finds stop strings and tells the core to end
those sequences (``finish_stopped``). The offline ``Engine`` (engine.py) runs both
in one process; ``tokenmill serve`` runs this core in a process of its own
(core_loop.py) and the output processor in the API process.

A failure inside the model step is pinned on the request that causes it (by
retrying the step one request at a time): that request ends with finish_reason
"error", the others go on.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenmill.configuration.config import SchedulerConfig, SpeculativeConfig, check_adapter_name
from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.grammar_masks import StructuredOutputManager
from tokenmill.engine.core.kv_disk import DiskTier, DiskTierStats, files_fingerprint
from tokenmill.engine.core.kv_host import HostTier, HostTierStats
from tokenmill.engine.core.kv_manager import KVCacheManager, PrefixCacheStats
from tokenmill.engine.core.kv_tiers import KVTiers
from tokenmill.engine.core.kv_transfer import KVTransfer
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.core.step_trace import StepTracer, step_kinds
from tokenmill.engine.model_input import GrammarMasks, ModelInput, ModelOutput, SampledToken
from tokenmill.engine.outputs import SeqDelta
from tokenmill.engine.sequences import sequence_ids, step_params
from tokenmill.engine.stats import ITERATION_TOKEN_BUCKETS, EngineSnapshot, SpecDecodeStats, StepStats
from tokenmill.errors import EngineDeadError, InvalidRequestError, UnknownModelError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import KVEviction, SamplingParams
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)
STEP_STATS_KEPT = 100_000


class Runner(Protocol):
    def execute(self, batch: ModelInput, grammar: GrammarMasks | None = None) -> ModelOutput: ...
    def load_lora(self, name: str, path: str) -> object: ...  # read and check; changes nothing
    def add_lora(self, name: str, path: str, loaded: object | None = None) -> None: ...


class TokenizerInfo(Protocol):
    """What the core knows of the tokenizer: how many ids there are, which end a sequence."""

    stop_token_ids: frozenset[int]

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class EngineConfig:
    """The engine's part of the configuration, with the derived block count."""

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    max_loras: int | None = None  # None: LoRA adapters are off
    sliding_window: int | None = None  # the model's attention window: blocks before it are freed
    record_kv_events: bool = False  # log the prefix cache's changes for a replica router (kv_transfer.take_events)


@dataclass(frozen=True)
class LoRAInfo:
    """A served adapter: its id and its files (names, sizes, times) seed its requests' block
    hashes (``root``): a re-added adapter gets a new id, and another adapter under an id a
    restarted engine reuses has other files, so no block computed with other weights is ever
    reused, in the pool or from the disk tier."""

    name: str
    path: str
    id: int
    root: bytes = b""


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        tokenizer: TokenizerInfo,
        config: EngineConfig,
        grammars: GrammarCompiler | None = None,
        disk_tier: DiskTier | None = None,
        host_tier: HostTier | None = None,
    ) -> None:
        self.runner = runner
        self.vocab_size = tokenizer.vocab_size
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching, config.record_kv_events)
        self.kv = KVCacheManager(self.block_pool, config.block_size, config.sliding_window)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            config.max_model_len,
            tokenizer.stop_token_ids,
            config.speculative,
            config.max_loras or 1 << 30,
        )
        self.loras: dict[str, LoRAInfo] = {}  # adapters requests may name
        self._lora_names_held: set[str] = set()  # names of adapters being read (new_lora_name)
        self._lora_ids = itertools.count(1)
        self.lora_requests: Counter[str] = Counter()  # requests per adapter since start
        self.structured = StructuredOutputManager(grammars)
        self._requests: dict[str, list[Request]] = {}  # request id -> its live sequences (n of them)
        self._sequences: dict[str, Request] = {}  # sequence id -> its sequence, while its request lives
        self.num_step_retries = 0  # steps that failed as a batch and were re-run request by request
        # The most recent steps' stats (bounded: a server runs for days).
        self._step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # steps by their tokens (vLLM's histogram)
        self.iteration_tokens_sum = 0
        self.tracer = StepTracer(self.scheduler, self.block_pool)  # each step's batch, for a live view
        self.kv_transfer = KVTransfer(self.block_pool, runner)  # prefix-cache events and KV for replicas
        # the prefix cache's tiers below the pool (host memory, disk): blocks stored as
        # computed, read back on a miss
        self.tiers = None
        if host_tier is not None or disk_tier is not None:
            self.tiers = KVTiers(self.block_pool, runner, host_tier, disk_tier)
            self.kv.lower = self.tiers.load

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        grammar: CompiledGrammar | None = None,
        lora: str | None = None,
    ) -> list[Request]:
        """Queue a request; n > 1 becomes n sequences sharing the prompt's KV blocks.
        ``PoolingParams``: an embedding request, one sequence that samples nothing.

        A request with ``params.structured`` gets its grammar compiled here unless the
        caller compiled it already (``structured.compile``, off the step loop)."""
        pooling = params if isinstance(params, PoolingParams) else None
        client = params.client
        if pooling is not None:
            if not getattr(self.runner, "scores_prompts", True):
                raise InvalidRequestError(
                    "embeddings are not supported with tensor or pipeline parallelism", param="pooling"
                )
            params = step_params(pooling)
        seq_ids = sequence_ids(request_id, params.n)
        if request_id in self._requests or any(sid in self._sequences for sid in seq_ids):
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        ids = list(prompt_ids)
        self._validate_prompt(ids, params.kv_eviction is not None and params.kv_eviction.streams)
        params = self._with_model_facts(params)
        adapter = None
        if lora is not None:
            adapter = self.loras.get(lora)
            if adapter is None:
                known = ", ".join(sorted(self.loras)) or "none (start with --enable-lora --lora-modules name=path)"
                raise UnknownModelError(f"unknown LoRA adapter {lora!r}; served: {known}", param="model")
        if params.structured is None:
            grammar = None
        elif grammar is None:
            grammar = self.structured.compile(params.structured)
        if lora is not None:
            self.lora_requests[lora] += 1
        reqs = []
        for i, sid in enumerate(seq_ids):
            seed = None if params.seed is None else params.seed + i
            req = Request(
                request_id=sid,
                prompt_token_ids=ids,
                params=replace(params, n=1, seed=seed) if params.n > 1 else params,
                pooling=pooling,
                parent_id=request_id,
                index=i,
                fork_of=seq_ids[0] if i > 0 and params.kv_eviction is None else None,  # evicting: keys its own
                grammar=grammar.matcher() if grammar is not None else None,
                lora_name=lora,
                hash_root=self._hash_root(lora, params.cache_salt),
                client=client,
            )
            self.scheduler.add(req)
            self._sequences[sid] = req
            reqs.append(req)
        self._requests[request_id] = reqs
        return reqs

    def _with_model_facts(self, params: SamplingParams) -> SamplingParams:
        """The parameters checked against the vocabulary, with the model's end-of-sequence
        ids for min_tokens to hold back."""
        vocab = self.vocab_size
        bad = next((t for t in params.token_ids_named()[len(params.stop_token_ids) :] if t >= vocab), None)
        if bad is not None:
            param = (
                "allowed_token_ids"
                if bad in (params.allowed_token_ids or ())
                else "logit_bias"
                if bad in dict(params.logit_bias)
                else "bad_words"
            )
            raise InvalidRequestError(f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param=param)
        if params.priority and not self.scheduler.by_priority:  # as vLLM: never silently first come, first served
            raise InvalidRequestError(
                f"got priority {params.priority}, but priority scheduling is not enabled "
                "(start the server with --scheduling-policy priority)",
                param="priority",
            )
        if params.prompt_logprobs is not None and not getattr(self.runner, "scores_prompts", True):
            raise InvalidRequestError(
                "prompt_logprobs is not supported with tensor or pipeline parallelism", param="prompt_logprobs"
            )
        if params.kv_eviction is not None:
            self._check_eviction(params.kv_eviction)
        if params.min_tokens and not params.ignore_eos and not params.eos_token_ids:
            params = replace(params, eos_token_ids=tuple(sorted(self.scheduler.eos_token_ids)))
        held = set(params.eos_token_ids) | set(params.stop_token_ids) if params.min_tokens else set()
        if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= held:
            raise InvalidRequestError(
                "allowed_token_ids holds only end-of-sequence or stop ids, which min_tokens "
                "holds back: nothing could be sampled",
                param="allowed_token_ids",
            )
        return params

    def _check_eviction(self, ev: KVEviction) -> None:
        """A request's ``KVEviction`` fits this engine: keys that can move (no sliding window, no
        position-dependent RoPE, one process), and its budget within the context and the pool."""
        if not getattr(self.runner, "shifts_keys", False):
            raise InvalidRequestError(
                "kv_eviction is not supported here: it needs a model whose cached keys can move to other "
                "positions (no sliding window, no LongRoPE) on one process (no tensor or pipeline parallelism)",
                param="kv_eviction",
            )
        bs = self.config.block_size
        kept = f"sinks {ev.sink_tokens(bs)}, window {ev.window}, stride {ev.stride(bs)}" if ev.streams else ""
        held = (ev.budget(bs) if ev.streams else ev.window) + bs  # and a block for the step's new token
        if held > self.config.max_model_len or self.kv.blocks_for(held) > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"kv_eviction keeps up to {held} tokens' K/V ({kept or f'window {ev.window}'}, a block): more "
                f"than the context window ({self.config.max_model_len}) or the KV pool "
                f"({self.block_pool.num_blocks * bs} tokens) holds; use a smaller window",
                param="kv_eviction",
            )

    def _validate_prompt(self, ids: list[int], streams: bool = False) -> None:
        """A prompt the engine can serve: tokens of the vocabulary, room for one more token in
        the context and in the pool (a streaming request's cache is bounded by its budget)."""
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed", param="prompt")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        if streams:
            return  # its budget is checked against the context and the pool (_check_eviction)
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens but the context window is {self.config.max_model_len} tokens "
                "(it must leave room for at least one generated token)",
                param="prompt",
            )
        needed = self.kv.blocks_for(len(ids) + 1)
        if needed > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache has only "
                f"{self.block_pool.num_blocks}; raise kv_cache_memory",
                param="prompt",
            )

    def load_lora(self, name: str, path: str) -> object:
        """Read and check an adapter without serving it (safe off the engine's thread)."""
        check_adapter_name(name)
        if self.config.max_loras is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with enable_lora (--enable-lora)")
        return self.runner.load_lora(name, path)

    def add_lora(self, name: str, path: str, loaded: object | None = None) -> LoRAInfo:
        """Serve an adapter (read and checked now unless ``loaded`` by ``load_lora``:
        LoRAError names what is wrong); a name already served is replaced, for requests
        that arrive from now on."""
        check_adapter_name(name)
        if loaded is None:
            loaded = self.load_lora(name, path)
        self.runner.add_lora(name, path, loaded)
        lora_id = next(self._lora_ids)
        info = LoRAInfo(name, str(path), lora_id, b"lora:%d:" % lora_id + files_fingerprint(path))
        self.loras[name] = info
        logger.info("LoRA adapter %s served from %s", name, path)
        return info

    @contextmanager
    def new_lora_name(self, name: str) -> Iterator[None]:
        """Hold a name for an adapter being read (a server's runtime load): a name served
        or already held is refused, so of concurrent loads of one name exactly one goes on."""
        if name in self.loras or name in self._lora_names_held:
            raise InvalidRequestError(f"a model named {name!r} is already served", param="lora_name")
        self._lora_names_held.add(name)
        try:
            yield
        finally:
            self._lora_names_held.discard(name)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter: new requests naming it are refused; running ones finish."""
        if self.loras.pop(name, None) is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}", param="lora_name")
        logger.info("LoRA adapter %s unloaded", name)

    @property
    def lora_usage(self) -> tuple[list[str], list[str]]:
        """Adapters of the running and of the waiting requests (for metrics)."""
        running = sorted({r.lora_name for r in list(self.scheduler.running) if r.lora_name})
        waiting = sorted({r.lora_name for r in list(self.scheduler.waiting) if r.lora_name})
        return running, waiting

    def abort(self, request_id: str) -> list[str]:
        """End a request (all its n sequences) now and free everything it holds; returns
        the ids of the sequences it ended."""
        reqs = self._forget(request_id)
        ending = [(r.request_id, "abort") for r in reqs if not r.finished]
        for req in reqs:
            self.scheduler.finish(req, "abort")
        self.tracer.ended(ending)
        return [r.request_id for r in reqs]

    def _forget(self, request_id: str) -> list[Request]:
        reqs = self._requests.pop(request_id, [])
        for r in reqs:
            self._sequences.pop(r.request_id, None)
        return reqs

    def finish_stopped(self, seq_id: str, stop_string: str) -> None:
        """The output processor found a stop string in this sequence's text: end it."""
        req = self._sequences.get(seq_id)
        if req is None:  # ended meanwhile (aborted, or by a token of the step that found the string)
            return
        self.scheduler.finish(req, "stop", stop_string)
        self.tracer.ended([(seq_id, "stop")])
        if all(r.finished for r in self._requests.get(req.parent_id, ())):
            self._forget(req.parent_id)
        self._drop_if_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------- step

    def run_step(self) -> list[SeqDelta]:
        """One step: schedule, compute, apply; what it did to each sequence, as plain data."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        for s in sched.seqs:
            s.request.first_scheduled = s.request.first_scheduled or t0
        kinds = step_kinds(sched) if self.tracer.on else None  # before the update moves the counts
        masks = self.structured.start_masks(sched)  # beside the step's record, not in it
        try:
            result = self._execute(sched.model_input, masks)
        finally:  # the mask thread moves matchers: it must be done before anyone else does
            if masks is not None:
                masks.future.exception()
        updates = self.scheduler.update_from_output(sched, result)
        if self.tiers is not None:
            self.tiers.store(self.kv.take_newly_cached())
        deltas = [_delta(u.request, u.new_tokens, u.error) for u in updates]
        for u in updates:  # a request is gone once all its n sequences are
            if u.request.finished and all(r.finished for r in self._requests.get(u.request.parent_id, ())):
                self._forget(u.request.parent_id)
        if sched.seqs:
            self._step_stats.append(self._stats(sched, t0))
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, sched.num_tokens)] += 1
            self.iteration_tokens_sum += sched.num_tokens
        if kinds is not None:
            self.tracer.stepped(sched, kinds, updates, t0)
        self._drop_if_idle()
        return deltas

    def close(self) -> None:
        """Write what the KV disk tier has queued (the next engine on its directory starts with it)."""
        if self.tiers is not None:
            self.tiers.close()

    def block_states(self) -> bytes:
        """One byte per KV block (block_pool.block_states): free, cached, used, shared, hit."""
        return self.block_pool.block_states()

    def _drop_if_idle(self) -> None:
        """Idle now: let the runner drop what finished (no later step would tell it)."""
        if not self.has_unfinished():
            self._execute(self.scheduler.runner_sync.drops())

    def _execute(self, batch: ModelInput, masks: GrammarMasks | None = None) -> ModelOutput:
        """Run the step; on failure, run it one request at a time to find the culprit.

        Retrying is safe: K/V written for the same positions are the same values,
        block copies read blocks that no step has written since, and the runner
        applies the same deltas idempotently and commits only after a success.
        """
        if not batch.scheduled:
            if batch.finished_request_ids or batch.preempted_request_ids:  # let the runner drop what it holds
                self.runner.execute(batch)
            return ModelOutput()
        try:
            return self.runner.execute(batch, masks)
        except EngineDeadError:
            raise  # the runner cannot go on at all (a worker of a split model died)
        except Exception as e:
            if len(batch.scheduled) == 1:
                logger.exception("model step failed for %s", batch.scheduled[0].request_id)
                return ModelOutput(failed={batch.scheduled[0].request_id: f"{type(e).__name__}: {e}"})
        self.num_step_retries += 1
        logger.warning("a step of %d requests failed; retrying one request at a time", len(batch.scheduled))
        merged = ModelOutput()
        for s in batch.scheduled:
            try:
                out = self.runner.execute(batch.only(s.request_id), masks)
            except EngineDeadError:
                raise
            except Exception as e:
                logger.exception("model step failed for %s", s.request_id)
                merged.failed[s.request_id] = f"{type(e).__name__}: {e}"
                continue
            merged.merge(out)
        return merged

    def _stats(self, sched: SchedulerOutput, t0: float) -> StepStats:
        decode = sum(
            s.num_new_tokens
            for s in sched.seqs
            if s.spec_token_ids or (s.num_new_tokens == 1 and s.request.output_token_ids)
        )
        running = self.scheduler.running
        return StepStats(
            time=t0,
            duration=time.perf_counter() - t0,
            num_seqs=len(sched.seqs),
            num_decode_tokens=decode,
            num_prefill_tokens=sched.num_tokens - decode,
            num_preempted=len(sched.preempted),
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_pool.num_used,
            kv_blocks_free=self.block_pool.num_free,
            kv_blocks_cached=self.block_pool.num_cached_free,
            kv_tokens_held=sum(r.num_computed_tokens for r in running),
            kv_slots_held=sum(len(r.block_ids) - r.num_freed_blocks for r in running) * self.config.block_size,
        )

    # ------------------------------------------------- read-only views for callers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def kv_usage(self) -> float:
        """Share of KV blocks held by requests (cached free blocks count as free)."""
        return self.block_pool.num_used / self.block_pool.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv.stats

    def _hash_root(self, lora: str | None, salt: str | None) -> bytes | None:
        """What seeds a request's block hashes: its adapter's root, and its cache_salt (vLLM's),
        so that requests share cached blocks only with those of the same adapter and salt."""
        root = None if lora is None else self.lora_hash_root(lora)
        if salt is None:
            return root
        return hashlib.blake2b((root or b"") + b"|salt|" + salt.encode(), digest_size=16).digest()

    def lora_hash_root(self, name: str) -> bytes | None:
        """The root of an adapter's block-hash chain (None: the base model's), for a
        router hashing prompts as this engine does (``replicas/replica_router.prompt_block_hashes``)."""
        info = self.loras.get(name)
        return None if info is None else info.root

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.spec_stats

    def reset_spec_decode_stats(self) -> None:
        self.scheduler.spec_stats = SpecDecodeStats()

    @property
    def step_stats(self) -> deque[StepStats]:
        """Stats of the most recent steps (at most STEP_STATS_KEPT); ``clear()`` to start afresh."""
        return self._step_stats

    def snapshot(self) -> EngineSnapshot:
        running, waiting = self.lora_usage if self.config.max_loras is not None else ([], [])
        prefix, spec = self.kv.stats, self.scheduler.spec_stats
        tiers = self.tiers
        disk = tiers.disk.stats if tiers is not None and tiers.disk is not None else DiskTierStats()
        host = tiers.host.stats if tiers is not None and tiers.host is not None else HostTierStats()
        return EngineSnapshot(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            num_preemptions=self.num_preemptions,
            num_step_retries=self.num_step_retries,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            kv_disk_bytes=disk.bytes,
            kv_disk_hits=disk.hits,
            kv_disk_stored=disk.stored,
            kv_disk_evicted=disk.evicted,
            kv_host_bytes=host.bytes,
            kv_host_hits=host.hits,
            kv_host_stored=host.stored,
            kv_host_evicted=host.evicted,
            kv_evicted_tokens=self.kv.evicted_tokens,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            iteration_tokens=list(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
            max_loras=self.config.max_loras,
            loras={name: info.path for name, info in self.loras.items()},
            lora_requests=dict(self.lora_requests),
            running_loras=running,
            waiting_loras=waiting,
        )

    @contextmanager
    def borrow_blocks(self, num_blocks: int) -> Iterator[list[int]]:
        """KV blocks for a caller outside the scheduler (scoring a text), given back after."""
        if self.has_unfinished():
            raise RuntimeError("blocks can be borrowed only while no request runs")
        blocks = self.block_pool.allocate(num_blocks)
        try:
            yield blocks
        finally:
            self.block_pool.free(blocks[::-1])

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)


def _delta(req: Request, new_tokens: list[SampledToken], error: str | None) -> SeqDelta:
    return SeqDelta(
        req.request_id,
        new_tokens,
        req.finish_reason,
        req.stop_reason,
        error,
        req.first_scheduled,
        req.num_cached_prompt_tokens,
        req.take_prompt_logprobs(),
        req.embedding,
    )
