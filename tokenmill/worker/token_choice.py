"""A step's tokens from its logits: where a request's sampling parameters meet the model.

The runner computes the logits and hands them here with the step's sequences, each of
which carries what choosing its tokens needs (its ``SamplingParams``, penalty counts,
parameter row, generator and, when it speculates, its drafts and their probabilities).
From here the path only goes down: grammar masks become a bias on their rows
(``sampler.apply_grammar_bias``), plain sequences are sampled in one batch
(``sampler.sample``), speculating ones have their drafts verified (``rejection.py`` for
chains, ``tree.greedy_path`` for trees) with each row judged after the drafts before it,
and the chosen tokens get their logprobs (``sampler.chosen_logprobs``). The runner gets
back each sequence's tokens and never re-enters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenmill.engine.model_input import SampledToken
from tokenmill.worker.inputs import SeqInput
from tokenmill.worker.rejection import verify_greedy, verify_sampled
from tokenmill.worker.sampler import SampleRow, apply_grammar_bias, chosen_logprobs, sample, sampling_distribution
from tokenmill.worker.tree import greedy_path


def choose_tokens(
    seqs: list[SeqInput],
    logits: torch.Tensor,
    default_generator: torch.Generator,
    grammar_masks: dict[str, Any] | None = None,
) -> dict[str, list[SampledToken]]:
    """Each sampling sequence's tokens this step: one for a plain sequence, the accepted
    drafts and one more for a speculating one. ``logits`` has a row per sampled position,
    in ``seqs`` order (1 + its drafts per sequence that samples). Rows of constrained
    sequences get their grammar's bias (-inf for refused tokens) first; an unseeded
    sequence draws from ``default_generator``."""
    plain_rows, plain, spec_rows, spec = [], [], [], []
    masked_rows, masks = [], []
    row = 0
    for s in seqs:
        if not s.sample:
            continue
        n = 1 + len(s.spec_token_ids)
        if grammar_masks and s.request_id in grammar_masks:
            masked_rows.extend(range(row, row + n))
            masks.append(grammar_masks[s.request_id])
        (spec_rows if s.spec_token_ids else plain_rows).extend(range(row, row + n))
        (spec if s.spec_token_ids else plain).append(s)
        row += n
    assert row == logits.shape[0]
    if masks:
        apply_grammar_bias(logits, masked_rows, masks[0] if len(masks) == 1 else np.concatenate(masks))
    result: dict[str, list[SampledToken]] = {}
    if plain:
        rows = [SampleRow(s.params, s.prompt_ids, s.output_ids, s.generator, s.penalties, s.param_row) for s in plain]
        out = sample(_rows(logits, plain_rows), rows, default_generator)
        for i, s in enumerate(plain):
            result[s.request_id] = [SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])]
    if spec:
        result.update(_verify(spec, _rows(logits, spec_rows), default_generator))
    return result


def _verify(
    seqs: list[SeqInput], logits: torch.Tensor, default_generator: torch.Generator
) -> dict[str, list[SampledToken]]:
    """logits: k_i + 1 rows per sequence. Row i is judged with the penalties the
    sequence would have after accepting its first i drafts."""
    rows = [
        SampleRow(
            s.params,
            s.prompt_ids,
            s.output_ids + drafted,
            s.generator or default_generator,
            s.penalties,
            s.param_row,
        )
        for s in seqs
        for drafted in _judged_after(s)
    ]
    dist, greedy = sampling_distribution(logits, rows)
    greedy_list = greedy.tolist()
    raw = logits.log_softmax(dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    result = {}
    start = 0
    for s in seqs:
        k = len(s.spec_token_ids)
        if s.spec_parents is not None:  # a tree: greedy only (proposers draft chains for sampled requests)
            assert s.params.greedy, "a draft tree for a sampled request"
            argmax = greedy_list[start : start + k + 1]
            path = greedy_path(s.spec_parents, s.spec_token_ids, argmax)
            tokens = [s.spec_token_ids[i] for i in path] + [argmax[path[-1] + 1 if path else 0]]
            taken = [start] + [start + 1 + i for i in path]  # the rows that judged them
        else:
            if s.params.greedy:
                tokens = verify_greedy(greedy_list[start : start + k + 1], s.spec_token_ids)
            else:
                assert dist is not None
                q = None if s.draft_probs is None else s.draft_probs[:k]
                tokens = verify_sampled(dist[start : start + k + 1], s.spec_token_ids, q, rows[start].generator)
            taken = list(range(start, start + len(tokens)))
        if raw is not None and s.params.logprobs is not None:
            lps, tops = chosen_logprobs(raw[taken], tokens, [rows[i] for i in taken])
        else:
            lps, tops = [None] * len(tokens), [[] for _ in tokens]
        result[s.request_id] = [SampledToken(t, lp, top) for t, lp, top in zip(tokens, lps, tops, strict=True)]
        start += k + 1
    return result


def _judged_after(s: SeqInput) -> list[list[int]]:
    """The drafts each verification row of ``s`` is judged after (its penalties, min_tokens):
    row i of a chain after the first i drafts; a tree's node after the path down to it."""
    drafts = s.spec_token_ids
    if s.spec_parents is None:
        return [drafts[:i] for i in range(len(drafts) + 1)]
    paths: list[list[int]] = [[]]
    for i, p in enumerate(s.spec_parents):
        paths.append(paths[p + 1] + [drafts[i]])
    return paths


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without copying [batch, vocab] when rows are all of them in order
    (the usual step: at 64 rows of a 49k vocabulary the copy cost 4 ms)."""
    if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:
        return logits  # rows are increasing and distinct, so this is range(len(logits))
    return logits.index_select(0, torch.tensor(rows, device=logits.device))
