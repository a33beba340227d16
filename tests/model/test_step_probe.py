"""The step probe of `tokenmill plan --calibrate` (plan/step_model.py) on a tiny random
model's engine: a decode point for every batch and context it was asked for, from every
sweep's steps, prefill points for each prompt length, and the
engine left as it was found; and `plan --measure`'s count of the sequences the KV cache
holds. No assertion about speed (bench/RESULTS.md measures it)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import run_to_completion
from tests.model.test_load_price import tiny_engine
from tokenmill.plan.load_measure import measure_max_seqs
from tokenmill.plan.step_model import REQUEST_ID, probe
from tokenmill.sampling_params import SamplingParams


def test_the_probe_measures_each_batch_and_context_and_leaves_the_engine_idle():
    engine = tiny_engine()
    seen: list[int] = []  # sequences decoding together at each step
    step = engine.step

    def counting_step():
        out = step()
        seen.append(engine.core.step_stats[-1].num_seqs if engine.core.step_stats else 0)
        return out

    engine.step = counting_step
    result = probe(engine, batches=(1, 2, 4), contexts=(16, 48), prompts=(8, 100), steps=4, sweeps=2)
    engine.step = step
    points = {(p.batch, round(p.kv_tokens / p.batch / 16)) for p in result.decode}
    assert {b for b, _ in points} == {1, 2, 4} and len(result.decode) == 6
    assert all(p.seconds > 0 and math.isfinite(p.seconds) for p in result.decode)
    assert seen.count(4) >= 2 * 2 * 4  # batch 4, at both contexts, in both sweeps: 4 decode steps each
    assert {p.tokens for p in result.prefill} >= {8} and sum(p.tokens for p in result.prefill if p.start == 0) > 8
    assert result.busy_seconds > 0 and result.seconds >= result.busy_seconds
    assert not engine.has_unfinished() and engine.core.block_pool.num_used == 0
    assert len(engine.core.step_stats) == 0 and engine.core.prefix_cache_stats.queries == 0
    greedy = SamplingParams(temperature=0, max_tokens=6)
    fresh = run_to_completion(tiny_engine(), [[1, 2, 3, 4, 5]], greedy)
    after = run_to_completion(engine, [[1, 2, 3, 4, 5]], greedy)
    assert [o.outputs[0].token_ids for o in after.values()] == [o.outputs[0].token_ids for o in fresh.values()]
    assert REQUEST_ID.startswith("tokenmill-")
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        probe(engine)


def test_max_seqs_measured_is_what_the_kv_cache_holds_not_the_step_limits():
    """256 blocks of 4 tokens hold 25 sequences of 40 tokens (10 blocks each); the engine's
    cap is 16 sequences and 64 tokens a step, which would have admitted a sequence or two per
    step while the first ones finished. The limits are lifted for the measurement only."""
    engine = tiny_engine(num_blocks=256)
    limits = engine.core.scheduler.config
    got = measure_max_seqs(engine, 27, 40)
    assert limits.max_num_seqs == 16 and got == 256 // 10
    assert engine.core.scheduler.config is limits
    assert not engine.has_unfinished() and engine.core.block_pool.num_used == 0
