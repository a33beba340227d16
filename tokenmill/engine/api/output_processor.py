"""Output processing in one place: detokenising, stop strings, logprobs, RequestOutput.

The engine core reports what each step did to each sequence (``SeqDelta``: the tokens
it kept, or why it ended, as plain data); this module turns that into the user's
view. It holds each sequence's append-only record (token ids, logprobs, the
incremental detokenizer, timings), so each step costs O(new tokens) and outputs carry
deltas; the whole text is joined only when somebody reads it. It needs no engine
state, so it runs wherever the user is: beside the core in ``Engine``, or in the API
process when the core has a process of its own.

A stop string is text, so it is found here; the sequence's tokens after the one that
completed it are dropped, and the caller tells the core to end the sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.api.detokenizer import Decoder, IncrementalDetokenizer
from tokenmill.engine.outputs import CompletionOutput, RequestOutput, RequestTimings, SeqDelta, TopLogprobs
from tokenmill.sampling_params import SamplingParams


@dataclass
class SeqOutputState:
    """One sequence's output so far (a ``CompletionSource``)."""

    request_id: str  # the user's (the sequence is completion `index` of it)
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    timings: RequestTimings = field(default_factory=RequestTimings)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    stop_string: str | None = None  # set when a stop string ended the sequence
    stop_token_ids: tuple[int, ...] = ()  # the request's: a stop by one is its stop_reason (EOS: None)
    min_tokens: int = 0  # stop strings are looked for from this many tokens on
    # prompt_logprobs (sequence 0 of a request only): per prompt token, its logprob and
    # top-k alternatives; token 0 has none
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    prompt_ranks: list[int | None] | None = None

    def text_prefix(self, num_chars: int) -> str:
        return self.detok.text_prefix(num_chars)


class OutputProcessor:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, SeqOutputState] = {}  # by sequence id

    def add(
        self,
        seq_id: str,
        request_id: str,
        index: int,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Follow a sequence (its arrival time is now)."""
        p = params
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, p.stop, p.include_stop_str_in_output, p.skip_special_tokens
        )
        wants = p.logprobs is not None
        self._seqs[seq_id] = SeqOutputState(
            request_id,
            index,
            prompt,
            prompt_ids,
            detok,
            logprobs=[] if wants else None,
            top_logprobs=[] if wants else None,
            stop_token_ids=p.stop_token_ids,
            min_tokens=p.min_tokens,
        )
        if p.prompt_logprobs is not None and index == 0:
            state = self._seqs[seq_id]
            state.prompt_logprobs, state.prompt_top_logprobs, state.prompt_ranks = [None], [[]], [None]

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def process(self, deltas: list[SeqDelta]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Outputs for the step's deltas, and the sequences a stop string ended, as
        (sequence id, stop string): the caller tells the core to finish them."""
        now = time.perf_counter()
        outputs, stopped = [], []
        for d in deltas:
            state = self._seqs.get(d.seq_id)
            if state is None:  # aborted, or already ended by a stop string
                continue
            state.timings.first_scheduled = state.timings.first_scheduled or d.first_scheduled
            if d.prompt_logprobs and state.prompt_logprobs is not None:
                assert state.prompt_top_logprobs is not None and state.prompt_ranks is not None
                state.prompt_logprobs.extend(lp for lp, _, _ in d.prompt_logprobs)
                state.prompt_ranks.extend(rank for _, rank, _ in d.prompt_logprobs)
                state.prompt_top_logprobs.extend(top for _, _, top in d.prompt_logprobs)
            new_ids = self._append(d, state, now)
            if state.stop_string is not None and d.finish_reason is None:
                stopped.append((d.seq_id, state.stop_string))
            outputs.append(self._output(d, state, new_ids, now))
        return outputs, stopped

    def _append(self, d: SeqDelta, state: SeqOutputState, now: float) -> list[int]:
        timings = state.timings
        new_ids = []
        for t in d.new_tokens:
            state.token_ids.append(t.token_id)
            new_ids.append(t.token_id)
            timings.token_times.append(now)
            timings.first_token = timings.first_token or now
            if state.logprobs is not None and state.top_logprobs is not None:
                state.logprobs.append(t.logprob)
                state.top_logprobs.append(t.top_logprobs)
            if d.finish_reason is not None and d.stop_reason == t.token_id and t is d.new_tokens[-1]:
                break  # a stop token id: not detokenised into the text
            stop = state.detok.add_token(t.token_id, check_stop=len(state.token_ids) > state.min_tokens)  # as vLLM
            if stop is not None:
                state.stop_string = stop
                break
        return new_ids

    def _output(self, d: SeqDelta, state: SeqOutputState, new_ids: list[int], now: float) -> RequestOutput:
        finished = d.finish_reason is not None or state.stop_string is not None
        if finished and state.stop_string is None:
            state.detok.flush()  # a stop string truncated the text already
        delta = state.detok.take_delta(finished)
        n = len(new_ids)
        completion = CompletionOutput(
            index=state.index,
            finish_reason="stop" if state.stop_string is not None else d.finish_reason,
            stop_reason=state.stop_string
            if state.stop_string is not None
            else d.stop_reason
            if d.stop_reason in state.stop_token_ids
            else None,  # (as vLLM: None for EOS)
            _source=state,
            _num_tokens=len(state.token_ids),
            _num_chars=state.detok.num_chars,
        )
        if finished:
            state.timings.finished = now
            del self._seqs[d.seq_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            timings=[state.timings],
            delta_text=delta,
            delta_token_ids=new_ids,
            delta_logprobs=None if state.logprobs is None else state.logprobs[len(state.logprobs) - n :],
            delta_top_logprobs=None
            if state.top_logprobs is None
            else state.top_logprobs[len(state.top_logprobs) - n :],
            error=d.error,
            num_cached_tokens=d.num_cached_tokens,
            prompt_logprobs=state.prompt_logprobs,
            prompt_top_logprobs=state.prompt_top_logprobs,
            prompt_ranks=state.prompt_ranks,
            embedding=d.embedding,
        )

    def abort(self, seq_id: str) -> None:
        """Forget a sequence that ends without an output (aborted by its caller)."""
        self._seqs.pop(seq_id, None)
