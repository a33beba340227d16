"""ModelInput (deltas) -> persistent batch -> tensors -> model -> sampler -> ModelOutput.

The only place where a schedule turns into tensors. The runner keeps each request's
state from its first schedule until the scheduler says it is gone
(``CachedRequestState``: its tokens, block table, sampling parameters, seeded
generator and pending draft with the probabilities it was drawn from), and applies
each step's deltas to it. A step's record therefore never carries a request's
whole history, and a seeded request samples the same tokens whatever else shares
its batch.

State changes are applied before the forward (idempotently: the engine may re-send
the same step one request at a time to find one that fails) and the step's results
(sampled tokens, new drafts) are committed only after the whole step succeeded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from tokenmill.engine.core.request import token_slice
from tokenmill.engine.model_input import (
    GrammarMasks,
    ModelInput,
    ModelOutput,
    PromptLogprob,
    SampledToken,
    ScheduledTokens,
)
from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.lora.layers import LoRAMapping
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import block_nbytes, copy_blocks, move_slots, read_blocks, write_blocks
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SNAPKV_OBSERVED, SNAPKV_POOL, SamplingParams
from tokenmill.worker.host_kv import HostKVBuffer
from tokenmill.worker.inputs import InputBuffers, SeqInput, order_seqs, prepare_inputs
from tokenmill.worker.kv_allocation import KVCache
from tokenmill.worker.lora import LoRAManager
from tokenmill.worker.proposer import Draft, Proposer
from tokenmill.worker.sampler import PenaltyState, param_row
from tokenmill.worker.speculation_pause import PayOrPause
from tokenmill.worker.token_choice import choose_tokens
from tokenmill.worker.tree import follow, verification_layout

# request id -> (tokens the driver sampled for it last step, its new draft or None): what a
# worker rank of a split model is told of the step before (distributed/rank_messages.py sends it)
Committed = dict[str, tuple[list[int], list[int] | None]]


class SplitStage(Protocol):
    """This rank's part of a split model's forward (distributed/stage.py's PipelineStage,
    which the runner is handed from above and never imports)."""

    def forward(self, seqs: list[SeqInput], all_rows: bool = False) -> torch.Tensor | None: ...


PROMPT_SCORE_ROWS = 256  # prompt positions turned into logits at a time (256 x a 49k vocabulary: 48 MiB)


def _scores_prompt(s: SeqInput) -> bool:
    """This chunk predicts prompt tokens of a prompt_logprobs request."""
    return s.params.prompt_logprobs is not None and s.num_computed_tokens + s.num_evicted_tokens + 1 < len(s.prompt_ids)


@dataclass
class CachedRequestState:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # appended by the runner as it samples
    params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None  # seeded requests only
    draft: Draft | None = None  # proposed last step, to verify next (token ids and their q together)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    penalties: PenaltyState | None = None  # its penalty counts, kept up to date (penalised requests only)
    param_row: torch.Tensor | None = None  # its sampling parameters as one tensor row (sampler.param_row)
    pooling: PoolingParams | None = None  # an embedding request
    pool_sum: torch.Tensor | None = None  # an embedding request: its pooled rows so far (float32)
    pool_count: int = 0
    num_evicted_tokens: int = 0  # evicted tokens its cache's keys are rotated for (``KVEviction``)
    # SnapKV, while its prompt is read: the queries of the prompt's last tokens, [layers, observed,
    # heads, head_dim] (written by position: a step sent again writes the same rows)
    observed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.params.uses_penalties:
            self.penalties = PenaltyState(self.params, self.prompt_ids, self.output_ids)

    def gained(self, token_ids: list[int]) -> None:
        """Output tokens committed to this request."""
        self.output_ids.extend(token_ids)
        if self.penalties is not None:
            self.penalties.add(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_ids, self.output_ids, start, end)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        proposer: Proposer | None = None,
        lora: LoRAManager | None = None,
        stage: SplitStage | None = None,
        pause: PayOrPause | None = None,
    ) -> None:
        self.model = model
        self.pause = pause  # drafting only while it measurably pays (worker/speculation_pause.py)
        self.stage = stage  # a split model: this rank's part of each forward (distributed/stage.py)
        self.lora = lora  # multi-LoRA: adapters in memory and in slots
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.proposer = proposer
        self.requests: dict[str, CachedRequestState] = {}
        self._evicting: set[str] = set()  # requests with KVEviction: the steps' eviction work only for them
        self._parked_generators: dict[str, torch.Generator] = {}  # of preempted seeded requests
        self._buffers = InputBuffers()
        self.host_kv: HostKVBuffer | None = None  # the prefix cache's host tier's bytes (--kv-host-cache)
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, batch: ModelInput, grammar: GrammarMasks | None = None) -> ModelOutput:
        """One step: apply the deltas, compute, sample (rows of constrained sequences
        biased by ``grammar``'s masks), propose drafts, commit."""
        started = time.perf_counter()
        self._update_states(batch)
        self.copy_blocks(batch.block_copies)
        self._shift_kept_keys(batch)
        if not batch.scheduled:
            return ModelOutput()
        # A failed step is re-sent one request at a time: each seeded request must then
        # draw the same random numbers again, so its generator is rewound on failure.
        rewind = [
            (g, g.get_state()) for s in batch.scheduled if (g := self.requests[s.request_id].generator) is not None
        ]
        try:
            seqs = order_seqs([self._seq_input(s) for s in batch.scheduled])
            logits, prompt_scores, pooled, hidden = self._forward(seqs)
            sampled = choose_tokens(
                seqs, logits, self._default_generator, grammar.get() if grammar is not None else None
            )
            if any(s.spec_parents is not None for s in seqs):
                hidden = self._keep_tree_paths(seqs, sampled, hidden)
            drafts: dict[str, Draft] = {}
            if self.proposer is not None:
                new_tokens = {rid: [t.token_id for t in toks] for rid, toks in sampled.items()}
                asked = (
                    seqs if self.pause is None or self.pause.drafting else [replace(s, num_lookahead=0) for s in seqs]
                )
                drafts = self.proposer.propose(asked, new_tokens, self._generator_or_default, hidden)
        except BaseException:
            for gen, state in rewind:
                gen.set_state(state)
            raise
        out = self._commit(batch, sampled, drafts)
        self._compress_prompts(seqs)
        if self.pause is not None and all(len(s.token_ids) == 1 + len(s.spec_token_ids) for s in seqs):
            if any(s.num_lookahead or s.spec_token_ids for s in seqs):  # a decode step speculation could serve
                self.pause.record(sum(len(t) for t in sampled.values()), time.perf_counter() - started)
        out.prompt_logprobs = prompt_scores
        out.embeddings = self._commit_pooled(pooled)
        return out

    def _snap(self, s: SeqInput) -> tuple[int, int] | None:
        """(window, prompt length) for a SnapKV request whose long prompt is still being read."""
        ev = s.params.kv_eviction
        prompt = len(s.prompt_ids)
        if ev is None or ev.streams or s.num_evicted_tokens or prompt <= ev.window:
            return None
        return ev.window, prompt

    def _observed_rows(self, seqs: list[SeqInput]) -> list[tuple[SeqInput, int, int, int]]:
        """(sequence, first row in the flat batch, first observed index, count): the rows of the
        step holding SnapKV's observed prompt tokens (the last ``SNAPKV_OBSERVED``)."""
        if not self._evicting:
            return []
        rows, offset = [], 0
        for s in seqs:
            snap = self._snap(s)
            if snap is not None:
                first = snap[1] - SNAPKV_OBSERVED  # the first observed token
                lo, hi = max(first, s.num_computed_tokens), min(snap[1], s.num_computed_tokens + len(s.token_ids))
                if lo < hi:
                    rows.append((s, offset + lo - s.num_computed_tokens, lo - first, hi - lo))
            offset += len(s.token_ids)
        return rows

    def _keep_observed(self, rows: list[tuple[SeqInput, int, int, int]], kept: list[torch.Tensor]) -> None:
        """The step's observed queries into their requests' states."""
        queries = torch.stack(kept)  # [layers, rows, heads, head_dim]
        at = 0
        for s, _, first, n in rows:
            state = self.requests[s.request_id]
            if state.observed is None:
                state.observed = queries.new_zeros(queries.shape[0], SNAPKV_OBSERVED, *queries.shape[2:])
            state.observed[:, first : first + n] = queries[:, at : at + n]
            at += n

    def _compress_prompts(self, seqs: list[SeqInput]) -> None:
        """SnapKV: each request whose long prompt this step read to its end keeps the K/V of
        its window: its last observed tokens and the tokens their attention weighed most
        (max-pooled), moved in order to its first slots (positions kept); the engine gives the
        slots after them back (``KVCacheManager.evict``)."""
        if not self._evicting:
            return
        bs = self.block_size
        for s in seqs:
            snap = self._snap(s)
            if snap is None or s.num_computed_tokens + len(s.token_ids) != snap[1]:
                continue
            window, prompt = snap
            state = self.requests[s.request_id]
            assert state.observed is not None, f"{s.request_id}: its observed queries were not kept"
            scores = self.model.attention_paid(state.observed, self.kv_caches, state.block_ids, prompt)
            head = prompt - SNAPKV_OBSERVED
            pooled = torch.nn.functional.max_pool1d(scores[None, None, :head], SNAPKV_POOL, 1, SNAPKV_POOL // 2)
            ranked = torch.argsort(pooled[0, 0], descending=True, stable=True)  # ties: the earlier token
            chosen = ranked[: window - SNAPKV_OBSERVED].sort().values.tolist()
            keep = chosen + list(range(head, prompt))
            table = state.block_ids
            move_slots(
                self.kv_caches,
                [table[t // bs] * bs + t % bs for t in keep],
                [table[i // bs] * bs + i % bs for i in range(len(keep))],
            )
            state.observed = None
            state.num_evicted_tokens = prompt - window

    def _keep_tree_paths(
        self, seqs: list[SeqInput], sampled: dict[str, list[SampledToken]], hidden: torch.Tensor | None
    ) -> torch.Tensor | None:
        """After a tree was verified: its accepted path's K/V moved to the slots of the
        positions they now hold, and the hidden rows put in chain order (real tokens, then
        the path), as a proposer reads them."""
        perm, src, dst, offset = [], [], [], 0
        bs = self.block_size
        for s in seqs:
            n = len(s.token_ids)
            if s.spec_parents is None:
                perm.extend(range(offset, offset + n))
                offset += n
                continue
            num_real = n - len(s.spec_token_ids)
            accepted = [t.token_id for t in sampled[s.request_id][:-1]]  # siblings differ: the path is theirs
            path = follow(s.spec_parents, s.spec_token_ids, accepted)
            first = s.num_computed_tokens + num_real  # the slot index of the tree's first node
            for d, node in enumerate(path):
                a, b = first + node, first + d
                src.append(s.block_table[a // bs] * bs + a % bs)
                dst.append(s.block_table[b // bs] * bs + b % bs)
            rows = list(range(offset, offset + num_real)) + [offset + num_real + i for i in path]
            rows += [r for r in range(offset, offset + n) if r not in set(rows)]
            perm.extend(rows)
            offset += n
        move_slots(self.kv_caches, src, dst)
        return None if hidden is None else hidden.index_select(0, torch.tensor(perm, device=hidden.device))

    def _commit_pooled(self, pooled: dict[str, tuple[torch.Tensor, int, bool]]) -> dict[str, list[float]]:
        """Add the step's pooled rows to their requests; the finished ones' embeddings."""
        done = {}
        for rid, (total, count, final) in pooled.items():
            state = self.requests[rid]
            state.pool_sum = total if state.pool_sum is None else state.pool_sum + total
            state.pool_count += count
            if final:
                mean = state.pool_sum / state.pool_count
                done[rid] = torch.nn.functional.normalize(mean, dim=0).tolist()
        return done

    @torch.inference_mode()
    def follow(self, batch: ModelInput, committed: Committed) -> None:
        """A worker rank of a split model: take the driver's results of the step before
        (only the driver samples), apply this step's deltas and run this rank's part of
        the forward. The request state stays the driver's twin."""
        for rid, (tokens, draft) in committed.items():
            state = self.requests.get(rid)
            if state is not None:
                state.gained(tokens)
                state.draft = Draft(draft) if draft else None
        self._update_states(batch)
        self.copy_blocks(batch.block_copies)
        self._shift_kept_keys(batch)
        if batch.scheduled:
            self.compute_logits(order_seqs([self._seq_input(s) for s in batch.scheduled]))

    def _update_states(self, batch: ModelInput) -> None:
        forget = getattr(self.proposer, "forget", None)  # a proposer holding per-request state (EAGLE)
        for rid in (*batch.finished_request_ids, *batch.preempted_request_ids):
            self._evicting.discard(rid)
        for rid in batch.finished_request_ids:
            self.requests.pop(rid, None)
            self._parked_generators.pop(rid, None)
            if forget is not None:
                forget(rid)
        for rid in batch.preempted_request_ids:
            if forget is not None:
                forget(rid)
            state = self.requests.pop(rid, None)
            if state is not None and state.generator is not None:
                self._parked_generators[rid] = state.generator
        for new in batch.new_requests:
            rid = new.request_id
            held = self.requests.get(rid)  # the same step sent again (the engine's retry)
            generator = held.generator if held is not None else self._parked_generators.pop(rid, None)
            self.requests[rid] = CachedRequestState(
                rid,
                new.prompt_token_ids,
                list(new.output_token_ids),
                new.params,
                list(new.block_ids),
                generator or self._new_generator(new.params.seed),
                lora_name=new.lora_name,
                pooling=new.pooling,
                param_row=held.param_row if held is not None else param_row(new.params, self.device),
            )
            if new.params.kv_eviction is not None:
                self._evicting.add(rid)
        for c in batch.cached_requests:
            table = self.requests[c.request_id].block_ids
            del table[c.num_kept_blocks :]
            table.extend(c.new_block_ids)

    def _shift_kept_keys(self, batch: ModelInput) -> None:
        """Requests that evicted tokens since the runner last heard (``KVEviction``): the keys
        kept past their sink blocks move that many slots down their table, so their RoPE
        rotation moves back as many positions. Idempotent (a step sent again rotates nothing
        twice): the state remembers the count its keys are rotated for."""
        if not self._evicting:
            return
        for s in batch.scheduled:
            state = self.requests[s.request_id]
            delta = s.num_evicted_tokens - state.num_evicted_tokens
            if delta == 0:
                continue
            ev = state.params.kv_eviction
            assert ev is not None and ev.streams and delta > 0, (
                f"{s.request_id}: evicted tokens went from {state.num_evicted_tokens} to {s.num_evicted_tokens}"
            )
            sinks = ev.sink_tokens(self.block_size) // self.block_size
            self.model.shift_keys(self.kv_caches, state.block_ids[sinks:], -delta)
            state.num_evicted_tokens = s.num_evicted_tokens

    def _seq_input(self, s: ScheduledTokens) -> SeqInput:
        state = self.requests[s.request_id]
        k = len(s.spec_token_ids)
        if k:
            draft = state.draft
            if draft is None or draft.token_ids[:k] != s.spec_token_ids:
                raise RuntimeError(f"{s.request_id}: the scheduled drafts are not the ones this runner proposed")
        start, num_real = s.num_computed_tokens, s.num_tokens - k
        assert start + num_real <= state.num_tokens, f"{s.request_id}: scheduled past its known tokens"
        evicted = s.num_evicted_tokens  # token i sits in cache slot i - evicted
        positions = tree_mask = parents = None
        if k and state.draft is not None and state.draft.parents is not None:
            parents = state.draft.parents[:k]  # parents first: any prefix of the list is a tree
            positions, tree_mask = verification_layout(parents, num_real, start - evicted)
        return SeqInput(
            request_id=s.request_id,
            token_ids=state.token_slice(start, start + num_real) + s.spec_token_ids,
            num_computed_tokens=start - evicted,
            block_table=state.block_ids,
            sample=start + num_real == state.num_tokens and state.pooling is None,  # embeddings sample nothing
            params=state.params,
            prompt_ids=state.prompt_ids,
            output_ids=state.output_ids,
            penalties=state.penalties,
            param_row=state.param_row,
            spec_token_ids=s.spec_token_ids,
            generator=state.generator,
            draft_probs=state.draft.probs if k and state.draft is not None else None,
            pooling=state.pooling,
            num_lookahead=s.num_lookahead,
            positions=positions,
            tree_mask=tree_mask,
            spec_parents=parents,
            num_evicted_tokens=evicted,
            position_offset=evicted if evicted and not state.params.kv_eviction.streams else 0,
        )

    def _commit(
        self, batch: ModelInput, sampled: dict[str, list[SampledToken]], drafts: dict[str, Draft]
    ) -> ModelOutput:
        """The step succeeded: the requests gain their tokens and new drafts."""
        out = ModelOutput(sampled=sampled)
        for s in batch.scheduled:
            state = self.requests[s.request_id]
            state.gained([t.token_id for t in sampled.get(s.request_id, [])])
            state.draft = drafts.get(s.request_id)
            if state.draft is not None:
                out.draft_token_ids[s.request_id] = state.draft.token_ids
        return out

    # ----------------------------------------------------------- forward, sample

    def prepare(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata and the rows to take logits from."""
        return prepare_inputs(seqs, self.block_size, self.device, self._buffers)

    @torch.inference_mode()
    def compute_logits(self, seqs: list[SeqInput]) -> torch.Tensor:
        """[rows, vocab] float32 logits, in the order of ``seqs`` (``order_seqs`` first):
        one row per sampling sequence, 1 + k for one verifying k drafts. (On a worker
        rank of a split model: None, the driver gets them.)"""
        if self.stage is not None:
            return self.stage.forward(seqs)
        input_ids, positions, meta, logits_indices = self.prepare(seqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora=self._lora_mapping(seqs))
        return self.model.compute_logits(hidden[logits_indices])

    # A split model's ranks all run the same forward; scoring prompts would need every
    # row's logits on each of them (distributed.runner turns this off).
    scores_prompts = True

    @property
    def shifts_keys(self) -> bool:
        """Requests may evict K/V (``KVEviction``): this process holds every layer's cache and
        the model's cached keys can move to other positions."""
        return self.stage is None and self.model.keys_shift

    def _forward(
        self, seqs: list[SeqInput]
    ) -> tuple[
        torch.Tensor,
        dict[str, tuple[int, list[PromptLogprob]]],
        dict[str, tuple[torch.Tensor, int, bool]],
        torch.Tensor | None,
    ]:
        """``compute_logits``; the scores of the prompt tokens the chunks of
        prompt_logprobs requests predict (logits only for those rows, a slice at a time);
        for embedding requests, their chunk's pooled final hidden state (the last
        row, or the sum of rows for a mean), with its row count and whether the prompt
        is done; and the final hidden states of every row (what a speculative head drafts
        from; None on a split model). Nothing is kept here: the step may be sent again."""
        if self.stage is not None:
            return self.compute_logits(seqs), {}, {}, None
        input_ids, positions, meta, logits_indices = self.prepare(seqs)
        observed = self._observed_rows(seqs)
        if observed:
            rows = [r for _, first, _, n in observed for r in range(first, first + n)]
            meta.query_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora=self._lora_mapping(seqs))
        if observed:
            self._keep_observed(observed, meta.kept_queries)
        if not any(_scores_prompt(s) or s.pooling for s in seqs):
            return self.model.compute_logits(hidden[logits_indices]), {}, {}, hidden
        scores, pooled, offset = {}, {}, 0
        for s in seqs:
            n = len(s.token_ids)
            if _scores_prompt(s):
                scores[s.request_id] = self._prompt_scores(s, hidden, offset)
            pooling = s.pooling.pooling_type if s.pooling is not None else None
            if pooling == "last":
                final = s.num_computed_tokens + n == len(s.prompt_ids)
                if final:
                    pooled[s.request_id] = (hidden[offset + n - 1].float(), 1, True)
            elif pooling == "mean":
                total = hidden[offset : offset + n].float().sum(dim=0)
                pooled[s.request_id] = (total, n, s.num_computed_tokens + n == len(s.prompt_ids))
            offset += n
        return self.model.compute_logits(hidden[logits_indices]), scores, pooled, hidden

    def _prompt_scores(self, s: SeqInput, hidden: torch.Tensor, offset: int) -> tuple[int, list[PromptLogprob]]:
        """(first, scores): the logprob, rank and top-k of prompt tokens first..last, which
        this chunk's positions predict (position q predicts token q + 1)."""
        start, k = s.num_computed_tokens + s.num_evicted_tokens, s.params.prompt_logprobs or 0
        first, last = start + 1, min(start + len(s.token_ids), len(s.prompt_ids) - 1)
        entries: list[PromptLogprob] = []
        for a in range(first, last + 1, PROMPT_SCORE_ROWS):
            b = min(a + PROMPT_SCORE_ROWS, last + 1)
            rows = hidden[offset + a - 1 - start : offset + b - 1 - start]
            logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = torch.tensor(s.prompt_ids[a:b], device=logprobs.device)
            picked = logprobs.gather(1, targets[:, None])
            chosen = picked.squeeze(1).tolist()
            ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()  # 1: the most likely token
            if k:
                vals, ids = logprobs.topk(k, dim=-1)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
            else:
                tops = [[] for _ in chosen]
            entries += list(zip(chosen, ranks, tops, strict=True))
        return first, entries

    @torch.inference_mode()
    def all_logits(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Logits at every new position of the batch (scoring, and tests against a reference)."""
        if self.stage is not None:
            return self.stage.forward(seqs, all_rows=True)
        input_ids, positions, meta, _ = self.prepare(seqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora=self._lora_mapping(seqs))
        return self.model.compute_logits(hidden)

    def _lora_mapping(self, seqs: list[SeqInput]) -> LoRAMapping | None:
        """The flat batch's rows per adapter slot (rows follow ``seqs``)."""
        if self.lora is None:
            return None
        rows = [
            (self.requests[s.request_id].lora_name if s.request_id in self.requests else None, len(s.token_ids))
            for s in seqs
        ]
        return self.lora.mapping(rows, self.device)

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        if self.lora is None:
            raise RuntimeError("this runner was built without LoRA slots (enable_lora)")
        return self.lora.load(name, path)

    def add_lora(self, name: str, path: str, loaded: LoRAAdapter | None = None) -> None:
        if self.lora is None:
            raise RuntimeError("this runner was built without LoRA slots (enable_lora)")
        self.lora.add(name, path, loaded)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K/V in every layer, in list order."""
        copy_blocks(self.kv_caches, copies)
        if self.proposer is not None:
            self.proposer.copy_blocks(copies)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV as raw bytes (``read_blocks``), for another engine's cache."""
        self._check_no_draft_cache("exported")
        return read_blocks(self.kv_caches, block_ids)

    def save_to_host(self, block_ids: list[int], slots: list[int]) -> None:
        """The blocks' KV into the host tier's buffer (``HostKVBuffer``), at ``slots``."""
        self._check_no_draft_cache("copied to host memory")
        assert self.host_kv is not None, "no host buffer"
        self.host_kv.save(self.kv_caches, block_ids, slots)

    def load_from_host(self, slots: list[int], block_ids: list[int]) -> None:
        """The host buffer's ``slots`` back into the blocks."""
        self._check_no_draft_cache("copied from host memory")
        assert self.host_kv is not None, "no host buffer"
        self.host_kv.load(self.kv_caches, slots, block_ids)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | bytes | bytearray, first_row: int = 0) -> None:
        """Write KV exported by an engine of the same model and KV dtype into the blocks:
        rows ``first_row`` on of ``data`` (``export_blocks``' tensor, or its raw bytes: a
        bytearray is read in place, not copied)."""
        self._check_no_draft_cache("imported")
        if not isinstance(data, torch.Tensor):
            row = block_nbytes(self.kv_caches)
            if len(data) % row:
                raise ValueError(f"{len(data)} bytes of KV are not whole blocks of {row} bytes")
            data = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
            data = data.view(-1, row)
        write_blocks(self.kv_caches, block_ids, data[first_row : first_row + len(block_ids)])

    def _check_no_draft_cache(self, what: str) -> None:
        if self.proposer is not None and getattr(self.proposer, "catch_up", False):  # a draft model with its own KV
            raise NotImplementedError(f"KV cannot be {what} with a draft model (its own cache would not follow)")

    def close(self) -> None:
        """Release what outlives the object (a split model's worker processes)."""

    def _new_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def _generator_or_default(self, request_id: str, seed: int | None = None) -> torch.Generator:
        state = self.requests.get(request_id)
        gen = state.generator if state is not None else None
        return gen or self._default_generator
