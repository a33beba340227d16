"""One rank's share of a forward pass: its layers of its shard, over micro-batches.

Every rank holds the same step record, so every rank cuts the step's sequences into
the same micro-batches and knows every tensor's shape without being told. With
pipeline stages a step's sequences are cut into up to ``pp_size`` micro-batches
(contiguous, balanced by tokens): the first stage computes micro-batch 0, starts
sending its residual stream to the next stage and goes on to micro-batch 1 while the
next stage works on 0, and so on down the pipe. The last stage takes the logits
rows, gathers the vocabulary columns of its TP ranks and sends them to the driver,
which samples. A step of one sequence is one micro-batch (nothing to overlap).

Within a stage, the TP ranks compute the same rows at once and meet at each
row-parallel layer's all-reduce (``model.tp``).
"""

from __future__ import annotations

import torch

from tokenmill.configuration.config import ModelConfig
from tokenmill.distributed.groups import ParallelGroups
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.worker.inputs import InputBuffers, SeqInput, prepare_inputs
from tokenmill.worker.kv_allocation import KVCache

RESIDUAL_TAG, LOGITS_TAG = 0, 1 << 20  # + micro-batch index


def split_microbatches(seqs: list[SeqInput], n: int) -> list[list[SeqInput]]:
    """Up to ``n`` contiguous, non-empty groups with about equal token counts."""
    n = min(n, len(seqs))
    if n <= 1:
        return [seqs]
    total = sum(len(s.token_ids) for s in seqs)
    groups: list[list[SeqInput]] = [[]]
    done = 0
    for i, s in enumerate(seqs):
        groups[-1].append(s)
        done += len(s.token_ids)
        left_seqs, left_groups = len(seqs) - i - 1, n - len(groups)
        if left_groups and (done * n >= total * len(groups) or left_seqs == left_groups):
            groups.append([])
    return groups


class PipelineStage:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        groups: ParallelGroups,
        hidden_size: int,
        vocab_size: int,
    ) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.groups = groups
        self.shard = groups.shard
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype = next(model.parameters()).dtype
        self._buffers = InputBuffers()

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], all_rows: bool = False) -> torch.Tensor | None:
        """[rows, vocab] float32 logits on the driver (rank 0), None on every other rank.
        Rows: each sampling sequence's last token and drafted positions, or with
        ``all_rows`` every token of the step."""
        g, shard = self.groups, self.shard
        microbatches = split_microbatches(seqs, shard.pp_size)
        pending = []  # sends in flight, with the tensors they read
        logits = []
        for i, mb in enumerate(microbatches):
            input_ids, positions, meta, rows = prepare_inputs(mb, self.block_size, self.device, self._buffers)
            residual = None
            if not shard.is_first_stage:
                residual = torch.empty(len(input_ids), self.hidden_size, dtype=self.dtype, device=self.device)
                g.recv(residual, g.rank_of(shard.tp_rank, shard.pp_rank - 1), RESIDUAL_TAG + i)
            out = self.model(input_ids, positions, self.kv_caches, meta, residual=residual)
            if not shard.is_last_stage:
                pending.append((g.send(out, g.rank_of(shard.tp_rank, shard.pp_rank + 1), RESIDUAL_TAG + i), out))
                continue
            if not all_rows and not len(rows):  # no row of this micro-batch samples (a prompt chunk)
                continue
            local = self.model.compute_logits(out if all_rows else out[rows])
            full = local if shard.tp_size == 1 else g.tp.gather_columns(local, self.vocab_size)
            if full is None:
                continue
            if g.rank == 0:
                logits.append(full)
            else:  # the last stage's first TP rank hands the logits to the driver
                pending.append((g.send(full, 0, LOGITS_TAG + i), full))
        if g.rank == 0 and not shard.is_last_stage:
            last = g.rank_of(0, shard.pp_size - 1)
            for i, mb in enumerate(microbatches):
                n = sum(len(s.token_ids) if all_rows else (1 + len(s.spec_token_ids)) * s.sample for s in mb)
                if n:
                    logits.append(g.recv(torch.empty(n, self.vocab_size, device=self.device), last, LOGITS_TAG + i))
        for work, _ in pending:
            work.wait()
        if g.rank != 0:
            return None
        if not logits:
            return torch.empty(0, self.vocab_size, device=self.device)
        return logits[0] if len(logits) == 1 else torch.cat(logits)


def parallel_stage(
    groups: ParallelGroups,
    model: LlamaForCausalLM,
    kv_caches: list,
    block_size: int,
    device: torch.device,
    config: ModelConfig,
) -> PipelineStage:
    """Wire a rank's shard to its groups: the TP all-reduces, the pipeline's sends."""
    model.tp = groups.tp if groups.shard.tp_size > 1 else None
    return PipelineStage(model, kv_caches, block_size, device, groups, config.hidden_size, config.vocab_size)
