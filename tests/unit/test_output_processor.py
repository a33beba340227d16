"""Output processing: deltas add up to the whole, the whole is built only on demand,
stop strings end a sequence mid-step, and outputs never copy the history per step."""

from __future__ import annotations

from tests.helpers import ScriptedRunner, ToyTokenizer
from tokenmill.configuration.config import SpeculativeConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.sampling_params import SamplingParams


def engine(**kw) -> Engine:
    return Engine.create(
        ScriptedRunner(4), ToyTokenizer(), EngineConfig(num_blocks=256, block_size=4, max_model_len=1000, **kw)
    )


def test_stream_deltas_add_up_to_the_final_completion():
    e = engine()
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=300, logprobs=0))
    text, ids, outs = "", [], []
    while e.has_unfinished():
        for out in e.step():
            text += out.delta_text
            ids += out.delta_token_ids
            outs.append(out)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.text == text and final.token_ids == ids and len(ids) == 300
    assert final.outputs[0].logprobs == [None] * 300  # the scripted runner reports no values
    # a running output's cumulative view is its snapshot, whatever came after
    assert outs[9].token_ids == ids[:10] and outs[9].text == text[: len(outs[9].text)]


def test_outputs_do_not_copy_the_history_each_step():
    """Each step's output holds only its delta: every list it stores is at most a step long
    (the prompt is one shared list, the completion one shared append-only record), and the
    cumulative lists are built when read, as they stood at that step."""
    e = engine()
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=200, logprobs=0))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    record = outs[0].outputs[0]._source
    for o in outs:
        stored = [
            v
            for obj in (o, o.outputs[0])
            for k, v in vars(obj).items()
            if isinstance(v, list) and k != "prompt_token_ids"
        ]
        assert all(len(v) <= 1 for v in stored if v is not o.outputs)
        assert o.prompt_token_ids is outs[0].prompt_token_ids and o.outputs[0]._source is record
    assert all(len(o.delta_token_ids) == 1 for o in outs)
    assert outs[-1].outputs[0].token_ids == [t for o in outs for t in o.delta_token_ids]
    assert len(outs[9].outputs[0].token_ids) == 10 and len(outs[9].outputs[0].logprobs) == 10


def test_a_stop_string_inside_a_multi_token_step_ends_the_request_there():
    """Scripted drafts make a step add several tokens; a stop string completed by one of
    them drops the rest, frees the blocks and tells the runner."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    e = engine(speculative=spec)
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50))
    ref = []
    while e.has_unfinished():
        for out in e.step():
            ref += out.delta_token_ids
    text = ToyTokenizer().decode(ref)
    stop = text[20:23]
    assert e.core.spec_decode_stats.num_accepted_tokens > 0  # some steps added several tokens
    e2 = engine(speculative=spec)
    e2.add_request("s", [1, 2, 3], SamplingParams(max_tokens=50, stop=(stop,)))
    last = None
    while e2.has_unfinished():
        for out in e2.step():
            last = out
    assert last.finished and last.finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert last.text == text[: text.index(stop)]
    assert e2.core.block_pool.num_free == e2.core.block_pool.num_blocks
    assert not e2.core.runner.requests


def test_a_stop_string_before_min_tokens_is_not_found_afterwards():
    """As vLLM: stop strings are looked for once the output has more than min_tokens
    tokens, in the text those tokens add; an earlier occurrence neither stops the
    sequence nor cuts back text already streamed."""
    from tests.helpers import ToyTokenizer
    from tokenmill.engine.api.output_processor import OutputProcessor
    from tokenmill.engine.model_input import SampledToken
    from tokenmill.engine.outputs import SeqDelta

    op = OutputProcessor(ToyTokenizer())
    ids = [0, 1, 2, 1]  # the toy tokenizer's "A", "B", "C", "B"
    op.add("r", "r", 0, None, [7], SamplingParams(max_tokens=10, min_tokens=2, stop=("B",)))
    streamed, stopped = "", []
    for t in ids:
        outs, stops = op.process([SeqDelta("r", [SampledToken(t)])])
        streamed += outs[0].delta_text
        stopped += stops
        if stops:
            break
    assert stopped == [("r", "B")] and streamed == "ABC" and outs[0].text == "ABC"  # the second B stopped it
