"""Output processing in one place: detokenising, stop strings, logprobs, RequestOutput.

The scheduler reports what each step did to each sequence (``SeqUpdate``: the tokens
it kept, or why it ended); this module turns that into the user's view. It holds
each sequence's append-only record (token ids, logprobs, the incremental
detokenizer), so each step costs O(new tokens) and outputs carry deltas; the whole
text is joined only when somebody reads it.

A stop string is text, so it is found here; the sequence's tokens after the one that
completed it are dropped, and the engine is told to end the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import Decoder, IncrementalDetokenizer
from tokenmill.engine.outputs import CompletionOutput, RequestOutput, TopLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import SeqUpdate


@dataclass
class SeqOutputState:
    """One sequence's output so far (a ``CompletionSource``)."""

    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    stop_string: str | None = None  # set when a stop string ended the sequence

    def text_prefix(self, num_chars: int) -> str:
        return self.detok.text_prefix(num_chars)


class OutputProcessor:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, SeqOutputState] = {}  # by sequence id

    def add(self, req: Request) -> None:
        p = req.params
        detok = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output, p.skip_special_tokens
        )
        wants = p.logprobs is not None
        self._seqs[req.request_id] = SeqOutputState(detok, logprobs=[] if wants else None, top_logprobs=[] if wants else None)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[tuple[Request, str]]]:
        """Outputs for the step's updates, and the sequences a stop string ended
        (the caller tells the scheduler to finish them)."""
        now = time.perf_counter()
        outputs, stopped = [], []
        for u in updates:
            state = self._seqs.get(u.request.request_id)
            if state is None:
                continue
            new_ids = self._append(u, state, now)
            if state.stop_string is not None and not u.request.finished:
                stopped.append((u.request, state.stop_string))
            outputs.append(self._output(u.request, state, new_ids, u.error, finished=u.request.finished or state.stop_string is not None))
        return outputs, stopped

    def _append(self, u: SeqUpdate, state: SeqOutputState, now: float) -> list[int]:
        req, timings = u.request, u.request.timings
        new_ids = []
        for t in u.new_tokens:
            state.token_ids.append(t.token_id)
            new_ids.append(t.token_id)
            timings.token_times.append(now)
            timings.first_token = timings.first_token or now
            if state.logprobs is not None and state.top_logprobs is not None:
                state.logprobs.append(t.logprob)
                state.top_logprobs.append(t.top_logprobs)
            if req.finished and req.stop_reason == t.token_id and t is u.new_tokens[-1]:
                break  # a stop token id: not detokenised into the text
            stop = state.detok.add_token(t.token_id)
            if stop is not None:
                state.stop_string = stop
                break
        return new_ids

    def _output(
        self, req: Request, state: SeqOutputState, new_ids: list[int], error: str | None, finished: bool
    ) -> RequestOutput:
        if finished and state.stop_string is None:
            state.detok.flush()  # a stop string truncated the text already
        delta = state.detok.take_delta(finished)
        n = len(new_ids)
        completion = CompletionOutput(
            index=req.index,
            finish_reason="stop" if state.stop_string is not None else req.finish_reason,
            stop_reason=state.stop_string if state.stop_string is not None else req.stop_reason,
            _source=state,
            _num_tokens=len(state.token_ids),
            _num_chars=state.detok.num_chars,
        )
        if finished:
            self._seqs.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.parent_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            timings=[req.timings],
            delta_text=delta,
            delta_token_ids=new_ids,
            delta_logprobs=None if state.logprobs is None else state.logprobs[len(state.logprobs) - n :],
            delta_top_logprobs=None if state.top_logprobs is None else state.top_logprobs[len(state.top_logprobs) - n :],
            error=error,
            num_cached_tokens=req.num_cached_prompt_tokens,
        )

    def abort(self, req: Request) -> None:
        """Forget a sequence that ends without an output (aborted by its caller)."""
        self._seqs.pop(req.request_id, None)
