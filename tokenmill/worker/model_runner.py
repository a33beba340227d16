"""ModelInput (ids and counts) -> tensors -> model -> sampler -> ModelOutput.

The only place where a schedule turns into tensors. It keeps per-request state that
must survive between steps: the torch.Generator of each seeded request (so that a
seeded request samples the same tokens whatever else shares its batch), and, when
speculating, the draft probabilities of the tokens each request will verify next.
"""

from __future__ import annotations

import torch

from tokenmill.engine.model_input import ModelInput, ModelOutput, SampledToken, SeqInput
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.kv_cache import copy_blocks
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.spec.proposer import Proposer
from tokenmill.spec.rejection import verify_greedy, verify_sampled
from tokenmill.worker.inputs import order_seqs, prepare_inputs
from tokenmill.worker.kv_cache import KVCache
from tokenmill.worker.sampler import SampleRow, chosen_logprobs, sample, sampling_distribution


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        proposer: Proposer | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.proposer = proposer
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    @staticmethod
    def order(batch: ModelInput) -> ModelInput:
        """Single-token sequences first, by context length (attention groups them), then the rest."""
        return ModelInput(order_seqs(batch.seqs), batch.block_copies, batch.finished_request_ids)

    def prepare(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata and the rows to take logits from."""
        return prepare_inputs(batch.seqs, self.block_size, self.device)

    @torch.inference_mode()
    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """[rows, vocab] float32 logits, in the batch's order: one row per sampling
        sequence, 1 + k for one verifying k drafts (call ``order`` first)."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[logits_indices])

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> ModelOutput:
        for rid in batch.finished_request_ids:
            self._generators.pop(rid, None)
            self._draft_probs.pop(rid, None)
        self.copy_blocks(batch.block_copies)
        if not batch.seqs:
            return ModelOutput(sampled={})
        batch = self.order(batch)
        logits = self.compute_logits(batch)
        sampled = self._sample(batch.seqs, logits)
        out = ModelOutput(sampled=sampled)
        if self.proposer is not None:
            new_tokens = {rid: [t.token_id for t in toks] for rid, toks in sampled.items()}
            for rid, draft in self.proposer.propose(batch.seqs, new_tokens, self._generator_or_default).items():
                out.draft_token_ids[rid] = draft.token_ids
                self._draft_probs[rid] = draft.probs
        return out

    def _sample(self, seqs: list[SeqInput], logits: torch.Tensor) -> dict[str, list[SampledToken]]:
        """Plain sequences go through the batched sampler; speculating ones through
        verification of their drafts."""
        plain_rows, plain, spec_rows, spec = [], [], [], []
        row = 0
        for s in seqs:
            if not s.sample:
                continue
            n = 1 + len(s.spec_token_ids)
            (spec_rows if s.spec_token_ids else plain_rows).extend(range(row, row + n))
            (spec if s.spec_token_ids else plain).append(s)
            row += n
        assert row == logits.shape[0]
        result: dict[str, list[SampledToken]] = {}
        if plain:
            rows = [SampleRow(s.params, s.prompt_ids, s.output_ids, self._generator(s.request_id, s.params.seed))
                    for s in plain]  # fmt: skip
            out = sample(logits[plain_rows], rows, self._default_generator)
            for i, s in enumerate(plain):
                result[s.request_id] = [SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])]
        if spec:
            result.update(self._verify(spec, logits[spec_rows]))
        return result

    def _verify(self, seqs: list[SeqInput], logits: torch.Tensor) -> dict[str, list[SampledToken]]:
        """logits: k_i + 1 rows per sequence. Row i is judged with the penalties the
        sequence would have after accepting its first i drafts."""
        rows = [
            SampleRow(s.params, s.prompt_ids, s.output_ids + s.spec_token_ids[:i], self._generator_or_default(s.request_id, s.params.seed))
            for s in seqs
            for i in range(len(s.spec_token_ids) + 1)
        ]  # fmt: skip
        dist, greedy = sampling_distribution(logits, rows)
        greedy_list = greedy.tolist()
        raw = logits.log_softmax(dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        result = {}
        start = 0
        for s in seqs:
            k = len(s.spec_token_ids)
            if s.params.greedy:
                tokens = verify_greedy(greedy_list[start : start + k + 1], s.spec_token_ids)
            else:
                assert dist is not None
                q = self._draft_probs.get(s.request_id)
                q = q[:k] if q is not None and q.shape[0] >= k else None
                tokens = verify_sampled(dist[start : start + k + 1], s.spec_token_ids, q, rows[start].generator)
            taken = list(range(start, start + len(tokens)))
            if raw is not None and s.params.logprobs is not None:
                lps, tops = chosen_logprobs(raw[taken], tokens, [rows[i] for i in taken])
            else:
                lps, tops = [None] * len(tokens), [[] for _ in tokens]
            result[s.request_id] = [SampledToken(t, lp, top) for t, lp, top in zip(tokens, lps, tops, strict=True)]
            start += k + 1
        return result

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K/V in every layer, in list order."""
        copy_blocks(self.kv_caches, copies)
        if self.proposer is not None:
            self.proposer.copy_blocks(copies)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def _generator_or_default(self, request_id: str, seed: int | None) -> torch.Generator:
        return self._generator(request_id, seed) or self._default_generator
