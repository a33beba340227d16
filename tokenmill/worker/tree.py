"""Draft token trees: how a tree is laid out, verified and chosen.

A tree drafts several continuations at once (siblings are alternatives for the same
position). Its nodes are listed parents first; ``parents[i]`` is node i's parent (-1:
the verified token the tree grows from, the *root*). In a forward, node i sits at
position root + depth(i) but takes the next K/V slot in order, and sees the context,
its ancestors and itself only (a tree attention mask):

    slots:     root  a    b    a1   b1          a, b: two guesses for position root+1
    positions: r     r+1  r+1  r+2  r+2         a1 follows a, b1 follows b
    a1 sees:   ctx, root, a, a1   (not b, not b1)

Greedy verification walks from the root, at each node taking the child equal to the
target's argmax there; the accepted path's K/V are then moved to the slots of the
positions they now hold (a few slots per layer, no block copies), so the sequence
continues as if it had verified that chain.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        assert p < len(out), "tree nodes must come after their parents"
        out.append(1 if p < 0 else out[p] + 1)
    return out


def verification_layout(parents: list[int], num_real: int, start: int) -> tuple[list[int], torch.Tensor]:
    """(positions, mask [n, n]) of a chunk of ``num_real`` real tokens (the last is the
    root) followed by the tree's nodes, the chunk starting at position ``start``."""
    n = num_real + len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:num_real, :num_real] = torch.ones(num_real, num_real, dtype=torch.bool).tril()
    mask[num_real:, :num_real] = True
    for i, p in enumerate(parents):
        row = num_real + i
        if p >= 0:
            mask[row] |= mask[num_real + p]
        mask[row, row] = True
    root = start + num_real - 1
    return list(range(start, start + num_real)) + [root + d for d in depths(parents)], mask


def greedy_path(parents: list[int], tokens: list[int], argmax: list[int]) -> list[int]:
    """The accepted nodes: from the root, the child whose token is the target's argmax at
    its parent (``argmax[0]``: at the root, ``argmax[1 + i]``: at node i), while one is."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path, node = [], -1
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in children.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def follow(parents: list[int], tokens: list[int], accepted: list[int]) -> list[int]:
    """The nodes of the path whose tokens are ``accepted`` (siblings hold different tokens)."""
    path, node = [], -1
    for want in accepted:
        node = next(i for i, p in enumerate(parents) if p == node and tokens[i] == want)
        path.append(node)
    return path


def best_first(
    roots: list[tuple[int, float]],
    expand: Callable[[list[int], int], list[tuple[int, float]]],
    size: int,
    min_score: float = 0.0,
) -> tuple[list[int], list[int], list[float]]:
    """The ``size`` most probable nodes of a tree whose children come from ``expand(path,
    depth)`` [(token, probability)], grown best-first by the product of probabilities
    along the path (a product only falls going down, so the set is parents-closed).
    Returns (tokens, parents, scores) in the order taken (parents first)."""
    heap = [(-p, i, -1, t) for i, (t, p) in enumerate(roots)]
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    paths: list[list[int]] = []
    counter = len(heap)
    while heap and len(tokens) < size:
        neg, _, parent, token = heapq.heappop(heap)
        if -neg < min_score:
            break
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        paths.append((paths[parent] if parent >= 0 else []) + [token])
        for t, p in expand(paths[node], len(paths[node])):
            heapq.heappush(heap, (neg * p, counter, node, t))
            counter += 1
    return tokens, parents, scores
