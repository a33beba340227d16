"""Proposals from speculative heads over the target's hidden states (``heads.py``).

The runner hands the proposer the final hidden state of every row the target just
computed, so a head never costs a second target forward.

**EAGLE** keeps a one-layer paged K/V cache addressed by the target's block tables
(as a draft model does, ``draft.py``). Head position p pairs the target's feature
f_p with the next token t_(p+1), so the head catches up on every position the target
computed and kept whose next token is known (prompt chunks, the verified token,
accepted drafts), then drafts from the last one. A request that is not drafting keeps
those features and the head catches up on them in one forward (its weights read once
for all the rows) when it next drafts or completes a block: a full block, which the
prefix cache may hand to another request or back to this one after preemption, always
holds the head's K/V:

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

from dataclasses import dataclass

import torch

from tokenmill.engine.core.request import token_slice
from tokenmill.model.layers.kv_cache import copy_blocks
from tokenmill.model.llama import KVCache, LlamaForCausalLM
from tokenmill.speculative.draft import continuation, stack_probs
from tokenmill.speculative.heads import EagleHead, MedusaHeads
from tokenmill.worker.inputs import SeqInput, order_seqs, prepare_inputs
from tokenmill.worker.proposer import Draft, GeneratorFor, wants_draft
from tokenmill.worker.rejection import race
from tokenmill.worker.sampler import SampleRow, sampling_distribution
from tokenmill.worker.tree import best_first


def _kept_rows(s: SeqInput, gained: list[int]) -> int:
    """Rows of this step's forward whose positions the target keeps and whose next token
    is known: the real tokens and accepted drafts (the last of them only once the next
    token was sampled), none past the last known token."""
    known = len(s.prompt_ids) + len(s.output_ids) + len(gained)
    real = len(s.token_ids) - len(s.spec_token_ids)
    kept = real + max(len(gained) - 1, 0)
    return max(0, min(kept, known - 1 - s.num_computed_tokens))


def _draw_draft_tokens(
    rows: list[SampleRow], logits: torch.Tensor, sampling: list[SeqInput], confidence: bool
) -> list[tuple[int, torch.Tensor | None, float]]:
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
    return [
        SampleRow(
            s.params,
            s.prompt_ids,
            s.output_ids + after.get(s.request_id, []),
            generator_for(s.request_id, s.params.seed),
            s.penalties,
            s.param_row,
        )
        for s in seqs
    ]


def _tree_ok(s: SeqInput) -> bool:
    """Trees are verified greedily, and a grammar checks drafts as a chain: greedy,
    unconstrained requests only (the others draft chains)."""
    return s.params.greedy and s.params.structured is None


def _top(logits: torch.Tensor, width: int) -> list[list[tuple[int, float]]]:
    """Per row, the ``width`` most probable tokens with their probabilities."""
    probs, ids = logits.softmax(dim=-1).topk(width, dim=-1)
    return [list(zip(i, p, strict=True)) for i, p in zip(ids.tolist(), probs.tolist(), strict=True)]


@dataclass
class _Node:
    """A node of an EAGLE draft tree."""

    token: int
    parent: int  # index in the tree's node list, -1: the root
    score: float  # the head's probability of the path down to it
    depth: int
    feed: torch.Tensor  # the head's feature this node is drafted with (its parent's output)
    slot: int = -1  # where among the tree's head slots its K/V were written (-1: not expanded)


class EagleProposer:
    catch_up = True  # its own K/V follows the target's (export/import of KV refuses it)

    def __init__(
        self,
        target: LlamaForCausalLM,
        head: EagleHead,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        min_confidence: float = 0.0,
        tree_width: int = 1,
    ) -> None:
        self.target, self.head, self.kv_cache = target, head, kv_cache
        self.block_size, self.device = block_size, device
        self.min_confidence = min_confidence  # draft while the product of the drafts' probabilities stays above
        self.tree_width = tree_width  # > 1: greedy requests draft a tree (EAGLE-2's dynamic tree)
        # Per request not drafting now: (first position, features) the head has yet to catch up on.
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its pending features are of no use."""
        self._pending.pop(request_id, None)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[SeqInput],
        new_tokens: dict[str, list[int]],
        generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:
        assert hidden is not None, "EAGLE drafts from the target's hidden states"
        batch: list[SeqInput] = []
        feats: dict[str, torch.Tensor] = {}
        offset = 0
        for s in seqs:
            gained = new_tokens.get(s.request_id, [])
            n = _kept_rows(s, gained)
            rid, start, drafting = s.request_id, s.num_computed_tokens, wants_draft(s, new_tokens)
            rows = hidden[offset : offset + n]
            offset += len(s.token_ids)
            if s.params.kv_eviction is not None:  # never drafts, shares no block: its head K/V unread
                continue
            pending = self._pending.pop(rid, None)
            if pending is not None and pending[0] + pending[1].shape[0] == start:  # contiguous: catch up on both
                start, rows = pending[0], torch.cat([pending[1], rows])
            bs = self.block_size
            if not drafting and (start + rows.shape[0]) // bs == start // bs:  # no block completed: may wait
                if rows.shape[0]:
                    self._pending[rid] = (start, rows.clone())  # caught up on when it drafts or fills a block
                continue
            n = rows.shape[0]
            if n:
                tokens = token_slice(s.prompt_ids, s.output_ids + gained, start + 1, start + 1 + n)
                assert len(s.block_table) * self.block_size > start + n - 1 + (
                    s.num_lookahead - 1 if drafting else 0
                ), "no lookahead slots for the head"
                batch.append(continuation(s, tokens, start, s.output_ids + gained, sample=drafting))
                feats[rid] = rows
        if not batch:
            return {}
        batch = order_seqs(batch)
        out = self._forward(batch, torch.cat([feats[s.request_id] for s in batch]))  # catch up, and the first draft
        sampling = [s for s in batch if s.sample]
        if not sampling:
            return {}
        last = out[self._last_rows(batch)]
        trees = [i for i, s in enumerate(sampling) if self.tree_width > 1 and _tree_ok(s)]
        chains = [i for i in range(len(sampling)) if i not in set(trees)]
        result = {}
        if trees:
            result |= self._trees([sampling[i] for i in trees], last[trees])
        if chains:
            result |= self._chains([sampling[i] for i in chains], last[chains], generator_for)
        return result

    def _chains(self, seqs: list[SeqInput], last: torch.Tensor, generator_for: GeneratorFor) -> dict[str, Draft]:
        """Chains of up to ``num_lookahead`` drafts, one head forward per draft token."""
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor | None]] = {}
        sure = {s.request_id: 1.0 for s in seqs}  # the head's probability that all its drafts so far are right
        while seqs:
            rows = _sample_rows(seqs, generator_for, {})
            drawn = _draw_draft_tokens(rows, self.head.logits(self.target, last), seqs, self.min_confidence > 0)
            nxt, nxt_feats = [], {}
            for i, (token, q, p) in enumerate(drawn):
                s = seqs[i]
                sure[s.request_id] *= p
                if sure[s.request_id] < self.min_confidence:
                    continue  # not worth a verification slot: this sequence's draft ends here
                drafts.setdefault(s.request_id, []).append(token)
                probs.setdefault(s.request_id, []).append(q)
                if len(drafts[s.request_id]) < s.num_lookahead:
                    nxt.append(
                        continuation(s, [token], s.num_computed_tokens + len(s.token_ids), s.output_ids + [token])
                    )
                    nxt_feats[s.request_id] = last[i : i + 1]
            if not nxt:
                break
            seqs = order_seqs(nxt)
            last = self._forward(seqs, torch.cat([nxt_feats[s.request_id] for s in seqs]))  # one row each
        return {rid: Draft(tokens, stack_probs(probs[rid])) for rid, tokens in drafts.items()}

    def _trees(self, seqs: list[SeqInput], last: torch.Tensor) -> dict[str, Draft]:
        """EAGLE-2's dynamic tree: at each depth the ``tree_width`` most probable nodes (by
        the product of the head's probabilities along their path) are expanded, each into
        its ``tree_width`` most probable children, all of a depth in one head forward with a
        tree mask; the tree verified is the ``num_lookahead`` most probable nodes found."""
        w, floor = self.tree_width, self.min_confidence
        by_id = {s.request_id: s for s in seqs}
        nodes: dict[str, list[_Node]] = {}
        frontier: dict[str, list[int]] = {}
        for i, (s, top) in enumerate(zip(seqs, _top(self.head.logits(self.target, last), w), strict=True)):
            nodes[s.request_id] = [_Node(t, -1, p, 1, feed=last[i]) for t, p in top]
            frontier[s.request_id] = [j for j, n in enumerate(nodes[s.request_id]) if n.score >= floor]
        used = {s.request_id: 0 for s in seqs}  # head slots the tree has written past the root
        depth = 1
        while grow := [rid for rid, f in frontier.items() if f and used[rid] + len(f) <= by_id[rid].num_lookahead - 1]:
            batch, feats = [], []
            for rid in grow:
                s, tree, front = by_id[rid], nodes[rid], frontier[rid]
                base = s.num_computed_tokens + len(s.token_ids)  # the head position after its catch-up
                for row, j in enumerate(front):
                    tree[j].slot = used[rid] + row
                mask = torch.zeros(len(front), used[rid] + len(front), dtype=torch.bool)
                for row, j in enumerate(front):
                    while j >= 0:  # the node and its ancestors, each where the head wrote it
                        mask[row, tree[j].slot] = True
                        j = tree[j].parent
                feats += [tree[j].feed[None] for j in front]
                seq = continuation(s, [tree[j].token for j in front], base + used[rid], s.output_ids)
                seq.positions, seq.tree_mask = [base + depth - 1] * len(front), mask
                batch.append(seq)
                used[rid] += len(front)
            out = self._forward(batch, torch.cat(feats))  # no reordering: every sequence here has a tree mask
            tops = _top(self.head.logits(self.target, out), w)
            row = 0
            for rid in grow:
                tree, children = nodes[rid], []
                for j in frontier[rid]:
                    for t, p in tops[row]:
                        tree.append(_Node(t, j, tree[j].score * p, depth + 1, feed=out[row]))
                        children.append(len(tree) - 1)
                    row += 1
                frontier[rid] = [
                    c for c in sorted(children, key=lambda c: -tree[c].score)[:w] if tree[c].score >= floor
                ]
            depth += 1
        result = {}
        for rid, tree in nodes.items():
            # a child's score is at most its parent's (ties: the shallower first), so the best are a tree
            keep = sorted(
                (j for j, n in enumerate(tree) if n.score >= floor), key=lambda j: (-tree[j].score, tree[j].depth)
            )
            keep = sorted(keep[: by_id[rid].num_lookahead], key=lambda j: (tree[j].depth, j))  # parents first
            index = {j: i for i, j in enumerate(keep)}
            if keep:
                result[rid] = Draft([tree[j].token for j in keep], None, [index.get(tree[j].parent, -1) for j in keep])
        return result

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
        copy_blocks([self.kv_cache], copies)


