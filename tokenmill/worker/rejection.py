"""Verification of drafted tokens against the target model: lossless by construction.

Greedy requests accept the longest prefix of the draft that equals the target's
argmax, then add the target's own token at the first mismatch (or after the last
draft). Sampled requests use speculative sampling (Leviathan et al. 2023; Chen et al.
2023): draft token d_i, drawn from the draft's distribution q_i, is accepted with
probability min(1, p_i(d) / q_i(d)); at the first rejection the replacement is drawn
from the residual max(0, p_i - q_i), normalised; if all k are accepted a bonus token
is drawn from p_{k+1}. Every emitted token is then distributed exactly as the target
would have sampled it. A proposer without probabilities (n-gram lookup) is a draft
that is certain of its token: q_i is one-hot, so acceptance is p_i(d) and the
residual is p_i with d removed.

    positions:   n-1      n       n+1   ...   n+k-1
    input:       last     d1      d2    ...   dk
    target p:    p1       p2      p3    ...   p_{k+1}     (p_i judges d_i)
"""

from __future__ import annotations

import torch


def race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one index with probability ``probs[i]`` (the exponential race: argmax p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax: k+1 tokens, the target's choice at each position. Returns the
    accepted draft tokens followed by the target's token after them."""
    assert len(target_argmax) == len(draft) + 1
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


def verify_sampled(
    p: torch.Tensor,  # [k+1, vocab] target probabilities after the request's sampling transforms
    draft: list[int],  # k tokens
    q: torch.Tensor | None,  # [k, vocab] draft probabilities they were drawn from; None: one-hot
    generator: torch.Generator | None,
) -> list[int]:
    k = len(draft)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] >= k)
    if k == 0:
        return [race(p[0], generator)]
    rows = torch.arange(k, device=p.device)
    d = torch.tensor(draft, device=p.device)
    p_d = p[rows, d]
    q_d = q[rows, d] if q is not None else torch.ones_like(p_d)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_d < p_d).tolist()  # u < p/q without dividing by a zero q
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return draft + [race(p[k], generator)]
    if q is not None:
        residual = (p[n] - q[n]).clamp_(min=0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0
    if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
        residual = p[n]
    return draft[:n] + [race(residual / residual.sum(), generator)]
