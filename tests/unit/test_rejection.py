"""The rejection sampler against distributions computed by hand.

Whatever the draft proposes, every token the verifier emits must be distributed as
the target's p. The hand-computed cases pin the mechanics (acceptance probability
min(1, p/q), the residual max(0, p - q), the bonus token); the chi-square cases check
the whole emitted distribution on thousands of draws at fixed seeds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokenmill.worker.rejection import verify_greedy, verify_sampled

scipy_stats = pytest.importorskip("scipy.stats")


def dist(*ps: float) -> torch.Tensor:
    return torch.tensor(ps, dtype=torch.float32)


def test_greedy_accepts_the_longest_matching_prefix_then_the_targets_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # mismatch at 2: target's 6 replaces 9
    assert verify_greedy([5, 6, 7, 8], [1, 6, 7]) == [5]
    assert verify_greedy([4], []) == [4]


def test_a_token_the_target_cannot_produce_is_always_rejected():
    p = torch.stack([dist(0.0, 0.5, 0.5), dist(1.0, 0.0, 0.0)])
    q = dist(1.0, 0.0, 0.0)[None]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = verify_sampled(p, [0], q, gen)
        assert len(out) == 1 and out[0] in (1, 2)


def test_a_draft_equal_to_the_target_is_always_accepted():
    p = torch.stack([dist(0.2, 0.3, 0.5)] * 3)
    gen = torch.Generator().manual_seed(0)
    for d in ([0, 2], [1, 1], [2, 0]):
        out = verify_sampled(p, d, p[:2], gen)
        assert out[:2] == d and len(out) == 3


def test_hand_computed_one_hot_draft():
    """p = (0.5, 0.5, 0), draft certain of token 0: accepted with probability 0.5, and
    a rejection must then emit token 1 (the residual p - onehot(0), normalised)."""
    p = torch.stack([dist(0.5, 0.5, 0.0), dist(0.0, 0.0, 1.0)])
    gen = torch.Generator().manual_seed(1)
    outcomes = Counter(tuple(verify_sampled(p, [0], None, gen)) for _ in range(4000))
    assert set(outcomes) == {(0, 2), (1,)}
    assert scipy_stats.binomtest(outcomes[(0, 2)], 4000, 0.5).pvalue > 1e-3


def test_hand_computed_residual():
    """p = (0.1, 0.6, 0.3), q = (0.5, 0.2, 0.3). Draft 0 is accepted with p/q = 0.2;
    the residual max(0, p - q) = (0, 0.4, 0) puts every rejection on token 1."""
    p = torch.stack([dist(0.1, 0.6, 0.3), dist(1.0, 0.0, 0.0)])
    q = dist(0.5, 0.2, 0.3)[None]
    gen = torch.Generator().manual_seed(2)
    outcomes = Counter(tuple(verify_sampled(p, [0], q, gen)) for _ in range(4000))
    assert set(outcomes) == {(0, 0), (1,)}
    assert scipy_stats.binomtest(outcomes[(0, 0)], 4000, 0.2).pvalue > 1e-3


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
def test_emitted_tokens_follow_the_target_whatever_the_draft(one_hot):
    """Two draft positions over a vocabulary of 5: the first emitted token is
    distributed as p1; given it was the accepted draft, the second as p2; given both,
    the bonus as p3. Drafts are drawn from q (or fixed, for one-hot proposals)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.05, 0.4, 0.3, 0.2, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2], [0.1, 0.1, 0.6, 0.1, 0.1]])
    draws = 6000
    first, second, third = Counter(), Counter(), Counter()
    for _ in range(draws):
        draft = [1, 3] if one_hot else torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        out = verify_sampled(p, draft, None if one_hot else q, gen)
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == draft[: len(out) - 1]
        first[out[0]] += 1
        if len(out) >= 2 and out[0] == draft[0]:
            second[out[1]] += 1
        if len(out) == 3:
            third[out[2]] += 1
    for counts, expected in ((first, p[0]), (second, p[1]), (third, p[2])):
        n = sum(counts.values())
        assert n > 300
        observed = [counts[t] for t in range(5)]
        exp = (expected.double() / expected.double().sum() * n).tolist()
        keep = [i for i, e in enumerate(exp) if e > 0]
        assert all(observed[i] == 0 for i in range(5) if i not in keep)
        f_exp = [exp[i] for i in keep]
        f_exp[-1] += n - sum(f_exp)  # exact totals, as chisquare demands
        pvalue = scipy_stats.chisquare([observed[i] for i in keep], f_exp).pvalue
        assert pvalue > 1e-3, (observed, exp)
