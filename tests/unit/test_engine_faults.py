"""A failing model step ends only the request that causes it, and leaves nothing
behind: no blocks, and no prefix-cache entries for K/V that were never written."""

from __future__ import annotations

from tests.helpers import ScriptedRunner, ToyTokenizer
from tests.helpers import run_to_completion as run
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.model_input import ModelInput
from tokenmill.pooling_params import PoolingParams
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
    engine = Engine.create(
        FailsFor(4, "bad"), ToyTokenizer(), EngineConfig(num_blocks=32, block_size=4, max_model_len=100)
    )
    prompt = list(range(20))
    engine.add_request("bad", prompt, SamplingParams(max_tokens=3))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=3))
    outs = run(engine)
    assert outs["bad"].finish_reason == "error" and "boom" in outs["bad"].error
    assert outs["good"].finish_reason == "length" and len(outs["good"].token_ids) == 3
    assert engine.core.num_step_retries >= 1  # counted (and logged), not silent
    assert engine.core.block_pool.num_free == 32
    engine.core.runner.poisoned = None
    engine.add_request("again", prompt, SamplingParams(max_tokens=3))
    outs = run(engine)
    assert outs["again"].num_cached_tokens == 0  # the failed prefill left no cached blocks
    assert outs["again"].finish_reason == "length"


def test_a_retried_step_keeps_embeddings_and_prompt_logprobs():
    """Re-run one request at a time after a failure, the step still delivers every
    request's results: an embedding request finishes with its vector, a prompt-logprobs
    request has all its scores (none silently lost, nothing left running)."""
    engine = Engine.create(
        FailsFor(4, "bad"), ToyTokenizer(), EngineConfig(num_blocks=64, block_size=4, max_model_len=100)
    )
    engine.add_request("bad", list(range(12)), SamplingParams(max_tokens=3))
    engine.add_request("emb", list(range(10)), PoolingParams("last"))
    engine.add_request("plp", list(range(6)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    outs = run(engine)
    assert outs["bad"].finish_reason == "error" and engine.core.num_step_retries >= 1
    assert outs["emb"].finish_reason == "stop" and outs["emb"].embedding == [1.0, 0.0]
    assert len(outs["plp"].prompt_logprobs) == 6 and None not in outs["plp"].prompt_logprobs[1:]
    assert not engine.has_unfinished() and engine.core.block_pool.num_free == 64


def test_a_lost_chunk_of_prompt_scores_fails_the_request_rather_than_answer_short():
    from tokenmill.configuration.config import SchedulerConfig

    class DropsScores(ScriptedRunner):
        def execute(self, batch, grammar=None):
            out = super().execute(batch, grammar)
            if any(s.num_computed_tokens == 4 for s in batch.scheduled):  # the second chunk's scores go missing
                out.prompt_logprobs.pop("plp", None)
            return out

    config = EngineConfig(
        num_blocks=64, block_size=4, max_model_len=100, scheduler=SchedulerConfig(max_num_batched_tokens=4)
    )
    engine = Engine.create(DropsScores(4), ToyTokenizer(), config)
    engine.add_request("plp", list(range(12)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    out = run(engine)["plp"]
    assert out.finish_reason == "error" and "lost" in out.error and engine.core.block_pool.num_free == 64
