"""Tiny random Llamas saved by transformers load from their folder and match its logits."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import all_logits, make_tiny_llama, seq
from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")


def ours_for(path, block_size=4, num_blocks=64):
    ckpt = load_checkpoint(path, torch.float32, progress=False)
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights)
    caches = allocate_kv_cache(ckpt.config, num_blocks, block_size, torch.float32, "cpu")
    return ckpt.config, ModelRunner(model, caches, block_size, torch.device("cpu")), BlockPool(num_blocks)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 8},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ],
    ids=["gqa", "tied", "mha", "llama3-rope"],
)
def test_tiny_llama_matches_transformers(tmp_path, overrides):
    ref_model = make_tiny_llama(tmp_path, **overrides)
    cfg, runner, pool = ours_for(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = pool.allocate(10)
    ours = all_logits(runner, [seq(ids, blocks)])
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_sharded_safetensors_load(tmp_path):
    ref_model = make_tiny_llama(tmp_path / "single")
    ref_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = load_checkpoint(tmp_path / "single", progress=False).weights
    b = load_checkpoint(tmp_path / "sharded", progress=False).weights
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
