"""What one request in flight on this engine costs a newcomer, in prompt tokens: the
price a KV-aware router (``replicas.replica_router.KVAwareRouter``) puts on a replica's load,
measured once on the replica's own engine when it starts.

The router weighs a cached prefix against load, so it needs both in one unit: prompt
tokens to compute. A request already running on a replica shares every decode step
with a newcomer for as long as both run, and each of those steps is longer by what
one more sequence adds to a step. In prompt tokens, one request in flight costs

    price = seq_step_s * shared_steps / prefill_token_s

- ``seq_step_s``: what one more running sequence adds to a decode step: timed decode
  steps of ``batch`` sequences against steps of one, ``(t_B - t_1) / (B - 1)`` (medians);
- ``shared_steps``: the decode steps the two share, what is left of the running
  request's answer: a request is caught on average halfway through its answer, so
  half the mean output length (``DEFAULT_OUTPUT_TOKENS`` until the replica has seen
  ``MIN_FINISHED`` requests end, then its own running mean: ``LoadPricer``);
- ``prefill_token_s``: what one more prompt token adds to a prefill step: a timed
  prefill of P tokens against a decode step of one, ``(t_prefill - t_1) / (P - 1)``.

Clamped to ``PRICE_RANGE``. Why measured: how much a step grows with its batch, against
what a prompt token costs, is the machine's and the model's, and how long answers run
is the workload's. Where batching is nearly free (a GPU: decode steps are bound by
reading the weights) a request in flight costs a newcomer little and the cached prefix
should win; on a CPU each sequence's share of a step (its attention, its logits over
the vocabulary) is measurable, and with long answers load counts for more. The
constant it replaces (128 tokens) moved ~300-token shared-prefix requests of short
answers off the replica that cached them (issue 41).
Not counted: a waiting request's own prompt still to compute (the router does not
know how much of it is cached), and drafts (with speculative decoding on, a step of
one sequence verifies drafts, so ``seq_step_s`` reads low).

The measurement runs on an idle engine, before the router is told of any block
(``start_kv_events``): three requests of random token ids (two prefills of P tokens,
the faster counted, then ``steps`` decode steps of one sequence and of ``batch``
sequences sharing the prompt's blocks), 1.3-1.4 s on the default model on one CPU
thread of a busy 2-core machine. It leaves no trace in the engine's counters: its
steps and its prefix-cache lookups are taken back out. No torch here: it times the
core's own steps.
"""

from __future__ import annotations

import math
import random
import statistics
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tokenmill.engine.stats import StepStats

DEFAULT_OUTPUT_TOKENS = 256  # a guess at a chat answer's length, until the replica has its own mean
MIN_FINISHED = 4  # requests ended before the replica's own mean output length replaces the default guess
PRICE_RANGE = (16, 1024)  # tokens: at least a block's worth (ties go to the idler replica); at most a long prompt
REQUEST_ID = "tokenmill-load-price"


@dataclass(frozen=True)
class LoadPrice:
    """The measured parts of the price (seconds), and what they were measured with."""

    decode_step_s: float  # t_1: a decode step of one sequence
    seq_step_s: float  # what one more running sequence adds to a decode step (may read <= 0 on a noisy machine)
    prefill_token_s: float  # what one more prompt token adds to a prefill step
    prompt_tokens: int  # P, the timed prefill's length (and the decoding sequences' context)
    batch: int  # B, the sequences of the batched decode steps

    def tokens(self, mean_output_tokens: float | None = None) -> int:
        """The price of one request in flight, in prompt tokens, for answers of
        ``mean_output_tokens`` on average (None: ``DEFAULT_OUTPUT_TOKENS``)."""
        shared_steps = (DEFAULT_OUTPUT_TOKENS if mean_output_tokens is None else mean_output_tokens) / 2
        price = max(self.seq_step_s, 0.0) * shared_steps / self.prefill_token_s
        low, high = PRICE_RANGE
        return int(round(min(max(price, low), high)))


