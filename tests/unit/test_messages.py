"""Every message between the API process and the engine-core process survives the pipe
(encode, msgpack, decode) as itself, and the wire's shape is pinned: a change to any
message's fields fails here until WIRE_VERSION and this test say it on purpose."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tokenmill.engine import messages as m
from tokenmill.engine.wire import pack, unpack

SNAPSHOT = {"num_running": 2, "kv_events": [["stored", b"\x01\x02"]], "steps": [{"step": 3, "seqs": [["a", "decode"]]}]}
ERROR = {"type": "InvalidRequestError", "message": "bad", "param": "max_tokens", "user": True}
EXAMPLES = [
    m.Add("r1", [1, 2, 3], {"max_tokens": 8, "structured": None}, "adapter"),
    m.Abort("r1"),
    m.Stop("r1-0", "###"),
    m.Call(7, "export_kv", [[b"\x00" * 16]]),
    m.Shutdown(),
    m.Ready({"max_model_len": 2048, "model_path": "/m.gguf"}, SNAPSHOT),
    m.Failed("no such file", ERROR),
    m.Accepted("r1", SNAPSHOT),
    m.Rejected("r1", ERROR, SNAPSHOT),
    m.Out([["r1-0", [5], None, None, None, None, None, 1.5, 0, None, None]], SNAPSHOT),
    m.Reply(7, None, [2, b"\x00\x01"], SNAPSHOT),
    m.Stats(SNAPSHOT),
    m.Dead("RuntimeError: boom"),
]
# The wire, version 1: each message's tag and its fields in order.
WIRE_V1 = {
    "add": ["request_id", "prompt_ids", "params", "lora"],
    "abort": ["request_id"],
    "stop": ["seq_id", "stop_string"],
    "call": ["call_id", "method", "args"],
    "shutdown": [],
    "ready": ["info", "snapshot"],
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


def test_the_wire_is_pinned_to_its_version():
    assert m.WIRE_VERSION == 1
    assert {cls.TAG: [f.name for f in fields(cls)] for cls in m.TO_CORE + m.TO_API} == WIRE_V1


def test_an_unknown_or_malformed_message_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine-core message"):
        m.decode(["launch", 1])
    with pytest.raises(ValueError, match="'abort' has 2 fields, not 1"):
        m.decode(["abort", "r1", "extra"])
