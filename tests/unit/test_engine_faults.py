"""A failing model step ends only the request that causes it, and leaves nothing
behind: no blocks, and no prefix-cache entries for K/V that were never written."""

from __future__ import annotations

from tests.helpers import ScriptedRunner, ToyTokenizer
from tests.helpers import run_to_completion as run
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.model_input import ModelInput
from tokenmill.sampling_params import SamplingParams


class FailsFor(ScriptedRunner):
    def __init__(self, block_size, poisoned):
        super().__init__(block_size)
        self.poisoned = poisoned

    def execute(self, batch: ModelInput, grammar=None):
        if any(s.request_id == self.poisoned for s in batch.scheduled):
            raise RuntimeError("boom")
        return super().execute(batch, grammar)


def test_failure_is_isolated_and_caches_nothing():
    engine = Engine(FailsFor(4, "bad"), ToyTokenizer(), EngineConfig(num_blocks=32, block_size=4, max_model_len=100))
    prompt = list(range(20))
    engine.add_request("bad", prompt, SamplingParams(max_tokens=3))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=3))
    outs = run(engine)
    assert outs["bad"].finish_reason == "error" and "boom" in outs["bad"].error
    assert outs["good"].finish_reason == "length" and len(outs["good"].token_ids) == 3
    assert engine.num_step_retries >= 1  # counted (and logged), not silent
    assert engine.block_pool.num_free == 32
    engine.runner.poisoned = None
    engine.add_request("again", prompt, SamplingParams(max_tokens=3))
    outs = run(engine)
    assert outs["again"].num_cached_tokens == 0  # the failed prefill left no cached blocks
    assert outs["again"].finish_reason == "length"
