"""Proposals from speculative heads over the target's hidden states (``heads.py``).

The runner hands the proposer the final hidden state of every row the target just
computed, so a head never costs a second target forward.

**EAGLE** keeps a one-layer paged K/V cache addressed by the target's block tables
(as a draft model does, ``draft.py``). Head position p pairs the target's feature
f_p with the next token t_(p+1), so after each target step the head catches up on
every position the target computed and kept whose next token is known (prompt
chunks, the verified token, accepted drafts), then drafts from the last one:

    target kept:  ... p-1  p | bonus t_(p+1)         (f_p from this step's forward)
    head fwd 1:   [catch-up .. (f_p, t_(p+1))] -> f'_(p+1) -> d1
    head fwd i:   (f'_(p+i-1), d(i-1)) at position p+i-1 -> f'_(p+i) -> di

Slots written for drafts lie past the sequence's computed tokens and are rewritten
with the target's true features before they are read again. A block shared through
the prefix cache holds head K/V computed with its first owner's next token at the
block's last slot; that only changes what is drafted, never what is accepted.

**Medusa** needs no cache: head i reads f_p (the row that produced the bonus token)
and proposes the token i + 2 ahead; the k drafts come from one small forward.

Drafts are sampled with the request's own parameters and generator and their
distributions q kept, so verification stays lossless (``worker/rejection.py``).
"""

from __future__ import annotations

import torch

from tokenmill.engine.request import token_slice
from tokenmill.model.llama import KVCache, LlamaForCausalLM
from tokenmill.speculative.draft import _seq, _stack
from tokenmill.speculative.heads import EagleHead, MedusaHeads
from tokenmill.worker.inputs import SeqInput, order_seqs, prepare_inputs
from tokenmill.worker.proposer import Draft, GeneratorFor, wants_draft
from tokenmill.worker.rejection import race
from tokenmill.worker.sampler import SampleRow, sampling_distribution


def _kept_rows(s: SeqInput, gained: list[int]) -> int:
    """Rows of this step's forward whose positions the target keeps and whose next token
    is known: the real tokens and accepted drafts (the last of them only once the next
    token was sampled), none past the last known token."""
    known = len(s.prompt_ids) + len(s.output_ids) + len(gained)
    real = len(s.token_ids) - len(s.spec_token_ids)
    kept = real + max(len(gained) - 1, 0)
    return max(0, min(kept, known - 1 - s.num_computed_tokens))


def _draw(rows: list[SampleRow], logits: torch.Tensor, sampling: list[SeqInput],
          confidence: bool) -> list[tuple[int, torch.Tensor | None, float]]:  # fmt: skip
    """One draft token per row: the argmax for greedy requests, else drawn from the
    request's own sampling distribution (kept as q); with ``confidence``, the head's
    probability of the token (of the argmax under a plain softmax for greedy rows)."""
    dist, greedy = sampling_distribution(logits, rows)
    top = logits.softmax(dim=-1).amax(dim=-1).tolist() if confidence else None
    out: list[tuple[int, torch.Tensor | None, float]] = []
    for i, s in enumerate(sampling):
        if s.params.greedy:
            out.append((int(greedy[i]), None, top[i] if top is not None else 1.0))
        else:
            assert dist is not None
            token = race(dist[i], rows[i].generator)
            out.append((token, dist[i], float(dist[i][token]) if confidence else 1.0))
    return out


def _sample_rows(seqs: list[SeqInput], generator_for: GeneratorFor, after: dict[str, list[int]]) -> list[SampleRow]:
    """Sampling rows for drafts; ``after``: tokens past ``output_ids`` that penalties count."""
    return [SampleRow(s.params, s.prompt_ids, s.output_ids + after.get(s.request_id, []),
                      generator_for(s.request_id, s.params.seed), s.penalties, s.param_row) for s in seqs]  # fmt: skip


class EagleProposer:
    catch_up = True  # its own K/V follows the target's (export/import of KV refuses it)

    def __init__(self, target: LlamaForCausalLM, head: EagleHead, kv_cache: KVCache, block_size: int,
                 device: torch.device, min_confidence: float = 0.0) -> None:  # fmt: skip
        self.target, self.head, self.kv_cache = target, head, kv_cache
        self.block_size, self.device = block_size, device
        self.min_confidence = min_confidence  # draft while the product of the drafts' probabilities stays above

    @torch.inference_mode()
    def propose(
        self, seqs: list[SeqInput], new_tokens: dict[str, list[int]], generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:  # fmt: skip
        assert hidden is not None, "EAGLE drafts from the target's hidden states"
        batch: list[SeqInput] = []
        feats: dict[str, torch.Tensor] = {}
        offset = 0
        for s in seqs:
            gained = new_tokens.get(s.request_id, [])
            n = _kept_rows(s, gained)
            if n:
                start = s.num_computed_tokens
                tokens = token_slice(s.prompt_ids, s.output_ids + gained, start + 1, start + 1 + n)
                drafting = wants_draft(s, new_tokens)
                assert len(s.block_table) * self.block_size > start + n - 1 + (s.num_lookahead - 1 if drafting else 0), \
                    "no lookahead slots for the head"  # fmt: skip
                batch.append(_seq(s, tokens, start, s.output_ids + gained, sample=drafting))
                feats[s.request_id] = hidden[offset : offset + n]
            offset += len(s.token_ids)
        wanted = {s.request_id: s.num_lookahead for s in seqs if wants_draft(s, new_tokens)}
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor | None]] = {}
        sure = {rid: 1.0 for rid in wanted}  # the head's probability that all its drafts so far are right
        while batch:
            batch = order_seqs(batch)
            out = self._forward(batch, torch.cat([feats[s.request_id] for s in batch]))
            sampling = [s for s in batch if s.sample]
            if not sampling:
                break
            rows = _sample_rows(sampling, generator_for, {})
            last = out[self._last_rows(batch)]
            nxt, next_feats = [], {}
            drawn = _draw(rows, self.head.logits(self.target, last), sampling, self.min_confidence > 0)
            for i, (token, q, p) in enumerate(drawn):
                s = sampling[i]
                sure[s.request_id] *= p
                if sure[s.request_id] < self.min_confidence:
                    continue  # not worth a verification slot: this sequence's draft ends here
                drafts.setdefault(s.request_id, []).append(token)
                probs.setdefault(s.request_id, []).append(q)
                if len(drafts[s.request_id]) < wanted[s.request_id]:
                    nxt.append(_seq(s, [token], s.num_computed_tokens + len(s.token_ids), s.output_ids + [token]))
                    next_feats[s.request_id] = last[i : i + 1]
            batch, feats = nxt, next_feats
        return {rid: Draft(tokens, _stack(probs[rid])) for rid, tokens in drafts.items()}

    @staticmethod
    def _last_rows(batch: list[SeqInput]) -> list[int]:
        rows, at = [], 0
        for s in batch:
            at += len(s.token_ids)
            if s.sample:
                rows.append(at - 1)
        return rows

    def _forward(self, batch: list[SeqInput], features: torch.Tensor) -> torch.Tensor:
        input_ids, positions, meta, _ = prepare_inputs(batch, self.block_size, self.device)
        return self.head(self.target, features, input_ids, positions, self.kv_cache, meta)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        from tokenmill.model.layers.kv_cache import copy_blocks

        copy_blocks([self.kv_cache], copies)


class MedusaProposer:
    catch_up = False

    def __init__(self, target: LlamaForCausalLM, heads: MedusaHeads, min_confidence: float = 0.0) -> None:
        self.target, self.heads, self.min_confidence = target, heads, min_confidence

    @torch.inference_mode()
    def propose(
        self, seqs: list[SeqInput], new_tokens: dict[str, list[int]], generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:  # fmt: skip
        assert hidden is not None, "Medusa drafts from the target's hidden states"
        picked, rows, offset = [], [], 0
        for s in seqs:
            gained = new_tokens.get(s.request_id, [])
            if wants_draft(s, new_tokens):
                # the row that produced the bonus token: after the real tokens and accepted drafts
                real = len(s.token_ids) - len(s.spec_token_ids)
                rows.append(offset + real - 1 + len(gained) - 1)
                picked.append(s)
            offset += len(s.token_ids)
        if not picked:
            return {}
        logits = self.heads(hidden[torch.tensor(rows, device=hidden.device)])  # [K, n, vocab]
        k = min(max(s.num_lookahead for s in picked), self.heads.num_heads)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in picked}
        probs: dict[str, list[torch.Tensor | None]] = {s.request_id: [] for s in picked}
        sure = {s.request_id: 1.0 for s in picked}
        for depth in range(k):
            active = [i for i, s in enumerate(picked) if s.num_lookahead > depth and len(drafts[s.request_id]) == depth]
            if not active:
                break
            seqs_now = [picked[i] for i in active]
            sample_rows = _sample_rows(seqs_now, generator_for,
                                       {s.request_id: new_tokens[s.request_id] + drafts[s.request_id] for s in seqs_now})
            drawn = _draw(sample_rows, logits[depth, active], seqs_now, self.min_confidence > 0)
            for (token, q, p), s in zip(drawn, seqs_now, strict=True):
                sure[s.request_id] *= p
                if sure[s.request_id] >= self.min_confidence:
                    drafts[s.request_id].append(token)
                    probs[s.request_id].append(q)
        return {rid: Draft(tokens, _stack(probs[rid])) for rid, tokens in drafts.items() if tokens}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass  # no K/V of its own
