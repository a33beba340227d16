"""The engine-core process's loop takes typed messages off the pipe: a request whose parameters
fail their checks on arrival, or that carries both kinds of parameters or neither, is refused
with a Rejected naming why, and the loop goes on serving the next one."""

from __future__ import annotations

from tests.model.test_load_price import tiny_engine
from tokenmill.engine.core.core_loop import CoreLoop
from tokenmill.engine.pipe import messages as m
from tokenmill.engine.pipe.wire import pack, unpack
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class Pipe:  # what the loop needs of its channel: a reader to start, a send (through msgpack)
    def __init__(self) -> None:
        self.sent: list = []

    def start_reader(self, inbox) -> None:
        pass

    def send(self, msg: list) -> None:
        self.sent.append(m.decode(unpack(pack(msg))))


def test_a_request_that_fails_its_checks_on_arrival_is_rejected_and_the_loop_serves_on():
    engine, pipe = tiny_engine(), Pipe()
    loop = CoreLoop(engine.core, pipe)
    try:
        bad = m.encode(m.Add("bad", [1, 2, 3], SamplingParams(max_tokens=4), None, None))
        bad[3][1] = -2.0  # temperature, as a peer of another mind might send it
        loop._command(unpack(pack(bad)))
        both = m.Add("both", [1, 2, 3], SamplingParams(max_tokens=4), PoolingParams(), None)
        loop._command(unpack(pack(m.encode(both))))
        neither = m.Add("neither", [1, 2, 3], None, None, None)
        loop._command(unpack(pack(m.encode(neither))))
        loop._command(unpack(pack(m.encode(m.Add("good", [1, 2, 3], SamplingParams(max_tokens=4), None, None)))))
    finally:
        loop.pool.shutdown()
    rejected = {msg.request_id: msg.error for msg in pipe.sent if isinstance(msg, m.Rejected)}
    assert rejected["bad"].type == "InvalidRequestError" and rejected["bad"].param == "temperature"
    assert "one of the two" in rejected["both"].message and "one of the two" in rejected["neither"].message
    accepted = [msg for msg in pipe.sent if isinstance(msg, m.Accepted)]
    assert [msg.request_id for msg in accepted] == ["good"]
    assert accepted[0].report.snapshot.num_waiting == 1  # typed on arrival: the gauges, not a map
    assert engine.core.num_waiting == 1


def test_a_second_load_of_a_name_being_read_is_refused_in_its_reply_and_the_loop_serves_on():
    """Two AddLora calls of one name back to back (a server's concurrent loads): the second is
    refused in its own Reply while the first is read; nothing escapes the loop."""
    engine, pipe = tiny_engine(), Pipe()
    loop = CoreLoop(engine.core, pipe)
    try:
        loop._command(unpack(pack(m.encode(m.AddLora(1, "tenant-a", "/nowhere")))))
        loop._command(unpack(pack(m.encode(m.AddLora(2, "tenant-a", "/nowhere")))))
        while loop.pending:  # the first's read (it fails: this engine serves no adapters)
            loop._apply_prepared()
        loop._command(unpack(pack(m.encode(m.RemoveLora(3, "tenant-a")))))
    finally:
        loop.pool.shutdown()
    replies = {msg.call_id: msg.error for msg in pipe.sent if isinstance(msg, m.Reply)}
    assert "already" in replies[2].message and replies[2].param == "lora_name"
    assert replies[1] is not None and "LoRA adapters are off" in replies[1].message
    assert "unknown LoRA adapter" in replies[3].message
