"""What crosses the engine core's pipe (engine/pipe/wire.py): every value survives the trip
through the typed codec and msgpack unchanged, and what cannot be a request is refused by name."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tokenmill.engine.model_input import SampledToken
from tokenmill.engine.outputs import SeqDelta
from tokenmill.engine.pipe.wire import (
    WireDelta,
    WireError,
    delta_from_wire,
    delta_to_wire,
    error_from_wire,
    error_to_wire,
    from_plain,
    pack,
    to_plain,
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
        SamplingParams(kv_eviction={"window": 512, "sinks": 8}, max_tokens=4096),
    ],
)
def test_sampling_params_survive_the_trip(params):
    assert from_plain(SamplingParams, trip(to_plain(params))) == params


@pytest.mark.parametrize(
    "params", [PoolingParams(), PoolingParams("mean", "addr:10.0.0.1"), PoolingParams("last", "", "tenant-a", 2)]
)
def test_pooling_params_survive_the_trip(params):
    wire = trip(to_plain(params))
    assert wire == [params.pooling_type, params.client, params.cache_salt, params.priority]
    assert from_plain(PoolingParams, wire) == params
    with pytest.raises(InvalidRequestError, match="pooling"):
        from_plain(PoolingParams, ["max", "", None, 0])


def test_sampling_params_of_another_shape_are_refused_by_their_field_count():
    wire = trip(to_plain(SamplingParams()))
    with pytest.raises(ValueError, match="SamplingParams takes 28 fields"):
        from_plain(SamplingParams, wire + [0.5])


def test_invalid_sampling_values_are_refused_on_arrival():
    names = [f.name for f in fields(SamplingParams)]
    wire = trip(to_plain(SamplingParams()))
    wire[names.index("top_p")] = 7.0
    with pytest.raises(InvalidRequestError) as e:
        from_plain(SamplingParams, wire)
    assert e.value.param == "top_p"


def test_tuples_come_back_as_tuples_at_every_depth():
    p = SamplingParams(logit_bias={5: -1.0, 7: 2.5}, bad_words_token_ids=((1, 2), (3,)), stop=("x",))
    back = from_plain(SamplingParams, trip(to_plain(p)))
    assert back == p and isinstance(back.logit_bias[0], tuple) and isinstance(back.bad_words_token_ids[1], tuple)


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
    assert delta_from_wire(from_plain(WireDelta, trip(to_plain(delta_to_wire(delta))))) == delta


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
    assert from_plain(EngineSnapshot, trip(to_plain(s))) == s


def test_errors_keep_their_kind_and_the_field_at_fault():
    def trip(w):
        return from_plain(WireError, unpack(pack([to_plain(w)]))[0])

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
