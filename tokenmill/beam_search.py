"""Beam search over the engine, as vLLM v1 runs it: one token per live beam per round,
every beam a one-token request with its top 2W logprobs, the W best continuations
kept by cumulative logprob.

Beams share KV blocks through the prefix cache: a beam's request is its prompt plus
its tokens, so its full blocks (the prompt's and every prefix the beams have in
common) are found cached and only the tail past the last full block is computed.
The rounds of all prompts' beams run as one batch. Finished beams (end-of-sequence,
unless ``ignore_eos``) and, at ``max_tokens``, the live ones are ranked by
``cumulative logprob / length ** length_penalty`` (the length counts the prompt, and
not a final end-of-sequence token, as vLLM's).

``BeamSearch`` is the algorithm without an engine: ``requests()`` says what the next
round computes, ``advance()`` takes the round's top logprobs. ``LLM.beam_search``
drives it offline; the server drives it over its async engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise InvalidRequestError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}]", param="beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1", param="max_tokens")
        if not isinstance(self.length_penalty, int | float) or not -10 <= self.length_penalty <= 10:
            raise InvalidRequestError("length_penalty must be a number in [-10, 10]", param="length_penalty")

    def step_params(self, logprobs: int = 0) -> SamplingParams:
        """One round of one beam: a single token's top-2W alternatives (more where the
        client asked for more top logprobs; only the first 2W are continued)."""
        return SamplingParams(max_tokens=1, temperature=0, logprobs=max(2 * self.beam_width, logprobs), ignore_eos=True)


@dataclass
class Beam:
    tokens: list[int]  # the output so far
    cum_logprob: float = 0.0
    finished: bool = False  # ended by end-of-sequence
    logprobs: list[float] = field(default_factory=list)  # of each output token
    tops: list[list[tuple[int, float]]] = field(default_factory=list)  # each output token's step: its top (id, logprob)

    def score(self, prompt_len: int, eos: frozenset[int], length_penalty: float) -> float:
        length = prompt_len + len(self.tokens) - (1 if self.tokens and self.tokens[-1] in eos and self.finished else 0)
        return self.cum_logprob / (max(length, 1) ** length_penalty)


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    beams: list[Beam]  # best first, beam_width of them (fewer only if the vocabulary is smaller)


class BeamSearch:
    """Beam search for several prompts at once (see the module docstring)."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        self.prompts, self.params, self.eos = prompts, params, eos_token_ids
        self.live: list[list[Beam]] = [[Beam([])] for _ in prompts]
        self.done: list[list[Beam]] = [[] for _ in prompts]
        self.rounds = 0

    @property
    def finished(self) -> bool:
        return self.rounds >= self.params.max_tokens or not any(self.live)

    def requests(self) -> list[tuple[int, int, list[int]]]:
        """This round's (prompt index, beam index, token ids): every live beam, one token."""
        return [
            (p, b, self.prompts[p] + beam.tokens) for p, beams in enumerate(self.live) for b, beam in enumerate(beams)
        ]

    def advance(self, tops: dict[tuple[int, int], list[tuple[int, float]]]) -> None:
        """The round's results: (prompt, beam) -> its next token's top-2W (id, logprob)."""
        width = self.params.beam_width
        for p, beams in enumerate(self.live):
            candidates = [
                Beam(beam.tokens + [t], beam.cum_logprob + lp, logprobs=beam.logprobs + [lp], tops=beam.tops + [top])
                for b, beam in enumerate(beams)
                for top in [tops[(p, b)]]
                for t, lp in top[: 2 * width]
            ]
            candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
            self.live[p] = []
            for c in candidates[:width]:
                if not self.params.ignore_eos and c.tokens[-1] in self.eos:
                    c.finished = True
                    self.done[p].append(c)
                else:
                    self.live[p].append(c)
        self.rounds += 1

    def results(self) -> list[BeamSearchOutput]:
        out = []
        for p, prompt in enumerate(self.prompts):
            beams = self.done[p] + self.live[p]
            beams.sort(key=lambda b: b.score(len(prompt), self.eos, self.params.length_penalty), reverse=True)
            out.append(BeamSearchOutput(prompt, beams[: self.params.beam_width]))
        return out
