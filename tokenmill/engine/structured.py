"""Structured output in the engine: one grammar matcher per sequence, masks per step.

The matcher lives on the ``Request`` (``request.grammar``), so it survives
preemption and recompute unchanged: recomputing a sequence's KV does not change
the tokens it has produced, nor the matcher's position after them.

Each step, for every sequence that samples and has a grammar:

1. ``start_masks`` computes, on a background thread while the forward runs, one
   token bitmask per sampled row: the row of the next token, and for a sequence
   verifying k drafts one more row after each draft (the matcher is advanced
   through the drafts, then rolled back). The runner applies them to the logits
   before anything else in sampling, so penalties, logprobs, seeded sampling and
   draft verification all see the masked distribution.
2. the scheduler (``update_from_output``) moves each matcher past the tokens the
   step kept, one by one: a grammar that is complete ends its sequence with
   ``stop`` there (tokens after it, e.g. a bonus token after accepted drafts, are
   dropped as after a stop token); new drafts are cut at the first token the
   grammar would refuse (a proposer that proposes fewer tokens, so verification
   stays lossless).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tokenmill.engine.model_input import GrammarMasks
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler, bitmask_words
from tokenmill.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (or find in the cache); thread-safe, raises InvalidRequestError."""
        if self.compiler is None:
            raise InvalidRequestError("structured output is not available: no grammar backend (pip install llguidance)")
        return self.compiler.compile(spec)

    # ------------------------------------------------------------ before a step

    def start_masks(self, sched: SchedulerOutput) -> GrammarMasks | None:
        """Bitmasks for the step's constrained sampling rows, computed in the background."""
        jobs = []
        for s in sched.seqs:
            req = s.request
            num_real = s.num_new_tokens - len(s.spec_token_ids)
            if req.grammar is not None and req.num_computed_tokens + num_real == req.num_tokens:
                jobs.append((req.request_id, req.grammar, list(s.spec_token_ids)))
        if not jobs:
            return None
        assert self.compiler is not None
        words = bitmask_words(self.compiler.vocab_size)
        future: Future[dict[str, np.ndarray]] = self._executor.submit(_fill_masks, jobs, words)
        return GrammarMasks(future)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _fill_masks(jobs: list[tuple[str, Any, list[int]]], words: int) -> dict[str, np.ndarray]:
    rows = sum(1 + len(drafts) for _, _, drafts in jobs)
    bitmask = np.zeros((rows, words), dtype=np.int32)
    out, row = {}, 0
    for rid, matcher, drafts in jobs:
        matcher.fill_bitmask(bitmask, row)
        for i, token in enumerate(drafts):  # drafts were cut to what the grammar allows
            if not matcher.accept([token]):
                raise RuntimeError(f"{rid}: draft token {token} refused by its grammar")
            matcher.fill_bitmask(bitmask, row + 1 + i)
        matcher.rollback(len(drafts))
        out[rid] = bitmask[row : row + 1 + len(drafts)]
        row += 1 + len(drafts)
    return out
