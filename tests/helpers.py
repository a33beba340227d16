"""Test helpers: run our model directly on hand-built block tables."""

from __future__ import annotations

import torch

from tokenmill.engine.model_input import ModelInput, SeqInput
from tokenmill.sampling_params import SamplingParams


def seq(token_ids, block_table, num_computed=0, request_id="r", sample=True) -> SeqInput:
    return SeqInput(
        request_id=request_id,
        token_ids=list(token_ids),
        num_computed_tokens=num_computed,
        block_table=list(block_table),
        sample=sample,
        params=SamplingParams(),
        prompt_ids=[],
        output_ids=[],
    )


@torch.inference_mode()
def all_logits(runner, seqs) -> torch.Tensor:
    """Logits at every new position of the batch (not only the sampled ones)."""
    input_ids, positions, meta, _ = runner.prepare(ModelInput(seqs=seqs))
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    return runner.model.compute_logits(hidden)
