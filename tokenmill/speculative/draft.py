"""Model-based proposals: a small draft model, or the target's own first layers.

**Draft model** (``catch_up=True``): a separate model with its own paged KV cache,
addressed by the *same* block tables as the target's (a parallel set of tensors), so
it needs no block manager of its own and follows preemption, prefix caching and
copy-on-write for free. Its cache is kept in step with the target's: after every
target step it computes exactly the tokens the target computed and kept (prompt
chunks, the verified token, accepted drafts), so every block the prefix cache
shares holds valid draft K/V too. Slots it wrote for rejected drafts lie past the
sequence's computed tokens and are overwritten before they are read again.

**Self-speculation** (``catch_up=False``): the target's first L layers, its final
norm and LM head. Layers below L see the same tokens with the same weights, so the
target's own cache already holds their K/V: the draft shares the first L caches
and never catches up.

Drafting writes K/V for up to k positions past the verified token; the scheduler
reserves those lookahead slots. Draft tokens are sampled with the request's own
parameters and generator, and their probabilities q kept for verification.

    verified:  ... last d1 .. dj | new | x1 x2 .. x(k-1)      (x: this step's drafts)
    draft fwd 1:   [catch-up .....   new] -> x1
    draft fwd i:                      [x(i-1)] -> xi
"""

from __future__ import annotations

import torch

from tokenmill.model.layers.kv_cache import copy_blocks
from tokenmill.model.llama import KVCache, LlamaForCausalLM
from tokenmill.worker.inputs import SeqInput, order_seqs, prepare_inputs
from tokenmill.worker.proposer import Draft, GeneratorFor, wants_draft
from tokenmill.worker.rejection import race
from tokenmill.worker.sampler import SampleRow, sampling_distribution


class ModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        num_layers: int | None = None,
        catch_up: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches if num_layers is None else kv_caches[:num_layers]
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.catch_up = catch_up

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[SeqInput],
        new_tokens: dict[str, list[int]],
        generator_for: GeneratorFor,
        hidden: torch.Tensor | None = None,
    ) -> dict[str, Draft]:
        first = [f for f in (self._first_input(s, new_tokens) for s in seqs) if f is not None]
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor | None]] = {}
        wanted = {s.request_id: s.num_lookahead for s in seqs if wants_draft(s, new_tokens)}
        batch = first
        while batch:
            batch = order_seqs(batch)
            sampling = [s for s in batch if s.sample]
            if not sampling:  # catch-up only: nobody drafts this step
                self._forward(batch)
                break
            logits = self._forward(batch)
            rows = [
                SampleRow(
                    s.params,
                    s.prompt_ids,
                    s.output_ids,
                    generator_for(s.request_id, s.params.seed),
                    s.penalties,
                    s.param_row,
                )
                for s in sampling
            ]
            dist, greedy = sampling_distribution(logits, rows)
            nxt = []
            for i, s in enumerate(sampling):
                rid = s.request_id
                if s.params.greedy:
                    token, q = int(greedy[i]), None
                else:
                    assert dist is not None
                    token, q = race(dist[i], rows[i].generator), dist[i]
                drafts.setdefault(rid, []).append(token)
                probs.setdefault(rid, []).append(q)
                if len(drafts[rid]) < wanted[rid]:
                    start = s.num_computed_tokens + len(s.token_ids)
                    nxt.append(continuation(s, [token], start, s.output_ids + [token]))
            batch = nxt
        return {rid: Draft(tokens, stack_probs(probs[rid])) for rid, tokens in drafts.items()}

    def _first_input(self, s: SeqInput, new_tokens: dict[str, list[int]]) -> SeqInput | None:
        """The draft's first forward for one sequence: the tokens the target kept this
        step (catch-up) and the newly sampled token when this sequence drafts. A request
        evicting K/V (``KVEviction``) never drafts and shares no block through the prefix
        cache, so nothing would ever read the draft's K/V of it: it gets none."""
        if s.params.kv_eviction is not None:
            return None
        gained = new_tokens.get(s.request_id, [])
        drafting = wants_draft(s, new_tokens)
        kept = len(s.token_ids) - len(s.spec_token_ids)  # real tokens; accepted drafts are gained[:-1]
        if self.catch_up:
            tokens = s.token_ids[:kept] + gained[:-1] + (gained[-1:] if drafting else [])
            start = s.num_computed_tokens
        elif drafting:
            tokens = gained[-1:]
            start = s.num_computed_tokens + kept + len(gained) - 1
        else:
            return None
        if not tokens:
            return None
        max_pos = start + len(tokens) - 1 + (s.num_lookahead - 1 if drafting else 0)
        assert len(s.block_table) * self.block_size > max_pos, "no lookahead slots for the draft"
        return continuation(s, tokens, start, s.output_ids + gained, sample=drafting)

    def _forward(self, batch: list[SeqInput]) -> torch.Tensor:
        input_ids, positions, meta, logits_indices = prepare_inputs(batch, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, num_layers=self.num_layers)
        return self.model.compute_logits(hidden[logits_indices])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not self.catch_up:
            return  # shares the target's caches, which the runner copies
        copy_blocks(self.kv_caches, copies)


def continuation(s: SeqInput, tokens: list[int], start: int, output_ids: list[int], sample: bool = True) -> SeqInput:
    return SeqInput(
        request_id=s.request_id,
        token_ids=tokens,
        num_computed_tokens=start,
        block_table=s.block_table,
        sample=sample,
        params=s.params,
        prompt_ids=s.prompt_ids,
        output_ids=output_ids,
        penalties=s.penalties,
        param_row=s.param_row,
        num_lookahead=s.num_lookahead,
    )


def stack_probs(qs: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(q is None for q in qs) else torch.stack(qs)  # type: ignore[arg-type]
