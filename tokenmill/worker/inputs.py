"""Sequences of a step -> the flat tensors one forward pass takes.

Shared by the model runner (the target's forward) and the draft proposers (the
draft's forwards over the same block tables). The flat index arrays are filled in
buffers that live as long as their ``InputBuffers`` (grown when a step needs more),
not allocated anew each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import PenaltyState


@dataclass
class SeqInput:
    """One sequence's share of a forward, built by the runner from its persistent state.

    ``token_ids`` are the tokens to compute now; they sit at positions
    ``num_computed_tokens .. num_computed_tokens + len(token_ids) - 1``, and their
    K/V go to the slots that ``block_table`` gives those positions. When the
    sequence speculates, the last ``len(spec_token_ids)`` of them are draft tokens
    to verify (they follow the sequence's last real token). ``prompt_ids`` and
    ``output_ids`` are the runner's own lists (read, never copied).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool  # sample a next token after the last of token_ids
    params: SamplingParams
    prompt_ids: list[int]  # for repetition penalties
    output_ids: list[int]  # for all penalties
    penalties: PenaltyState | None = None  # the request's penalty counts (penalised requests only)
    param_row: torch.Tensor | None = None  # the request's sampling parameters as a tensor row
    spec_token_ids: list[int] = field(default_factory=list)  # drafts at the end of token_ids
    generator: torch.Generator | None = None  # a seeded request's own (None: the runner's default)
    draft_probs: torch.Tensor | None = None  # the drafts' probabilities under the proposer (sampled drafts)
    pooling: PoolingParams | None = None  # an embedding request: its hidden states pooled, nothing sampled
    num_lookahead: int = 0  # after sampling, propose up to this many draft tokens
    # A token tree (``worker/tree.py``): the tokens' positions (a node sits at its parent's + 1,
    # while its K/V take the next slot in order) and what each sees of the last T slots.
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None  # [len(token_ids), T] bool
    spec_parents: list[int] | None = None  # the drafts' parents (-1: the real token before them)
    # Tokens whose K/V were evicted (``KVEviction``): ``num_computed_tokens`` counts the cache's
    # slots, and the first new token is token ``num_computed_tokens + num_evicted_tokens``.
    num_evicted_tokens: int = 0
    # Added to each new token's position (SnapKV: kept keys keep their positions, so a token's
    # position is its slot plus the tokens evicted before it; StreamingLLM: 0, positions are slots).
    position_offset: int = 0


class InputBuffers:
    """Reusable host arrays for a step's flat ids, positions and slots."""

    def __init__(self, capacity: int = 1024) -> None:
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity
        self.input_ids = np.zeros(capacity, dtype=np.int64)
        self.positions = np.zeros(capacity, dtype=np.int64)
        self.slots = np.zeros(capacity, dtype=np.int64)

    def ensure(self, num_tokens: int) -> None:
        if num_tokens > self.capacity:
            self._grow(max(num_tokens, 2 * self.capacity))


def order_seqs(seqs: list[SeqInput]) -> list[SeqInput]:
    """Single-token sequences first, by context length (attention groups them), then the rest."""
    decodes = sorted((s for s in seqs if _is_decode(s)), key=lambda s: s.num_computed_tokens)
    return decodes + [s for s in seqs if not _is_decode(s)]


def _is_decode(s: SeqInput) -> bool:
    """One token over a plain causal context (a tree node, alone or not, takes its mask)."""
    return len(s.token_ids) == 1 and s.tree_mask is None


def prepare_inputs(
    seqs: list[SeqInput], block_size: int, device: torch.device, buffers: InputBuffers | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Flat input ids, positions, attention metadata and the rows to take logits from:
    the last token of each sampling sequence, and every drafted position before it
    (a sequence verifying k draft tokens needs k + 1 rows of logits)."""
    bs = block_size
    num_tokens = sum(len(s.token_ids) for s in seqs)
    buf = buffers or InputBuffers(num_tokens)
    buf.ensure(num_tokens)
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        assert n >= 1, f"{s.request_id}: a scheduled sequence needs at least one token"
        assert n > len(s.spec_token_ids), f"{s.request_id}: draft tokens need the token they follow"
        start = s.num_computed_tokens
        assert len(s.block_table) * bs >= start + n, "block table too short for the scheduled tokens"
        at = query_start_loc[-1]
        if s.positions is not None:  # a tree: positions by depth, slots in order
            slot_pos = np.arange(start, start + n)
            buf.input_ids[at : at + n] = s.token_ids
            buf.positions[at : at + n] = s.positions
            table = np.asarray(s.block_table[start // bs : (start + n - 1) // bs + 1], dtype=np.int64)
            buf.slots[at : at + n] = table[slot_pos // bs - start // bs] * bs + slot_pos % bs
        elif n == 1:  # one token: no ranges to build
            buf.input_ids[at] = s.token_ids[0]
            buf.positions[at] = start + s.position_offset
            buf.slots[at] = s.block_table[start // bs] * bs + start % bs
        else:
            pos = np.arange(start, start + n)
            buf.input_ids[at : at + n] = s.token_ids
            buf.positions[at : at + n] = pos + s.position_offset
            table = np.asarray(s.block_table[start // bs : (start + n - 1) // bs + 1], dtype=np.int64)
            buf.slots[at : at + n] = table[pos // bs - start // bs] * bs + pos % bs
        query_start_loc.append(at + n)
        seq_lens.append(start + n)
        if s.sample:
            end = query_start_loc[-1]
            logits_indices.extend(range(end - 1 - len(s.spec_token_ids), end))
    num_decodes = len(_leading_decodes(seqs))
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
    trees = {i: s.tree_mask.to(device) for i, s in enumerate(seqs) if s.tree_mask is not None}
    meta = AttentionMetadata(
        tree_masks=trees,
        slot_mapping=_to_device(buf.slots[:num_tokens], device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        query_start_loc=query_start_loc,
        seq_lens_host=seq_lens,
        num_decodes=num_decodes,
        block_size=bs,
        block_tables_host=[s.block_table for s in seqs],
    )
    return (
        _to_device(buf.input_ids[:num_tokens], device),
        _to_device(buf.positions[:num_tokens], device),
        meta,
        torch.tensor(logits_indices, dtype=torch.long, device=device),
    )


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor of the buffer's contents (a copy: the buffer is refilled next step,
    possibly while the forward that reads this tensor still runs on a GPU)."""
    t = torch.from_numpy(host)
    return t.to(device, non_blocking=False) if device.type != "cpu" else t.clone()


def _leading_decodes(seqs: list[SeqInput]) -> list[SeqInput]:
    """The leading run of single-token sequences (order_seqs puts them first)."""
    out = []
    for s in seqs:
        if not _is_decode(s):
            break
        out.append(s)
    return out
