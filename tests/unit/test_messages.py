"""Every message between the API process and the engine-core process survives the pipe
(encode, msgpack, decode) as itself, every field of the type it left as, and the wire's shape
is pinned to its contents' fields: a change to any fails here until WIRE_VERSION and this test
say it on purpose."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tokenmill.engine.pipe import messages as m
from tokenmill.engine.pipe.wire import WireDelta, WireError, pack, unpack
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

REPORT = m.Report(
    EngineSnapshot(num_running=2, loras={"a": "/x/a"}, iteration_tokens=[3, 0, 1]),
    [("stored", b"\x01\x02")],
    [
        {
            "step": 3,
            "time": 1.5,
            "duration": 0.01,
            "seqs": [["a", "decode", 1, 0, 0, 0, None, None]],
            "preempted": [],
            "ended": [["b", "abort"]],
            "running": 1,
            "waiting": 0,
            "blocks_used": 4,
            "blocks_cached": 2,
        }
    ],
)
ERROR = WireError("InvalidRequestError", "bad", "max_tokens", True)
DELTA = WireDelta(
    "r1-0", [5, 6], [-0.5, -1.0], [[(5, -0.5)], [(6, -1.0), (2, -3.0)]], "stop", 6, None, 1.5, 0, None, None
)
EXAMPLES = [
    m.Add("r1", [1, 2, 3], SamplingParams(max_tokens=8, structured={"choice": ["a", "b"]}), None, "adapter"),
    m.Add("e1", [1, 2], None, PoolingParams("mean"), None),
    m.Abort("r1"),
    m.Stop("r1-0", "###"),
    m.AddLora(1, "tenant-a", "/adapters/a"),
    m.RemoveLora(2, "tenant-a"),
    m.StartKvEvents(3),
    m.StepTrace(4, True),
    m.MeasureLoadPrice(5),
    m.BlockStates(6),
    m.LoraHashRoots(7),
    m.ExportKv(8, [b"\x00" * 16]),
    m.ImportKv(9, [b"\x00" * 16], b"\x01" * 32),
    m.Shutdown(),
    m.Ready(3, m.CoreInfo(2048, 512, 16, "/m.gguf"), REPORT),
    m.Failed("no such file", ERROR),
    m.Accepted("r1", REPORT),
    m.Rejected("r1", ERROR, REPORT),
    m.Out([DELTA], REPORT),
    m.Reply(7, None, [2, b"\x00\x01"], REPORT),
    m.Stats(m.Report()),
    m.Dead("RuntimeError: boom"),
]
# The wire, version 4: each message's tag and its fields in order, every field typed (3: a Report
# of the snapshot, the prefix cache's events and the traced steps; sampling or pooling parameters,
# WireDelta, WireError and CoreInfo as dataclasses; 4: the sampling parameters' kv_eviction, the
# snapshot's kv_evicted_tokens, and one message per call where Call named a method), the engine
# snapshot's fields and the sampling parameters'.
WIRE_V5 = {
    "add": ["request_id", "prompt_ids", "params", "pooling", "lora"],
    "abort": ["request_id"],
    "stop": ["seq_id", "stop_string"],
    "add_lora": ["call_id", "name", "path"],
    "remove_lora": ["call_id", "name"],
    "start_kv_events": ["call_id"],
    "step_trace": ["call_id", "on"],
    "measure_load_price": ["call_id"],
    "block_states": ["call_id"],
    "lora_hash_roots": ["call_id"],
    "export_kv": ["call_id", "hashes"],
    "import_kv": ["call_id", "hashes", "data"],
    "shutdown": [],
    "ready": ["wire_version", "info", "report"],
    "failed": ["message", "error"],
    "accepted": ["request_id", "report"],
    "rejected": ["request_id", "error", "report"],
    "out": ["deltas", "report"],
    "reply": ["call_id", "error", "result", "report"],
    "stats": ["report"],
    "dead": ["message"],
}
CONTENTS_V5 = {
    m.Report: ["snapshot", "kv_events", "steps"],
    m.CoreInfo: ["max_model_len", "num_blocks", "block_size", "model_path"],
    WireDelta: [
        "seq_id", "token_ids", "logprobs", "top_logprobs", "finish_reason", "stop_reason", "error",
        "first_scheduled", "num_cached_tokens", "prompt_logprobs", "embedding",
    ],
    WireError: ["type", "message", "param", "user"],
    PoolingParams: ["pooling_type", "client", "cache_salt", "priority"],
}  # fmt: skip


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_through_the_pipe(msg):
    wire = unpack(pack(m.encode(msg)))
    assert wire[0] == msg.TAG
    back = m.decode(wire)
    assert back == msg
    for f in fields(msg):  # typed to the last field: what left as a dataclass comes back as one
        assert type(getattr(back, f.name)) is type(getattr(msg, f.name))


def test_the_examples_cover_every_message_both_ways():
    assert {type(x) for x in EXAMPLES} == set(m.TO_CORE + m.TO_API)


SNAPSHOT_V5 = [
    "num_running", "num_waiting", "kv_usage", "num_preemptions", "num_step_retries", "prefix_cache_queries",
    "prefix_cache_hits", "kv_disk_bytes", "kv_disk_hits", "kv_disk_stored", "kv_disk_evicted", "kv_host_bytes",
    "kv_host_hits", "kv_host_stored", "kv_host_evicted", "kv_evicted_tokens",
    "spec_num_drafts",
    "spec_num_draft_tokens", "spec_num_accepted_tokens", "iteration_tokens", "iteration_tokens_sum", "max_loras",
    "loras", "lora_requests", "running_loras", "waiting_loras",
]  # fmt: skip
SAMPLING_V5 = [
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "structured", "min_tokens", "logit_bias", "allowed_token_ids",
    "bad_words", "priority", "bad_words_token_ids", "eos_token_ids", "client", "cache_salt", "kv_eviction",
]  # fmt: skip
STRUCTURED_V5 = ["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "reasoning_end"]


def test_the_wire_is_pinned_to_its_version():
    from tokenmill.structured.constraint import StructuredOutputs

    assert m.WIRE_VERSION == 5
    assert {cls.TAG: [f.name for f in fields(cls)] for cls in m.TO_CORE + m.TO_API} == WIRE_V5
    assert {cls: [f.name for f in fields(cls)] for cls in CONTENTS_V5} == CONTENTS_V5
    assert [f.name for f in fields(EngineSnapshot)] == SNAPSHOT_V5
    assert [f.name for f in fields(SamplingParams)] == SAMPLING_V5
    assert [f.name for f in fields(StructuredOutputs)] == STRUCTURED_V5


def test_a_core_of_another_wire_version_is_refused_by_name():
    ready = m.encode(m.Ready(m.WIRE_VERSION, m.CoreInfo(8, 1, 16, "/m"), REPORT))
    assert m.check_ready(unpack(pack(ready))) == m.decode(ready)
    with pytest.raises(ValueError, match="speaks wire version 4, this API process 5"):
        m.check_ready(["ready", 4, {"max_model_len": 8}, {}])
    with pytest.raises(ValueError, match="speaks wire version unknown"):  # version 1's Ready: info first
        m.check_ready(["ready", {"max_model_len": 8}, {}])
    with pytest.raises(ValueError, match="must be ready or failed"):
        m.check_ready(m.encode(m.Stats(REPORT)))
    assert isinstance(m.check_ready(m.encode(m.Failed("no such file", ERROR))), m.Failed)


def test_an_unknown_or_malformed_message_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine-core message"):
        m.decode(["launch", 1])
    with pytest.raises(ValueError, match="'abort' has 2 fields, not 1"):
        m.decode(["abort", "r1", "extra"])


def test_a_value_of_the_wrong_shape_is_refused_by_the_message_and_its_type():
    add = m.encode(EXAMPLES[0])
    add[3] = add[3][:-1]  # a SamplingParams one field short
    with pytest.raises(ValueError, match="'add': SamplingParams takes 28 fields"):
        m.decode(add)
    add = m.encode(EXAMPLES[0])
    add[3][1] = -2.0  # temperature
    with pytest.raises(InvalidRequestError) as e:
        m.decode(add)
    assert e.value.param == "temperature"


@pytest.mark.parametrize(
    ("call", "plain", "read"),
    [
        (m.ExportKv, [2, b"\x00\x01"], (2, b"\x00\x01")),
        (m.ExportKv, [0, None], (0, None)),
        (m.LoraHashRoots, {"a": b"\x07", "b": None}, {"a": b"\x07", "b": None}),
        (m.ImportKv, 3, 3),
        (m.BlockStates, b"\x00\x02", b"\x00\x02"),
        (m.StepTrace, "whatever the core returned", None),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_a_reply_is_read_by_the_type_its_call_declares(call, plain, read):
    reply = m.decode(unpack(pack(m.encode(m.Reply(1, None, plain, REPORT)))))
    assert m.result_of(call, reply.result) == read