@dataclass
class LoadPricer:
    """A replica's price as it runs: the measured parts, and the mean output length of
    the requests it has finished (the steps a newcomer shares depend on the workload)."""

    measured: LoadPrice
    finished: int = 0
    output_tokens: int = 0

    def request_finished(self, output_tokens: int) -> None:
        self.finished += 1
        self.output_tokens += output_tokens

    @property
    def mean_output_tokens(self) -> float | None:
        return self.output_tokens / self.finished if self.finished >= MIN_FINISHED else None

    @property
    def tokens(self) -> int:
        return self.measured.tokens(self.mean_output_tokens)


def measure_load_price(core: EngineCore, prompt_tokens: int = 128, batch: int = 8, steps: int = 8) -> LoadPrice:
    """Time two prefills of ``prompt_tokens`` and ``steps`` decode steps of one sequence
    and of ``batch`` sequences on this idle engine (fewer where its KV cache, context
    or ``max_num_seqs`` are smaller); see the module's docstring for what is made of them."""
    if core.has_unfinished():
        raise RuntimeError("the load price is measured on an idle engine")
    batch = max(2, min(batch, core.config.scheduler.max_num_seqs))
    p = min(prompt_tokens, core.max_model_len - steps - 2)
    while p > 2 and 2 * core.kv.blocks_for(p + steps + 2) + 2 * batch > core.block_pool.num_blocks:
        p //= 2
    if p < 2:
        raise RuntimeError("the engine's KV cache or context is too small to measure a load price on")
    rng = random.Random()  # prompts no cache holds (a prefix-cache hit would time no prefill)
    prompt = [rng.randrange(core.vocab_size) for _ in range(p)]
    with unrecorded(core):
        other = [rng.randrange(core.vocab_size) for _ in range(p)]
        warm_up = _run(core, "warm-up", other, SamplingParams(max_tokens=2, n=2, ignore_eos=True))  # first calls
        single = _run(core, "single", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True, seed=0))
        batched = _run(core, "batched", prompt, SamplingParams(max_tokens=steps + 1, n=batch, ignore_eos=True, seed=0))
    t_1 = _median([s.duration for s in single if not s.num_prefill_tokens and s.num_seqs == 1])
    t_b = _median([s.duration for s in batched if not s.num_prefill_tokens and s.num_seqs == batch])
    # the faster of two prefills of P tokens: the first of its shape pays first calls (and a shared machine, noise)
    per_token = min(_prefill_token_s(warm_up, t_1), _prefill_token_s(single, t_1))
    seq_step = (t_b - t_1) / (batch - 1)
    if not all(math.isfinite(x) for x in (t_1, seq_step, per_token)) or per_token <= 0:
        raise RuntimeError("the load price's timings came out unusable")
    return LoadPrice(decode_step_s=t_1, seq_step_s=seq_step, prefill_token_s=per_token, prompt_tokens=p, batch=batch)


def _run(core: EngineCore, name: str, prompt: list[int], params: SamplingParams) -> list[StepStats]:
    """One request to its end, alone; the stats of its steps (on the core: an offline
    ``Engine``'s output processor never hears of it)."""
    stats = core.step_stats
    before = len(stats)
    core.add_request(f"{REQUEST_ID}-{name}", prompt, params)
    while core.has_unfinished():
        core.run_step()
    return list(stats)[before:]


def _prefill_token_s(steps: list[StepStats], t_1: float) -> float:
    """What one more prompt token adds to a step: the prompt's steps (one sequence, maybe
    several chunks) less a one-token step each, per token beyond one per step."""
    prefill = [s for s in steps if s.num_prefill_tokens and s.num_seqs == 1]
    computed = sum(s.num_prefill_tokens for s in prefill)
    seconds = sum(s.duration for s in prefill)
    slope = (seconds - len(prefill) * t_1) / max(computed - len(prefill), 1)
    return slope if slope > 0 else seconds / max(computed, 1)  # a noisy machine: the average, not the slope


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


@contextmanager
def unrecorded(core: EngineCore) -> Iterator[None]:
    """The measurement's steps, prefix-cache lookups and drafts taken back out of the
    engine's counters: /metrics and the benchmarks see only real requests."""
    steps = len(core.step_stats)
    prefix, spec = deepcopy(core.kv.stats), deepcopy(core.scheduler.spec_stats)
    try:
        yield
    finally:
        while len(core.step_stats) > steps:
            core.step_stats.pop()
        core.kv.stats, core.scheduler.spec_stats = prefix, spec
