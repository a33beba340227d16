"""The driver's messages to its worker ranks cross as plain values (never pickled), each
itself after the crossing, and carry the version: a worker that speaks another refuses by name.
The fields are pinned: a change to any fails here until RANK_WIRE_VERSION says it on purpose."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from tokenmill.configuration.config import EngineArgs, LoadConfig, ParallelConfig
from tokenmill.distributed import rank_messages as r
from tokenmill.distributed.cluster import WorkerSpec
from tokenmill.engine.model_input import CachedRequestData, ModelInput, NewRequestData, ScheduledTokens
from tokenmill.engine.pipe.wire import pack
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput

pytestmark = pytest.mark.unit

BATCH = ModelInput(
    scheduled=[ScheduledTokens("a", 0, 3), ScheduledTokens("b", 7, 2, [9], 2, 0)],
    new_requests=[NewRequestData("a", [1, 2, 3], [], SamplingParams(max_tokens=5, seed=3, stop=["x"]), [4, 5], "ada")],
    cached_requests=[CachedRequestData("b", 1, [8])],
    block_copies=[(1, 2)],
    finished_request_ids=["c"],
    preempted_request_ids=["d"],
)
EXAMPLES = [
    r.Load(EngineArgs(load=LoadConfig(model="/m.gguf"), parallel=ParallelConfig(tensor_parallel_size=2)), "bfloat16"),
    r.Setup(40),
    r.Step(BATCH, {"a": ([5], None), "b": ([6, 7], [8, 9])}),
    r.Forward([r.ScoredSeq("p", [1, 2, 3], 4, [0, 1])]),
    r.Shutdown(),
]

FIELDS = {
    "Load": ["args", "dtype"],
    "Setup": ["num_blocks"],
    "Step": ["batch", "committed"],
    "ScoredSeq": ["request_id", "token_ids", "num_computed_tokens", "block_table"],
    "Forward": ["seqs"],
    "Shutdown": [],
}


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_rank_message_crosses_as_itself(message):
    data = r.encode(message)
    assert b"\x80\x04" not in data[:2]  # (msgpack, not a pickle's protocol header)
    back = r.decode(data)
    assert type(back) is type(message) and back == message


def test_the_load_names_its_dtype_and_the_step_keeps_its_types():
    load = r.decode(r.encode(EXAMPLES[0]))
    assert load.torch_dtype is torch.bfloat16 and load.args.parallel.tensor_parallel_size == 2
    step = r.decode(r.encode(EXAMPLES[2]))
    assert isinstance(step.batch.new_requests[0].params, SamplingParams)
    assert step.batch.block_copies == [(1, 2)] and step.committed["b"] == ([6, 7], [8, 9])
    with pytest.raises(r.RankWireError, match="no torch dtype"):
        _ = r.Load(EngineArgs(), "Tensor").torch_dtype


def test_a_driver_of_another_version_is_refused_by_name():
    other = pack([r.RANK_WIRE_VERSION + 1, 1, [40]])
    with pytest.raises(r.RankWireError, match=f"version {r.RANK_WIRE_VERSION + 1}.*this worker {r.RANK_WIRE_VERSION}"):
        r.decode(other)
    for junk in (b"\x80\x04junk", pack({"a": 1}), pack([r.RANK_WIRE_VERSION, 99, []])):
        with pytest.raises(r.RankWireError):
            r.decode(junk)


def test_the_rank_wire_is_pinned_to_its_fields():
    assert r.RANK_WIRE_VERSION == 1
    pinned = {t.__name__: [f.name for f in fields(t)] for t in (*r.MESSAGES, r.ScoredSeq)}
    assert pinned == FIELDS


def test_a_scoring_forward_takes_plain_sequences_only():
    seq = SeqInput("p", [1, 2], 3, [0], False, SamplingParams(), [], [])
    assert r.ScoredSeq.of(seq).seq_input().token_ids == [1, 2]
    seq.position_offset = 5
    with pytest.raises(ValueError, match="plain sequences only"):
        r.ScoredSeq.of(seq)


def test_a_worker_spec_crosses_stdin_as_plain_values():
    spec = WorkerSpec("127.0.0.1", 29500, 1, 2, 2, 1234)
    assert WorkerSpec.read(spec.write()) == spec
    with pytest.raises(ValueError, match="not a worker spec"):
        WorkerSpec.read(b"")  # the driver died before it wrote
