"""The narrow records between the scheduler and the model runner: ids and counts.

No tensors, so that the runner could live in another process or rank unchanged.
They carry deltas (vLLM v1's NewRequestData / CachedRequestData): the runner keeps
each request's tokens, block table, sampling parameters, generator and drafts from
its first schedule until it is told the request is gone, and each step says only
what changed. Nothing in a step's record grows with the length of a request.

    step 1:  new    [r1: prompt, params, blocks 0..3, computed 0]
    step 2:  cached [r1: computed 16, blocks keep 4 + [7]]   (r1's sampled token: the runner knows it)
    step 3:  finished_ids [r1]                                 (the runner drops r1)
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner does not hold: first scheduled, or resumed after preemption
    (then ``output_token_ids`` holds what it generated before)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    pooling: PoolingParams | None = None  # an embedding request: pooled, never sampled


@dataclass
class CachedRequestData:
    """A request the runner holds: its block table becomes ``table[:num_kept_blocks] +
    new_block_ids`` (usually an append; copy-on-write or a trim rewrites the tail)."""

    request_id: str
    num_kept_blocks: int
    new_block_ids: list[int]


@dataclass
class ScheduledTokens:
    """One request's share of this step: ``num_tokens`` from ``num_computed_tokens``,
    the last ``len(spec_token_ids)`` of them drafts to verify."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int  # including the drafts
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0  # after sampling, propose up to this many drafts (0: this step does not draft)
    # Tokens whose K/V the request evicted (``KVEviction``): token i sits in cache slot i minus
    # this; when it grew since the runner last heard, the kept keys past the sinks re-rotate.
    num_evicted_tokens: int = 0


@dataclass
class GrammarMasks:
    """The step's grammar masks of constrained sequences (``engine.grammar_masks``):
    request id -> float32 ``[1 + drafts, vocab]`` logit bias, 0 where a token may come
    next and -inf where it may not. Computed while the forward runs; the runner
    waits for them only when it samples. They travel beside the ``ModelInput`` (a
    second argument of ``execute``), never in it: the record stays ids and counts,
    and only the driver, which samples, ever holds them."""

    future: Future

    def get(self) -> dict[str, Any]:
        return self.future.result()


@dataclass
class ModelInput:
    scheduled: list[ScheduledTokens] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    finished_request_ids: list[str] = field(default_factory=list)  # finished or aborted: dropped
    # Preempted: dropped too, but a seeded request's generator is kept, so that its
    # random stream goes on where it was when the request resumes.
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def only(self, request_id: str) -> ModelInput:
        """The same step restricted to one request (to find which one makes a step fail)."""
        return ModelInput(
            scheduled=[s for s in self.scheduled if s.request_id == request_id],
            new_requests=[r for r in self.new_requests if r.request_id == request_id],
            cached_requests=[r for r in self.cached_requests if r.request_id == request_id],
            block_copies=self.block_copies,
            finished_request_ids=self.finished_request_ids,
            preempted_request_ids=self.preempted_request_ids,
        )


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


# a prompt token's logprob, its rank (1: the most likely) and the top k alternatives
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class ModelOutput:
    # request_id -> the tokens the step adds, for each request whose chunk reached its
    # last token: the accepted drafts (if it speculated), then one sampled by the target.
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # to verify next step
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> error: computed nothing
    # request_id -> (index of the first prompt token scored, [(its logprob, top-k)] per
    # token): the prompt tokens this step's chunk predicted (prompt_logprobs requests)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # pooling requests whose prompt is done

    def merge(self, other: ModelOutput) -> None:
        """Add another output's results (a step re-run one request at a time): every field."""
        self.sampled.update(other.sampled)
        self.draft_token_ids.update(other.draft_token_ids)
        self.failed.update(other.failed)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.embeddings.update(other.embeddings)
