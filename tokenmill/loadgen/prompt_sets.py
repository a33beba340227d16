"""A workload file's rows as disjoint prompt sets whose runs never repeat a prompt.

A server with a prefix cache computes a prompt it has seen before in no time: a file's 64
rows cycled into 240 requests are three quarters cache hits, and the TTFT measured is a
fraction of what the same rate costs with the user's traffic, which does not repeat itself.
Nor is a set "none of the search saw" if it is the same rows at another offset.

* ``prompt_sets`` deals the rows into ``k`` disjoint sets, row i to set i mod k (dealt,
  not cut: a file sorted by length or by topic still gives every set its spread). tune's
  search takes one set and each of its validation sets another.
* ``PromptStream`` hands out one set's requests in order, never the same one twice: the
  rows themselves first, then, once a run (or a server's runs together) needs more than the
  set holds, each row again *varied*: a short tag, unique to the copy, inserted where the
  row leaves the longest prefix it shares with any other row of the file. A varied prompt
  thus shares with any other at most what the file's own rows share with each other (a
  common system prompt stays a prefix-cache hit, as in the user's traffic; the rest is
  computed afresh, as the user's next prompt would be), plus at most a character or two
  of tag. Its length is the row's plus a few tokens.

Varied rather than refused: a minute's validation at 4 req/s needs 240 prompts per set,
and a file of the user's 64 real prompts is what they have; what decides latency is the
prompts' lengths and what the server can reuse, and varying keeps both. A file with fewer
rows than sets is refused (``ValueError``): a set with no row has nothing to vary.

``PromptSets`` is what tune reads once and holds per server (``for_server``): a file's sets as above, or bench serve's
synthetic workloads drawn per (set, rate) from seeds no other set uses.
"""

from __future__ import annotations

import copy
import os

SYNTHETIC = ("mixed", "shared-prefix")
SET_SEEDS = 2**32  # synthetic set k's seeds are k * 2**32 + [0, 2**32): no set's prompts are another's


def shared_prefixes(prompts: list[str]) -> list[int]:
    """For each prompt, the length of the longest prefix it shares with any other (its whole
    length if it is repeated). Sorted, a string's longest common prefix with any other is
    with one of its neighbours."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    out = [0] * len(prompts)
    for a, b in zip(order, order[1:], strict=False):
        n = len(os.path.commonprefix([prompts[a], prompts[b]]))
        out[a], out[b] = max(out[a], n), max(out[b], n)
    return out


def copy_tag(j: int) -> str:
    """The ``j``-th varied copy's tag: ``j`` in hex, lowest digit first, six digits and a
    space. Unique per copy, and two copies' tags share a leading digit only if their numbers
    agree modulo 16 (two digits: modulo 256), so a tag adds a character or two of sharing."""
    digits = f"{j % 16**6:06x}"[::-1]
    return digits + " "


class PromptStream:
    """One set's requests, in order, none twice: its rows, then its rows varied (pass 1,
    2, ...: every copy its own tag at the row's ``cut``). One per server: a server's runs
    draw from it in turn, so no run sends a prompt an earlier run on that server sent."""

    def __init__(self, rows: list[dict], cuts: list[int]) -> None:
        assert rows and len(rows) == len(cuts)
        self.rows, self.cuts = rows, cuts
        self.taken = 0  # requests handed out so far

    def take(self, n: int) -> tuple[list[dict], int]:
        """The next ``n`` requests, and how many of them are varied copies."""
        out, varied = [], 0
        for _ in range(n):
            n_pass, i = divmod(self.taken, len(self.rows))
            row = self.rows[i]
            if n_pass:
                j = self.taken - len(self.rows)  # the copy's number in this stream
                prompt, cut = row["prompt"], self.cuts[i]
                row = {**row, "prompt": prompt[:cut] + copy_tag(j) + prompt[cut:]}
                varied += 1
            out.append(row)
            self.taken += 1
        return out, varied


def prompt_sets(rows: list[dict], k: int) -> list[PromptStream]:
    """The file's rows dealt into ``k`` disjoint sets (row i to set i mod k), each a fresh
    ``PromptStream`` whose varied copies are cut where each row leaves the prefixes it
    shares with the whole file's rows."""
    if len(rows) < k:
        raise ValueError(
            f"{len(rows)} prompt(s), but {k} disjoint prompt sets need at least {k} (one row each; more rows, "
            "fewer varied copies)"
        )
    bad = next((i for i, r in enumerate(rows) if not isinstance(r["prompt"], str)), None)
    if bad is not None:
        raise ValueError(
            f"row {bad + 1}: the prompt must be text to be varied, got {type(rows[bad]['prompt']).__name__}"
        )
    cuts = shared_prefixes([r["prompt"] for r in rows])
    return [PromptStream(rows[s::k], cuts[s::k]) for s in range(k)]


class PromptSets:
    """One server's prompts, in ``k`` disjoint sets: no prompt in two sets, and none sent
    twice to one server unless the user's file repeats it.

    ``workload``: a JSONL file, its rows dealt into the sets (``prompt_sets``), each set's
    runs drawn from it in turn and its rows varied once the server needs more than it
    holds; or ``mixed`` / ``shared-prefix``, drawn afresh per (set, rate) from seeds no
    other set uses (a server runs each rate once per set: tune's ``climb`` and ``validate``
    never return to one). Two servers' runs in the same order get the same prompts."""

    def __init__(self, workload: str, k: int, seed: int) -> None:
        from tokenmill.loadgen.serve import load_jsonl

        self.workload, self.k, self.seed = workload, k, seed
        self.sets: list[PromptStream] | None = None
        if workload in SYNTHETIC:
            return
        try:
            rows = load_jsonl(workload)  # a bad line: a ValueError naming the file and the line
        except OSError as e:
            raise ValueError(f"{workload}: {e.strerror or e}") from None
        try:
            self.sets = prompt_sets(rows, k)
        except ValueError as e:
            raise ValueError(f"{workload}: {e}") from None

    def for_server(self) -> PromptSets:
        """The same sets, none of their prompts sent yet: a new server's (the file read once)."""
        fresh = copy.copy(self)
        if self.sets is not None:
            fresh.sets = [PromptStream(s.rows, s.cuts) for s in self.sets]
        return fresh

    def take(self, n: int, rate: float, prompt_set: int) -> tuple[list[dict], int]:
        """``n`` requests of set ``prompt_set`` for a run at ``rate``, and how many of them
        are varied copies of the file's rows."""
        if self.sets is not None:
            return self.sets[prompt_set].take(n)
        from tokenmill.loadgen.serve import synthetic

        seed = (self.seed + round(rate * 1000)) % SET_SEEDS + prompt_set * SET_SEEDS
        return synthetic(self.workload, n, seed), 0

    def describe(self) -> str:
        if self.sets is None:
            return f"{self.workload}: synthetic, {self.k} prompt sets from disjoint seeds"
        sizes = "/".join(str(len(s.rows)) for s in self.sets)
        return (
            f"{self.workload}: {sum(len(s.rows) for s in self.sets)} rows dealt into {self.k} disjoint prompt sets "
            f"({sizes} rows); a server that needs more of a set than its rows gets them again varied"
        )
