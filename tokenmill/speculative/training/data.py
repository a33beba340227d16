"""Self-distillation data for a speculative head: the served model's own answers and
the features it computed for them.

The target answers chat prompts (greedy, through the engine, batched); then one
forward over each whole conversation (prompt + answer) gives the final hidden state
at every position, the features an EAGLE head learns to continue and a Medusa head
reads. Written in shards of ``chunk`` conversations (each with a note of the prompts and
length it answers), so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.inputs import SeqInput, prepare_inputs
from tokenmill.worker.kv_allocation import allocate_kv_cache

FEATURE_BATCH_TOKENS = 4096  # tokens per feature forward (the scratch cache holds this many)


@torch.inference_mode()
def target_features(model: LlamaForCausalLM, sequences: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """Per sequence, [len, hidden] final-norm hidden states of the target over it (its
    own scratch KV cache: the engine's, and its prefix cache, are left alone)."""
    cfg = model.config
    dtype = model.layers[0].input_layernorm.weight.dtype
    device = model.layers[0].input_layernorm.weight.device
    longest = max(len(s) for s in sequences)
    capacity = max(FEATURE_BATCH_TOKENS, longest)
    caches = allocate_kv_cache(cfg, -(-capacity // block_size) + len(sequences), block_size, dtype, device)
    out: list[torch.Tensor] = []
    batch: list[list[int]] = []

    def run() -> None:
        seqs, next_block = [], 0
        for i, tokens in enumerate(batch):
            n_blocks = -(-len(tokens) // block_size)
            table = list(range(next_block, next_block + n_blocks))
            next_block += n_blocks
            seqs.append(SeqInput(str(i), tokens, 0, table, False, SamplingParams(max_tokens=1), [], []))
        ids, positions, meta, _ = prepare_inputs(seqs, block_size, device)
        hidden = model(ids, positions, caches, meta)
        at = 0
        for tokens in batch:
            out.append(hidden[at : at + len(tokens)].clone())
            at += len(tokens)
        batch.clear()

    for tokens in sequences:
        if batch and sum(map(len, batch)) + len(tokens) > capacity:
            run()
        batch.append(tokens)
    if batch:
        run()
    return out


def collect(
    llm,
    prompts: list[str],
    out_dir: Path,
    max_tokens: int,
    chunk: int = 64,
    on_shard: Callable[[int, int, int], None] | None = None,
) -> list[Path]:
    """Generate answers for ``prompts`` with ``llm`` (a ``tokenmill.LLM``) and save
    shards ``shard_00000.pt``... under ``out_dir``: per conversation its token ids, where
    the answer starts and the target's features. Shards already there are kept.
    ``on_shard(done, total, tokens)`` reports progress."""
    out_dir.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    paths = []
    for n, start in enumerate(range(0, len(prompts), chunk)):
        path = out_dir / f"shard_{n:05d}.pt"
        paths.append(path)
        part = prompts[start : start + chunk]
        if _made_for(path, part, max_tokens):
            if on_shard is not None:
                on_shard(start + len(part), len(prompts), 0)
            continue
        outs = llm.chat([[{"role": "user", "content": p}] for p in part], params)
        tokens = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        starts = [len(o.prompt_token_ids) for o in outs]
        feats = target_features(llm.model, tokens)
        tmp = path.with_suffix(".tmp")
        torch.save({"tokens": tokens, "answer_start": starts, "features": feats}, tmp)
        path.with_suffix(".json").write_text(json.dumps({"prompts": part, "max_tokens": max_tokens}))
        tmp.rename(path)
        if on_shard is not None:
            on_shard(start + len(part), len(prompts), sum(len(t) - s for t, s in zip(tokens, starts, strict=True)))
    return paths


def _made_for(path: Path, prompts: list[str], max_tokens: int) -> bool:
    """The shard exists and answers exactly these prompts at this length (other prompts
    or another --max-tokens make it again rather than train on the wrong data)."""
    meta = path.with_suffix(".json")
    if not path.exists() or not meta.exists():
        return False
    return json.loads(meta.read_text()) == {"prompts": prompts, "max_tokens": max_tokens}
