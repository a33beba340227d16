"""Each client's share of one step's prompt tokens (the scheduler's fairness by tokens).

A request carries an opaque ``client`` (the server sets an API key's digest or a peer
address; offline requests share one). Counting requests is not fair: one client's
2,048 embedding inputs of 127 tokens each, let in a few at a time, still filled every
step's budget, and another client's prompt waited behind them for minutes (issue 57).
So while several clients have prompt tokens to compute, a client's prompt chunks in
one step take at most ``budget // n`` tokens, n being the clients whose most urgent
prompt is at least as urgent as its own (under fcfs, all clients with prompts; under
the priority policy a more urgent client is not held back by less urgent ones). A
client alone takes the whole budget, as before. Decodes are never held back: a
sequence's one token (and its drafts) is bounded by ``max_num_seqs`` already, and it
is what other clients' streams wait on.

The share is not handed on when a client leaves part of it: the step is shorter
instead, which is what the other clients' requests wait on.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from tokenmill.engine.core.request import Request


class TokenShares:
    """One step's prompt-token shares, built from the requests with prompt tokens to
    compute; ``level(req)``: how urgent a request is (lower: more; one value for all
    under fcfs)."""

    def __init__(self, budget: int, prompts: Iterable[Request], level: Callable[[Request], Any]) -> None:
        best: dict[str, Any] = {}
        for req in prompts:
            key = level(req)
            if req.client not in best or key < best[req.client]:
                best[req.client] = key
        levels = sorted(best.values())
        # a client competes with those whose most urgent prompt is as urgent as its own, or more
        self._share = {c: max(1, budget // bisect.bisect_right(levels, key)) for c, key in best.items()}
        self._budget = budget
        self._used: Counter[str] = Counter()

    def left(self, client: str) -> int:
        """Prompt tokens the client may still take this step."""
        return max(0, self._share.get(client, self._budget) - self._used[client])

    def take(self, client: str, num_tokens: int) -> None:
        self._used[client] += num_tokens
