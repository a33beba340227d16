"""The engine core's messages (engine/pipe/wire.py): every value survives the trip through
msgpack unchanged, and what cannot be a request is refused by name."""

from __future__ import annotations

import pytest

from tokenmill.engine.model_input import SampledToken
from tokenmill.engine.outputs import SeqDelta
from tokenmill.engine.pipe.wire import (
    delta_from_wire,
    delta_to_wire,
    error_from_wire,
    error_to_wire,
    pack,
    params_from_wire,
    params_to_wire,
    snapshot_from_wire,
    snapshot_to_wire,
    unpack,
)
from tokenmill.engine.stats import EngineSnapshot
from tokenmill.errors import EngineDeadError, InvalidRequestError, TokenmillError, UnknownModelError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


def trip(value):
    return unpack(pack([value]))[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            n=3,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=11,
            max_tokens=99,
            stop=("a", "é\n"),
            stop_token_ids=(2, 3),
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=4,
            skip_special_tokens=False,
        ),
        SamplingParams(structured={"json": {"type": "object", "properties": {"b": {"type": "string"}, "a": {}}}}),
        SamplingParams(structured={"choice": ["yes", "no"]}, client="key:0123abcd", priority=-3),
        SamplingParams(structured={"json_object": True, "whitespace_pattern": r"[ ]?"}),
    ],
)
def test_sampling_params_survive_the_trip(params):
    assert params_from_wire(trip(params_to_wire(params))) == params


@pytest.mark.parametrize(
    "params", [PoolingParams(), PoolingParams("mean", "addr:10.0.0.1"), PoolingParams("last", "", "tenant-a", 2)]
)
def test_an_embedding_request_crosses_as_pooling_params_not_as_sampling(params):
    wire = trip(params_to_wire(params))
    fields = {"pooling_type": params.pooling_type, "client": params.client}
    fields |= {"cache_salt": params.cache_salt, "priority": params.priority}
    assert wire == fields and params_from_wire(wire) == params
    with pytest.raises(InvalidRequestError, match="pooling"):
        params_from_wire({"pooling_type": "max"})


def test_an_unknown_sampling_field_is_refused_by_name():
    wire = params_to_wire(SamplingParams())
    wire["temprature"] = 0.5
    with pytest.raises(InvalidRequestError, match="temprature"):
        params_from_wire(wire)


def test_invalid_sampling_values_are_refused_on_arrival():
    wire = params_to_wire(SamplingParams())
    wire["top_p"] = 7.0
    with pytest.raises(InvalidRequestError) as e:
        params_from_wire(trip(wire))
    assert e.value.param == "top_p"


@pytest.mark.parametrize(
    "delta",
    [
        SeqDelta("r#1", [SampledToken(5), SampledToken(9)], first_scheduled=12.5, num_cached_tokens=32),
        SeqDelta("r", [SampledToken(5, -0.25, [(5, -0.25), (7, -1.5)])], "stop", 5, None, 1.0, 0),
        SeqDelta("r", [], "stop", "the end", None, None, 0),
        SeqDelta("r", [], "error", None, "RuntimeError: boom", 2.0, 0),
    ],
)
def test_deltas_survive_the_trip(delta):
    assert delta_from_wire(trip(delta_to_wire(delta))) == delta


def test_a_snapshot_survives_the_trip():
    s = EngineSnapshot(
        num_running=3,
        num_waiting=1,
        kv_usage=0.25,
        num_preemptions=2,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        max_loras=2,
        loras={"a": "/x/a"},
        lora_requests={"a": 4},
        running_loras=["a"],
    )
    assert snapshot_from_wire(trip(snapshot_to_wire(s))) == s


def test_errors_keep_their_kind_and_the_field_at_fault():
    e = error_from_wire(trip(error_to_wire(InvalidRequestError("bad top_p", param="top_p"))))
    assert isinstance(e, InvalidRequestError) and e.param == "top_p" and str(e) == "bad top_p"
    assert isinstance(error_from_wire(trip(error_to_wire(EngineDeadError("gone")))), EngineDeadError)
    # an adapter unloaded between the server's check and the core: still the server's 404
    e = error_from_wire(trip(error_to_wire(UnknownModelError("unknown LoRA adapter 'rt3'", param="model"))))
    assert type(e) is UnknownModelError and e.param == "model"

    class AdapterError(TokenmillError):
        pass

    e = error_from_wire(trip(error_to_wire(AdapterError("no adapter_config.json in /x"))))
    assert type(e) is TokenmillError and "adapter_config.json" in str(e)
    e = error_from_wire(trip(error_to_wire(KeyError("k"))))
    assert type(e) is RuntimeError and "KeyError" in str(e)
