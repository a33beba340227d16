"""The price of load a replica reports to the KV-aware router (engine/core/load_price.py):
the formula from its measured parts, and the measurement on a tiny random model's
engine, which leaves the engine as it found it. No assertion about speed: the parts are
whatever this machine measures (bench/ measures speed)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import ToyTokenizer, run_to_completion, tiny_model
from tokenmill.configuration.config import SchedulerConfig
from tokenmill.engine.core.load_price import (
    DEFAULT_OUTPUT_TOKENS,
    MIN_FINISHED,
    PRICE_RANGE,
    REQUEST_ID,
    LoadPrice,
    LoadPricer,
    measure_load_price,
)
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.pipe.messages import MeasureLoadPrice, encode
from tokenmill.engine.sequences import sequence_ids
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def test_the_price_is_what_a_request_in_flight_adds_to_a_newcomers_steps_in_prompt_tokens():
    """seq_step_s * (mean output / 2) / prefill_token_s, clamped; the replica's own mean
    output length replaces the default once it has finished MIN_FINISHED requests."""
    parts = LoadPrice(decode_step_s=0.017, seq_step_s=0.007, prefill_token_s=0.003, prompt_tokens=256, batch=8)
    assert parts.tokens() == round(0.007 * (DEFAULT_OUTPUT_TOKENS / 2) / 0.003)
    assert parts.tokens(24) == round(0.007 * 12 / 0.003) == 28
    low, high = PRICE_RANGE
    assert LoadPrice(0.017, -0.001, 0.003, 256, 8).tokens() == low  # a step that read faster with more sequences
    assert LoadPrice(0.017, 0.5, 0.0001, 256, 8).tokens() == high
    pricer = LoadPricer(parts)
    for _ in range(MIN_FINISHED - 1):
        pricer.request_finished(24)
    assert pricer.mean_output_tokens is None and pricer.tokens == parts.tokens()
    pricer.request_finished(24)
    assert pricer.mean_output_tokens == 24 and pricer.tokens == 28


def tiny_engine(num_blocks: int = 256, caching: bool = True) -> Engine:
    model = tiny_model(0, vocab=64)
    caches = allocate_kv_cache(model.config, num_blocks, 4, torch.float32, CPU)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=200,
        enable_prefix_caching=caching,
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
    )
    return Engine.create(ModelRunner(model, caches, 4, CPU), ToyTokenizer(64), config)


@pytest.mark.parametrize("caching", [True, False])
def test_measured_on_a_tiny_random_model_the_price_is_a_positive_finite_number_of_tokens(caching):
    """A prompt longer than the step budget (prefilled in chunks), with and without the
    prefix cache; afterwards the engine holds no block and no request, and its counters
    (steps, prefix-cache lookups) are as before, so that /metrics shows only real
    requests; a real request runs as on a fresh engine. A busy engine is refused."""
    engine = tiny_engine(caching=caching)
    parts = measure_load_price(engine.core, prompt_tokens=150, batch=4, steps=4)
    assert (parts.prompt_tokens, parts.batch) == (150, 4)
    assert all(math.isfinite(x) for x in (parts.decode_step_s, parts.seq_step_s, parts.prefill_token_s))
    assert parts.decode_step_s > 0 and parts.prefill_token_s > 0
    assert PRICE_RANGE[0] <= parts.tokens() <= PRICE_RANGE[1] and isinstance(parts.tokens(), int)
    assert not engine.has_unfinished() and engine.core.block_pool.num_used == 0
    assert len(engine.core.step_stats) == 0 and engine.core.prefix_cache_stats.queries == 0
    assert engine.core.num_preemptions == 0
    seqs = [
        *sequence_ids(f"{REQUEST_ID}-warm-up", 2),
        f"{REQUEST_ID}-single",
        *sequence_ids(f"{REQUEST_ID}-batched", 4),
    ]
    assert not any(engine.outputs.has_sequence(s) for s in seqs)  # the offline engine's texts never heard of them
    greedy = SamplingParams(temperature=0, max_tokens=6)
    fresh = run_to_completion(tiny_engine(caching=caching), [[1, 2, 3, 4, 5]], greedy)
    after = run_to_completion(engine, [[1, 2, 3, 4, 5]], greedy)
    assert [o.outputs[0].token_ids for o in after.values()] == [o.outputs[0].token_ids for o in fresh.values()]
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        measure_load_price(engine.core)


def test_a_small_kv_cache_gets_a_shorter_prompt_and_the_replicas_core_answers_the_call():
    """An engine whose KV cache holds a few hundred tokens measures with a shorter
    prompt; the engine-core process answers a replica's ``measure_load_price`` call with
    the parts, as plain data that crosses the pipe (msgpack) and rebuilds the price."""
    from tokenmill.engine.core.core_loop import CoreLoop
    from tokenmill.engine.pipe.wire import pack, unpack

    class Pipe:  # what the loop needs of its channel: a reader to start, a send
        def __init__(self) -> None:
            self.sent: list[list] = []

        def start_reader(self, inbox) -> None:
            pass

        def send(self, msg: list) -> None:
            self.sent.append(unpack(pack(msg)))

    engine, pipe = tiny_engine(num_blocks=40), Pipe()
    loop = CoreLoop(engine.core, pipe)
    try:
        loop._command(encode(MeasureLoadPrice(7)))
    finally:
        loop.pool.shutdown()
    ((kind, call_id, error, result, _snapshot),) = pipe.sent
    assert (kind, call_id, error) == ("reply", 7, None)
    parts = LoadPrice(**result)
    assert parts.prompt_tokens < 256 and PRICE_RANGE[0] <= parts.tokens() <= PRICE_RANGE[1]
    assert engine.core.block_pool.num_used == 0
