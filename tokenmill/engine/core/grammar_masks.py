"""Structured output in the engine: one grammar matcher per sequence, masks per step.

The matcher lives on the ``Request`` (``request.grammar``), so it survives
preemption and recompute unchanged: recomputing a sequence's KV does not change
the tokens it has produced, nor the matcher's position after them.

Each step, for every sequence that samples and has a grammar:

1. ``start_masks`` computes, on a background thread while the forward runs, one
   token bitmask per sampled row: the row of the next token, and for a sequence
   verifying k drafts one more row after each draft (the matcher is advanced
   through the drafts, then rolled back), turned into an additive logit bias (0 or
   -inf). The runner adds it to the logits before anything else in sampling, so
   penalties, logprobs, seeded sampling and draft verification all see the masked
   distribution.
2. the scheduler (``update_from_output``) moves each matcher past the tokens the
   step kept, one by one: a grammar that is complete ends its sequence with
   ``stop`` there (tokens after it, e.g. a bonus token after accepted drafts, are
   dropped as after a stop token); new drafts are cut at the first token the
   grammar would refuse (a proposer that proposes fewer tokens, so verification
   stays lossless).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tokenmill.engine.core.scheduler import SchedulerOutput
from tokenmill.engine.model_input import GrammarMasks
from tokenmill.errors import InvalidRequestError
from tokenmill.structured.constraint import StructuredOutputs
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler, bitmask_words


class StructuredOutputManager:
    """The engine's side of structured output: compiling, and each step's masks.

    Compiles run on one thread of their own (``submit``), never on a pool that
    tokenising or other requests wait on: a burst of big schemas queues behind itself,
    takes at most one core, and each request waits at most ``grammar_compile_timeout``
    before it is refused."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        # (at the engine's own priority: a compile thread at nice 19 holds the GIL whenever it
        # runs Python, and on a busy machine the scheduler starves it while it holds it, and with
        # it the engine's steps and heartbeat: three busy processes on two cores got the core
        # killed as unresponsive after 30 s, tests/server/test_engine_core_process.py)
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar-compile")

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (or find in the cache) on the caller's thread; thread-safe, raises
        InvalidRequestError."""
        return self._compiler().compile(spec)

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """Compile on the compile thread (a cached grammar: at once). A spec refused
        on its size raises here, before it waits for anything."""
        compiler = self._compiler()
        compiler.check_size(spec)
        hit = compiler.cached(spec)
        if hit is None:
            return self._compiles.submit(compiler.compile, spec)
        done: Future[CompiledGrammar] = Future()
        done.set_result(hit)
        return done

    @property
    def compile_timeout(self) -> float:
        return self._compiler().config.grammar_compile_timeout

    def timeout_error(self, spec: StructuredOutputs) -> InvalidRequestError:
        """What a request whose grammar did not compile within the timeout gets."""
        return InvalidRequestError(
            f"structured output {spec.kind} did not compile within {self.compile_timeout:g} s "
            "(--grammar-compile-timeout); simplify it, or retry when the server is less busy",
            param=spec.kind,
        )

    def _compiler(self) -> GrammarCompiler:
        if self.compiler is None:
            raise InvalidRequestError("structured output is not available: no grammar backend (pip install llguidance)")
        return self.compiler

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


def _fill_masks(jobs: list[tuple[str, Any, list[int]]], words: int) -> dict[str, np.ndarray]:
    rows = sum(1 + len(drafts) for _, _, drafts in jobs)
    bitmask = np.zeros((rows, words), dtype=np.int32)
    spans, row = {}, 0
    for rid, matcher, drafts in jobs:
        matcher.fill_bitmask(bitmask, row)
        for i, token in enumerate(drafts):  # drafts were cut to what the grammar allows
            if not matcher.accept([token]):
                raise RuntimeError(f"{rid}: draft token {token} refused by its grammar")
            matcher.fill_bitmask(bitmask, row + 1 + i)
        matcher.rollback(len(drafts))
        spans[rid] = (row, 1 + len(drafts))
        row += 1 + len(drafts)
    bias = bitmask_to_bias(bitmask)
    return {rid: bias[start : start + n] for rid, (start, n) in spans.items()}


def bitmask_to_bias(bitmask: np.ndarray) -> np.ndarray:
    """Token bitmask (int32 words, bit t of a row: token t allowed) -> an additive float32
    logit bias, 0 where allowed and -inf elsewhere. Adding is several times faster than
    a masked fill (32 rows of 49k: 0.3 ms against 5 ms), and this part runs here, on
    the mask thread, while the forward runs. The -inf is built from its bits
    (0xFF800000): (bit - 1) is 0 or all ones, and-ed with them."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return ((bits.astype(np.int32) - 1) & np.int32(-8388608)).view(np.float32)
