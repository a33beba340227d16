"""The one interface every proposer implements.

After each target step the model runner hands the proposer the step's sequences and
the tokens each one gained; the proposer returns, for each sequence that asked for
``num_lookahead`` tokens, up to that many draft tokens, with the probabilities they
were drawn from when it has them (a model does; prompt lookup does not). A head
(EAGLE, Medusa) also gets the target's final hidden state of every row of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.worker.inputs import SeqInput

GeneratorFor = Callable[[str, "int | None"], "torch.Generator | None"]


@dataclass
class Draft:
    """Draft tokens and the distribution each was drawn from, kept together until verified."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab]: q of each token; None: certain
    parents: list[int] | None = None  # a tree (worker/tree.py): each token's parent, -1 the root; None: a chain

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"a draft of {len(self.token_ids)} tokens with {self.probs.shape[0]} rows of probabilities"
            )
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a draft tree's parents must come before their children")
            if self.probs is not None:
                raise ValueError("draft trees are verified greedily: they carry no probabilities")


class Proposer(Protocol):
    def propose(
        self,
        seqs: list[SeqInput],
        new_tokens: dict[str, list[int]],
        generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,  # the target's final hidden state of every row of the step
    ) -> dict[str, Draft]: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


def wants_draft(s: SeqInput, new_tokens: dict[str, list[int]]) -> bool:
    return s.sample and s.num_lookahead > 0 and bool(new_tokens.get(s.request_id))
