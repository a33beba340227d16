"""The persistent batch: the runner's own state, fed by deltas, must give the outputs
of a fresh computation; drafts must be the ones it proposed; a preempted seeded
request must continue its random stream where it stopped."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ToyTokenizer, run_to_completion, tiny_model
from tokenmill.configuration.config import SchedulerConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.engine.model_input import ModelInput, NewRequestData, ScheduledTokens
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.proposer import Draft

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_model(5, vocab=16)


def engine_for(model, num_blocks: int) -> Engine:
    caches = allocate_kv_cache(model.config, num_blocks, 4, torch.float32, CPU)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=200,
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
    )
    return Engine.create(ModelRunner(model, caches, 4, CPU), ToyTokenizer(16), config)


def test_seeded_sampling_is_the_same_with_and_without_preemption(model):
    prompts = [[(i * 3 + j) % 16 for j in range(6 + i)] for i in range(8)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(8)]
    roomy = engine_for(model, 256)
    tight = engine_for(model, 24)  # cannot hold all eight: preemption and recompute
    expected = {k: o.token_ids for k, o in run_to_completion(roomy, prompts, params).items()}
    got = {k: o.token_ids for k, o in run_to_completion(tight, prompts, params).items()}
    assert tight.core.num_preemptions > 0
    assert got == expected
    assert (
        not tight.core.runner.requests and not tight.core.runner._parked_generators
    )  # dropped when the engine went idle


def test_scheduled_drafts_must_be_the_ones_the_runner_proposed(model):
    caches = allocate_kv_cache(model.config, 16, 4, torch.float32, CPU)
    runner = ModelRunner(model, caches, 4, CPU)
    new = NewRequestData("r", [1, 2, 3], [], SamplingParams(temperature=0), [0, 1])
    runner.execute(ModelInput([ScheduledTokens("r", 0, 3)], new_requests=[new]))
    assert runner.requests["r"].output_ids  # it sampled and kept its token
    with pytest.raises(RuntimeError, match="not the ones this runner proposed"):
        runner.execute(ModelInput([ScheduledTokens("r", 3, 3, spec_token_ids=[4, 5])]))
    runner.requests["r"].draft = Draft([4, 6])
    with pytest.raises(RuntimeError, match="not the ones this runner proposed"):
        runner.execute(ModelInput([ScheduledTokens("r", 3, 3, spec_token_ids=[4, 5])]))


def test_a_draft_and_its_probabilities_must_agree_in_length():
    with pytest.raises(ValueError, match="2 tokens with 1 rows"):
        Draft([1, 2], torch.zeros(1, 16))


class FailsAfterSampling:
    """A proposer that raises whenever the poisoned request is in the step (as a draft
    model running out of memory would): the runner calls it after the target's tokens
    were drawn, so the step fails late."""

    poisoned = "bad"

    def propose(self, seqs, new_tokens, generator_of, hidden):
        if any(s.request_id == self.poisoned for s in seqs):
            raise RuntimeError("late failure")
        return {}

    def copy_blocks(self, copies):
        pass


def test_a_step_retried_after_a_late_failure_samples_the_same_tokens(model):
    """The failed step drew from the seeded generators; the one-at-a-time retry must
    draw the same numbers again, so the others' outputs are as if nothing failed."""
    prompts = [[(i * 5 + j) % 16 for j in range(5 + i)] for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(4)]
    expected = {k: o.token_ids for k, o in run_to_completion(engine_for(model, 128), prompts, params).items()}
    engine = engine_for(model, 128)
    engine.core.runner.proposer = FailsAfterSampling()
    engine.add_request("bad", [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, seed=1, max_tokens=12))
    done = run_to_completion(engine, prompts, params)
    assert done["bad"].finish_reason == "error" and "late failure" in done["bad"].error
    assert {k: o.token_ids for k, o in done.items() if k != "bad"} == expected


def test_a_sequence_id_cannot_be_taken_twice(model):
    from tokenmill.errors import InvalidRequestError

    engine = engine_for(model, 64)
    engine.add_request("x#1", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="duplicate request id"):
        engine.add_request("x", [1, 2, 3], SamplingParams(n=2, max_tokens=2))  # its second sequence is x#1
    run_to_completion(engine)
    assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks
