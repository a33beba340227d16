"""The batched sampler: allowed sets, seeds, greedy, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import (
    PenaltyState,
    SampleRow,
    apply_penalties,
    inverse_transform,
    sample,
    sampling_distribution,
)

V = 50


def logits(batch=1, seed=0):
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3


def row(seed=None, **kw):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SampleRow(SamplingParams(seed=seed, **kw), prompt_ids=[], output_ids=[], generator=gen)


def draw(lg, make_row, n=400):
    return [sample(lg, [make_row()]).token_ids[0] for _ in range(n)]


def test_temperature_zero_is_argmax():
    lg = logits(4)
    out = sample(lg, [row(temperature=0.0) for _ in range(4)])
    assert out.token_ids == lg.argmax(-1).tolist()


def test_seeded_rows_reproduce_regardless_of_batch():
    lg = logits(3)
    first = [sample(lg[1:2], [row(seed=7, temperature=1.0)]).token_ids[0] for _ in range(1)]
    r = row(seed=7, temperature=1.0)
    alone = [sample(lg[1:2], [r]).token_ids[0] for _ in range(20)]
    r = row(seed=7, temperature=1.0)
    batched = [sample(lg, [row(temperature=1.0), r, row(seed=3)]).token_ids[1] for _ in range(20)]
    assert alone == batched and alone[0] == first[0]
    assert len(set(alone)) > 1  # it is sampling, not argmax


def test_top_k_never_leaves_the_k_best():
    lg = logits()
    allowed = set(lg[0].topk(5).indices.tolist())
    assert set(draw(lg, lambda: row(temperature=2.0, top_k=5))) <= allowed


def test_top_p_never_leaves_the_nucleus():
    lg = logits() / 3
    probs = lg[0].softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    got = set(draw(lg, lambda: row(temperature=1.0, top_p=0.6)))
    assert got <= nucleus and len(got) > 1


def test_min_p_never_emits_below_threshold():
    lg = logits()
    probs = lg[0].softmax(-1)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.2 * probs.max().item()}
    assert set(draw(lg, lambda: row(temperature=1.0, min_p=0.2))) <= allowed


def test_sampling_follows_the_distribution():
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-12] * (V - 3)]))
    counts = torch.bincount(torch.tensor(draw(lg, lambda: row(temperature=1.0), n=3000)), minlength=V)
    freq = (counts[:3] / 3000).tolist()
    assert all(abs(f - p) < 0.04 for f, p in zip(freq, [0.5, 0.3, 0.2], strict=True))


def test_per_row_parameters_in_one_call():
    lg = logits(3)
    rows = [row(temperature=0.0), row(temperature=1.0, top_k=1), row(seed=1, temperature=5.0, top_k=3)]
    for _ in range(20):
        out = sample(lg, rows).token_ids
        assert out[0] == lg[0].argmax().item() and out[1] == lg[1].argmax().item()
        assert out[2] in lg[2].topk(3).indices.tolist()


def test_penalties():
    lg = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = SampleRow(SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    torch.testing.assert_close(apply_penalties(lg, [r]), torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    r = SampleRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[0], output_ids=[2, 2, 3])
    torch.testing.assert_close(apply_penalties(lg, [r]), torch.tensor([[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]]))


def test_penalty_counts_kept_by_deltas_equal_counts_from_the_whole_history():
    """A request's PenaltyState, built once and then told each token it gains, penalises
    exactly as counting its whole token lists afresh; a verification row's drafts (past
    what the state counted) are counted too."""
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    prompt, output = [3, 4, 4, 9], [1, 1]
    state = PenaltyState(params, prompt, output)
    lg = logits(1, seed=5)
    apply_penalties(lg, [SampleRow(params, prompt, output, penalties=state)])  # builds the tensors
    for gained in ([7], [7, 1], [], [0, 49]):
        output.extend(gained)
        state.add(gained)
        drafts = [2, 7]
        for i in range(len(drafts) + 1):
            history = output + drafts[:i]
            fresh = apply_penalties(lg, [SampleRow(params, prompt, history)])
            kept = apply_penalties(lg, [SampleRow(params, prompt, history, penalties=state)])
            assert torch.equal(kept, fresh)
    assert state.num_counted == len(output)


def test_sample_draws_from_the_shared_sampling_distribution():
    """sample() and sampling_distribution() are one pipeline: greedy rows take its
    greedy choice, and a sampled row's frequencies follow its distribution."""
    lg = logits(2, seed=9)
    rows = [row(temperature=0.0, frequency_penalty=0.5), row(temperature=0.7, top_k=5)]
    rows[0].output_ids = [int(lg[0].argmax())]  # the penalty moves the greedy choice
    probs, greedy_tokens = sampling_distribution(lg, rows)
    out = [sample(lg, rows).token_ids for _ in range(2000)]
    assert all(o[0] == int(greedy_tokens[0]) for o in out)
    freq = torch.bincount(torch.tensor([o[1] for o in out]), minlength=V).float() / len(out)
    assert (freq[probs[1] == 0] == 0).all()
    assert torch.allclose(freq, probs[1], atol=0.04)


def test_logprobs_of_chosen_and_top_n():
    lg = logits(2)
    out = sample(lg, [row(temperature=0.0, logprobs=3), row(temperature=0.0)])
    ref = lg[0].log_softmax(-1)
    assert math.isclose(out.logprobs[0], ref.max().item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None and out.top_logprobs[1] == []


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_integers_that_reach_tensors_are_range_checked():

    from tokenmill.errors import InvalidRequestError

    for kw, param in [
        ({"top_k": 2**63}, "top_k"),
        ({"n": 10**6}, "n"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"stop_token_ids": (2**40,)}, "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param
    SamplingParams(top_k=2**31 - 1, n=256)  # the largest allowed


def test_inverse_transform_gives_each_token_its_probability_and_never_a_zero():
    """u swept evenly over [0, 1): each token is picked for a share of the sweep equal to its
    probability (to the sweep's step), tokens of probability 0 (inside, first and last) never,
    and u at its extremes gives the first and the last token that has a probability."""
    p = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.125, 1e-9, 0.5, 0.125 - 1e-9, 0.0])
    n = 80_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    picks = inverse_transform(p.expand(n, -1), u)
    share = torch.bincount(picks, minlength=len(p)).double() / n
    assert (share[p == 0] == 0).all()
    assert torch.allclose(share, p.double(), atol=2 / n)
    ends = inverse_transform(p.expand(2, -1), torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
    assert ends.tolist() == [1, 7]
