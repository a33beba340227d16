"""A sequence and all its scheduling state, in one dataclass.

Only the scheduler (and the KV manager it drives) changes it: ``status``,
``num_computed_tokens``, the tokens appended after each step, the blocks it holds;
the engine core stamps ``first_scheduled``. What a user sees (text, logprobs,
timings) is the output processor's; what the model needs per step is the runner's
own copy, kept in step by the deltas ``RunnerSync`` builds (the block table itself
knows how much of it the runner holds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.core.block_table import BlockTable
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without building the whole list."""
    p = len(prompt)
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:end] + output[: max(0, end - p)]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # an embedding request's: one step that samples nothing (``pooling`` says how it ends)
    pooling: PoolingParams | None = None  # an embedding request: its prompt's hidden states pooled
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: BlockTable = field(default_factory=BlockTable)  # knows how much of it the runner holds
    num_freed_blocks: int = 0  # leading entries given back once they left a sliding window (FREED)
    num_evicted_tokens: int = 0  # computed tokens whose K/V were evicted (``KVEviction``): out of the table
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of all_token_ids
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_preemptions: int = 0
    arrival: int = 0  # the scheduler's count of requests added before it (the priority policy's tie-break)
    arrival_step: int = 0  # the scheduler's count of steps before it was added (the priority policy's aging)
    client: str = (
        ""  # whom it is for, opaque: a step's prompt tokens are shared between clients (engine/core/fairness.py)
    )
    fork_of: str | None = None  # n > 1: the sibling whose prompt blocks this one shares
    parent_id: str = ""  # the user's request id (this sequence is completion `index` of it)
    index: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify next step
    grammar: Any = None  # structured output: its GrammarMatcher, kept across preemption
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    hash_root: bytes | None = None  # seeds its block hashes: an adapter's requests share blocks only among themselves
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    first_scheduled: float | None = None  # when a step first gave it tokens (time.perf_counter)
    embedding: list[float] | None = None  # a pooling request's result
    # prompt_logprobs: prompt tokens 1.. scored so far, and how many of them were sent out
    prompt_logprobs: list[Any] = field(default_factory=list)
    num_prompt_logprobs_sent: int = 0

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id

    @property
    def num_kv_tokens(self) -> int:
        """Computed tokens whose K/V it holds: its cache's length (its table's slots in use)."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def evicts(self) -> bool:
        """Its tokens' K/V may be evicted (``KVEviction``): it neither reads nor fills the
        prefix cache (its kept keys are re-rotated in place) and never drafts."""
        return self.params.kv_eviction is not None

    @property
    def streams(self) -> bool:
        """StreamingLLM eviction: its cache, not its length, is bounded by the context."""
        ev = self.params.kv_eviction
        return ev is not None and ev.streams

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (per-step path)."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It scores its prompt (and is not a fork, whose sibling does that)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def computes_whole_prompt(self) -> bool:
        """It needs every prompt position computed: no prefix-cache hit (prompt logprobs,
        mean pooling)."""
        return self.wants_prompt_logprobs or (self.pooling is not None and self.pooling.pooling_type == "mean")

    def add_prompt_logprobs(self, first: int, entries: list[Any]) -> bool:
        """Scores of prompt tokens first, first + 1, ...; those it has (a recompute after
        preemption scores them again) are skipped. False: they leave a gap (scores of a
        chunk were lost), which no later step fills."""
        have = 1 + len(self.prompt_logprobs)  # the next index wanted (token 0 has none)
        if first > have:
            return False
        if have < first + len(entries):
            self.prompt_logprobs.extend(entries[have - first :])
        return True

    def take_prompt_logprobs(self) -> list[Any] | None:
        """The scores not sent yet (None: none)."""
        new = self.prompt_logprobs[self.num_prompt_logprobs_sent :]
        self.num_prompt_logprobs_sent = len(self.prompt_logprobs)
        return new or None