class MedusaProposer:
    catch_up = False

    def __init__(
        self, target: LlamaForCausalLM, heads: MedusaHeads, min_confidence: float = 0.0, tree_width: int = 1
    ) -> None:
        self.target, self.heads, self.min_confidence = target, heads, min_confidence
        self.tree_width = tree_width  # > 1: greedy requests draft a tree from each head's top candidates

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[SeqInput],
        new_tokens: dict[str, list[int]],
        generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:
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
        result: dict[str, Draft] = {}
        if self.tree_width > 1:
            grow = [i for i, s in enumerate(picked) if _tree_ok(s)]
            if grow:
                tops = [_top(logits[h, grow], self.tree_width) for h in range(self.heads.num_heads)]
                for j, i in enumerate(grow):
                    s = picked[i]

                    def expand(path: list[int], depth: int, j: int = j) -> list[tuple[int, float]]:
                        return tops[depth][j] if depth < self.heads.num_heads else []

                    tokens, parents, _ = best_first(tops[0][j], expand, s.num_lookahead, self.min_confidence)
                    if tokens:
                        result[s.request_id] = Draft(tokens, None, parents)
                picked = [s for i, s in enumerate(picked) if i not in set(grow)]
                logits = logits[:, [i for i in range(logits.shape[1]) if i not in set(grow)]]
            if not picked:
                return result
        k = min(max(s.num_lookahead for s in picked), self.heads.num_heads)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in picked}
        probs: dict[str, list[torch.Tensor | None]] = {s.request_id: [] for s in picked}
        sure = {s.request_id: 1.0 for s in picked}
        for depth in range(k):
            active = [i for i, s in enumerate(picked) if s.num_lookahead > depth and len(drafts[s.request_id]) == depth]
            if not active:
                break
            seqs_now = [picked[i] for i in active]
            sample_rows = _sample_rows(
                seqs_now,
                generator_for,
                {s.request_id: new_tokens[s.request_id] + drafts[s.request_id] for s in seqs_now},
            )
            drawn = _draw_draft_tokens(sample_rows, logits[depth, active], seqs_now, self.min_confidence > 0)
            for (token, q, p), s in zip(drawn, seqs_now, strict=True):
                sure[s.request_id] *= p
                if sure[s.request_id] >= self.min_confidence:
                    drafts[s.request_id].append(token)
                    probs[s.request_id].append(q)
        return result | {rid: Draft(tokens, stack_probs(probs[rid])) for rid, tokens in drafts.items() if tokens}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass  # no K/V of its own
