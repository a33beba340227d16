"""Speculate only while it pays, measured on this machine.

Whether drafting speeds decoding up depends on the hardware as much as on the
proposer: on a GPU verifying five tokens costs about what one does, on two CPU cores
several times as much. Instead of a fixed rule, the runner measures: decoding runs in
windows of a few steps with drafting on or off, each window's output tokens per second
go into a moving average for its arm, and the next window takes the better arm, trying
the other one now and then (the workload and the load change), less and less often
while it keeps losing (every ``explore_every`` windows, doubling up to 64). Steps with a
prompt chunk are not counted: their cost says nothing about speculation.
"""

from __future__ import annotations

MAX_INTERVAL = 64


class PayOrPause:
    def __init__(self, window: int = 8, explore_every: int = 6, smoothing: float = 0.5) -> None:
        self.window, self.explore_every, self.smoothing = window, explore_every, smoothing
        self.rate: dict[bool, float | None] = {True: None, False: None}  # tokens/s with drafting on / off
        self.drafting = True
        self.windows = 0
        self._interval = explore_every  # windows between tries of the slower arm
        self._since_try = 0
        self._best: bool | None = None
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """A decode step: ``tokens`` emitted in ``seconds`` (forward, sampling, drafting)."""
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        if self._steps < self.window:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        old = self.rate[self.drafting]
        self.rate[self.drafting] = rate if old is None else self.smoothing * old + (1 - self.smoothing) * rate
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        self.windows += 1
        on, off = self.rate[True], self.rate[False]
        if on is None or off is None:
            self.drafting = on is None  # each arm measured once first
            return
        best = on >= off
        if best != self._best:  # the other arm won (or this is the first comparison): try often again
            self._best, self._interval = best, self.explore_every
        elif self.drafting != best:  # a try of the slower arm confirmed it: wait longer before the next
            self._interval = min(2 * self._interval, MAX_INTERVAL)
        self._since_try += 1
        if self._since_try >= self._interval:
            self._since_try = 0
            self.drafting = not best
        else:
            self.drafting = best
