"""Prompt lookup (n-gram) proposals: no model, just the sequence's own tokens.

Text that copies, edits or extracts from its prompt repeats long runs of it. Take the
last n tokens (n from ``max_n`` down to ``min_n``), find their most recent earlier
occurrence in the prompt and output so far, and propose the tokens that followed it.
The search is a C-speed ``bytes.rfind`` over the token ids packed 4 bytes each.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from tokenmill.worker.inputs import SeqInput
from tokenmill.worker.proposer import Draft, GeneratorFor, wants_draft

if TYPE_CHECKING:
    import torch


def lookup(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of history's last n tokens."""
    packed = array("i", history).tobytes()
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        pattern = packed[-4 * n :]
        end = len(packed) - 4  # a match must end before the last token (not be the suffix itself)
        while True:
            i = packed.rfind(pattern, 0, end)
            if i < 0:
                break
            if i % 4 == 0:  # aligned on a token boundary
                start = i // 4 + n
                return history[start : start + k]
            end = i + len(pattern) - 1
    return []


class NgramProposer:
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(
        self,
        seqs: list[SeqInput],
        new_tokens: dict[str, list[int]],
        generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:
        drafts = {}
        for s in seqs:
            if wants_draft(s, new_tokens):
                history = s.prompt_ids + s.output_ids + new_tokens[s.request_id]
                tokens = lookup(history, s.num_lookahead, self.max_n, self.min_n)
                if tokens:
                    drafts[s.request_id] = Draft(tokens)
        return drafts

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass  # no KV cache of its own
