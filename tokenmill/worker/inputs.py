"""Sequences of a step -> the flat tensors one forward pass takes.

Shared by the model runner (the target's forward) and the draft proposers (the
draft's forwards over the same block tables).
"""

from __future__ import annotations

import torch

from tokenmill.engine.model_input import SeqInput
from tokenmill.model.layers.attention import AttentionMetadata, build_decode_groups


def order_seqs(seqs: list[SeqInput]) -> list[SeqInput]:
    """Single-token sequences first, by context length (attention groups them), then the rest."""
    decodes = sorted((s for s in seqs if len(s.token_ids) == 1), key=lambda s: s.num_computed_tokens)
    return decodes + [s for s in seqs if len(s.token_ids) != 1]


def prepare_inputs(
    seqs: list[SeqInput], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Flat input ids, positions, attention metadata and the rows to take logits from:
    the last token of each sampling sequence, and every drafted position before it
    (a sequence verifying k draft tokens needs k + 1 rows of logits)."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        assert n >= 1, f"{s.request_id}: a scheduled sequence needs at least one token"
        assert n > len(s.spec_token_ids), f"{s.request_id}: draft tokens need the token they follow"
        start = s.num_computed_tokens
        assert len(s.block_table) * bs >= start + n, "block table too short for the scheduled tokens"
        input_ids.extend(s.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if s.sample:
            end = query_start_loc[-1]
            logits_indices.extend(range(end - 1 - len(s.spec_token_ids), end))
    num_decodes = len(_leading_decodes(seqs))
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        query_start_loc=query_start_loc,
        seq_lens_host=seq_lens,
        num_decodes=num_decodes,
        block_size=bs,
        decode_groups=build_decode_groups(
            seq_lens[:num_decodes], [s.block_table for s in seqs[:num_decodes]], bs, device
        ),
    )
    return (
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        meta,
        torch.tensor(logits_indices, dtype=torch.long, device=device),
    )


def _leading_decodes(seqs: list[SeqInput]) -> list[SeqInput]:
    """The leading run of single-token sequences (order_seqs puts them first)."""
    out = []
    for s in seqs:
        if len(s.token_ids) != 1:
            break
        out.append(s)
    return out
