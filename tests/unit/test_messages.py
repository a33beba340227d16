"""Every message between the API process and the engine-core process survives the pipe
(encode, msgpack, decode) as itself, and the wire's shape is pinned: a change to any
message's fields fails here until WIRE_VERSION and this test say it on purpose."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tokenmill.engine.pipe import messages as m
from tokenmill.engine.pipe.wire import pack, unpack

SNAPSHOT = {"num_running": 2, "kv_events": [["stored", b"\x01\x02"]], "steps": [{"step": 3, "seqs": [["a", "decode"]]}]}
ERROR = {"type": "InvalidRequestError", "message": "bad", "param": "max_tokens", "user": True}
EXAMPLES = [
    m.Add("r1", [1, 2, 3], {"max_tokens": 8, "structured": None}, "adapter"),
    m.Abort("r1"),
    m.Stop("r1-0", "###"),
    m.Call(7, "export_kv", [[b"\x00" * 16]]),
    m.Shutdown(),
    m.Ready(2, {"max_model_len": 2048, "model_path": "/m.gguf"}, SNAPSHOT),
    m.Failed("no such file", ERROR),
    m.Accepted("r1", SNAPSHOT),
    m.Rejected("r1", ERROR, SNAPSHOT),
    m.Out([["r1-0", [5], None, None, None, None, None, 1.5, 0, None, None]], SNAPSHOT),
    m.Reply(7, None, [2, b"\x00\x01"], SNAPSHOT),
    m.Stats(SNAPSHOT),
    m.Dead("RuntimeError: boom"),
]
# The wire, version 2: each message's tag and its fields in order (2: Ready says its version),
# the engine snapshot's fields and the sampling parameters' (2: the disk tier's figures).
WIRE_V2 = {
    "add": ["request_id", "prompt_ids", "params", "lora"],
    "abort": ["request_id"],
    "stop": ["seq_id", "stop_string"],
    "call": ["call_id", "method", "args"],
    "shutdown": [],
    "ready": ["wire_version", "info", "snapshot"],
    "failed": ["message", "error"],
    "accepted": ["request_id", "snapshot"],
    "rejected": ["request_id", "error", "snapshot"],
    "out": ["deltas", "snapshot"],
    "reply": ["call_id", "error", "result", "snapshot"],
    "stats": ["snapshot"],
    "dead": ["message"],
}


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_through_the_pipe(msg):
    wire = unpack(pack(m.encode(msg)))
    assert wire[0] == msg.TAG
    assert m.decode(wire) == msg


def test_the_examples_cover_every_message_both_ways():
    assert {type(x) for x in EXAMPLES} == set(m.TO_CORE + m.TO_API)


SNAPSHOT_V2 = [
    "num_running", "num_waiting", "kv_usage", "num_preemptions", "num_step_retries", "prefix_cache_queries",
    "prefix_cache_hits", "kv_disk_bytes", "kv_disk_hits", "kv_disk_stored", "kv_disk_evicted", "spec_num_drafts",
    "spec_num_draft_tokens", "spec_num_accepted_tokens", "iteration_tokens", "iteration_tokens_sum", "max_loras",
    "loras", "lora_requests", "running_loras", "waiting_loras",
]  # fmt: skip
SAMPLING_V2 = [
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "structured", "min_tokens", "logit_bias", "allowed_token_ids",
    "bad_words", "priority", "bad_words_token_ids", "eos_token_ids", "client", "cache_salt",
]  # fmt: skip


def test_the_wire_is_pinned_to_its_version():
    from tokenmill.engine.stats import EngineSnapshot
    from tokenmill.sampling_params import SamplingParams

    assert m.WIRE_VERSION == 2
    assert {cls.TAG: [f.name for f in fields(cls)] for cls in m.TO_CORE + m.TO_API} == WIRE_V2
    assert [f.name for f in fields(EngineSnapshot)] == SNAPSHOT_V2
    assert [f.name for f in fields(SamplingParams)] == SAMPLING_V2


def test_a_core_of_another_wire_version_is_refused_by_name():
    ready = m.encode(m.Ready(m.WIRE_VERSION, {"max_model_len": 8}, SNAPSHOT))
    assert m.check_ready(unpack(pack(ready))) == m.decode(ready)
    with pytest.raises(ValueError, match="speaks wire version 3, this API process 2"):
        m.check_ready(["ready", 3, {}, SNAPSHOT])
    with pytest.raises(ValueError, match="speaks wire version unknown"):  # version 1's Ready: info first
        m.check_ready(["ready", {"max_model_len": 8}, SNAPSHOT])
    with pytest.raises(ValueError, match="must be ready or failed"):
        m.check_ready(m.encode(m.Stats(SNAPSHOT)))
    assert isinstance(m.check_ready(m.encode(m.Failed("no such file", ERROR))), m.Failed)


def test_an_unknown_or_malformed_message_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine-core message"):
        m.decode(["launch", 1])
    with pytest.raises(ValueError, match="'abort' has 2 fields, not 1"):
        m.decode(["abort", "r1", "extra"])
