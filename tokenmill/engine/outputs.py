"""What the engine hands back: per-request outputs, as plain data.

Each step's ``RequestOutput`` carries what the step added (``delta_text``,
``delta_token_ids``, ``delta_logprobs``). The cumulative ``text``, ``token_ids`` and
``logprobs`` of a completion are built when first read, from the sequence's
append-only record, as it stood when the output was made: a streamed request costs
O(new tokens) a step, and O(length) only for a caller who asks for the whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.engine.model_input import SampledToken

TopLogprobs = list[tuple[int, float]]


@dataclass
class RequestTimings:
    """Wall-clock times (time.perf_counter seconds) of a request's life."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class SeqDelta:
    """What one step did to one sequence, as plain data: the engine core's output, which
    the output processor turns into the user's view (in the same process for the offline
    ``LLM``, in the API process for ``tokenmill serve``)."""

    seq_id: str
    new_tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None  # set once the core has ended the sequence
    stop_reason: str | int | None = None
    error: str | None = None
    first_scheduled: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prompt_logprobs: list[Any] | None = None  # more prompt tokens' (logprob, rank, top-k), in order from token 1
    embedding: list[float] | None = None  # a pooling request's, with its finish


class CompletionSource(Protocol):
    """A sequence's append-only output record (the output processor's)."""

    token_ids: list[int]
    logprobs: list[float | None] | None
    top_logprobs: list[TopLogprobs] | None

    def text_prefix(self, num_chars: int) -> str: ...


@dataclass
class CompletionOutput:
    index: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    _source: CompletionSource | None = field(default=None, repr=False, compare=False)
    _num_tokens: int = 0
    _num_chars: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [] if self._source is None else self._source.token_ids[: self._num_tokens]

    @property
    def text(self) -> str:
        return "" if self._source is None else self._source.text_prefix(self._num_chars)

    @property
    def logprobs(self) -> list[float | None] | None:
        lps = None if self._source is None else self._source.logprobs
        return None if lps is None else lps[: self._num_tokens]

    @property
    def top_logprobs(self) -> list[TopLogprobs] | None:
        tops = None if self._source is None else self._source.top_logprobs
        return None if tops is None else tops[: self._num_tokens]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    timings: list[RequestTimings] = field(default_factory=list)
    # Streaming: what this step added to the completion in outputs[0].
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[float | None] | None = None
    delta_top_logprobs: list[TopLogprobs] | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: each prompt token's logprob (the first: None) and
    # top-k alternatives, as far as computed (whole once the first token is out)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1: the argmax)
    embedding: list[float] | None = None  # SamplingParams.pooling: the pooled, normalised final hidden state

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
