"""ModelInput (ids and counts) -> tensors -> model -> sampler -> ModelOutput.

The only place where a schedule turns into tensors. It keeps one piece of
per-request state: the torch.Generator of each seeded request, so that a seeded
request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from tokenmill.engine.model_input import ModelInput, ModelOutput, SampledToken
from tokenmill.model.layers.attention import AttentionMetadata, build_decode_groups
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.worker.kv_cache import KVCache
from tokenmill.worker.sampler import SampleRow, sample


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()

    @staticmethod
    def order(batch: ModelInput) -> ModelInput:
        """Single-token sequences first, by context length (attention groups them), then the rest."""
        decodes = sorted((s for s in batch.seqs if len(s.token_ids) == 1), key=lambda s: s.num_computed_tokens)
        others = [s for s in batch.seqs if len(s.token_ids) != 1]
        return ModelInput(decodes + others, batch.block_copies, batch.finished_request_ids)

    def prepare(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata and the rows to take logits from."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for s in batch.seqs:
            n = len(s.token_ids)
            assert n >= 1, f"{s.request_id}: a scheduled sequence needs at least one token"
            start = s.num_computed_tokens
            assert len(s.block_table) * bs >= start + n, "block table too short for the scheduled tokens"
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            if s.sample:
                logits_indices.append(query_start_loc[-1] - 1)
        num_decodes = len(_decodes(batch.seqs))
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            block_size=bs,
            decode_groups=build_decode_groups(
                seq_lens[:num_decodes], [s.block_table for s in batch.seqs[:num_decodes]], bs, dev
            ),
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """[num sequences with sample=True, vocab] float32 logits, in the batch's order
        (call ``order`` first so that decodes come first, sorted by length)."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[logits_indices])

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> ModelOutput:
        for rid in batch.finished_request_ids:
            self._generators.pop(rid, None)
        self.copy_blocks(batch.block_copies)
        if not batch.seqs:
            return ModelOutput(sampled={})
        batch = self.order(batch)
        logits = self.compute_logits(batch)
        sampling = [s for s in batch.seqs if s.sample]
        rows = [SampleRow(s.params, s.prompt_ids, s.output_ids, self._generator(s.request_id, s.params.seed)) for s in sampling]
        out = sample(logits, rows, self._default_generator)
        return ModelOutput(
            sampled={
                s.request_id: SampledToken(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                for i, s in enumerate(sampling)
            }
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K/V in every layer, in list order."""
        for src, dst in copies:
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen


def _decodes(seqs: list) -> list:
    """The leading run of single-token sequences (the scheduler puts them first)."""
    out = []
    for s in seqs:
        if len(s.token_ids) != 1:
            break
        out.append(s)
    return out
