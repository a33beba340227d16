"""The narrow record the engine hands the model runner each step: ids and counts.

No tensors, so that the runner could live in another process or rank unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass
class SeqInput:
    """One sequence's share of a step.

    ``token_ids`` are the tokens to compute now; they sit at positions
    ``num_computed_tokens .. num_computed_tokens + len(token_ids) - 1``, and their
    K/V go to the slots that ``block_table`` gives those positions. When the
    sequence speculates, the last ``len(spec_token_ids)`` of them are draft tokens
    to verify (they follow the sequence's last real token).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool  # sample a next token after the last of token_ids
    params: SamplingParams
    prompt_ids: list[int]  # for repetition penalties
    output_ids: list[int]  # for all penalties
    spec_token_ids: list[int] = field(default_factory=list)  # drafts at the end of token_ids
    num_lookahead: int = 0  # after sampling, propose up to this many draft tokens


@dataclass
class ModelInput:
    seqs: list[SeqInput]  # any order: the runner puts single-token sequences first
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ModelOutput:
    # request_id -> the tokens the step adds, for each seq with sample=True: the
    # accepted draft tokens (if it speculated), then one sampled by the target.
    sampled: dict[str, list[SampledToken]]
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # to verify next step
