"""The block-table interface: scattered blocks, chunked prefill and mixed batches
give the same logits as one contiguous prefill (the naive reference)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import all_logits, seq
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_checkpoint
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
BS = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    ckpt = load_checkpoint(path, progress=False)
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights)
    return ModelRunner(model, allocate_kv_cache(ckpt.config, 64, BS, torch.float32, "cpu"), BS, torch.device("cpu"))


def tokens(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_scattered_blocks_equal_contiguous(runner):
    ids = tokens(23, 0)  # 6 blocks, the last one partial
    contiguous = all_logits(runner, [seq(ids, [0, 1, 2, 3, 4, 5])])
    scattered = all_logits(runner, [seq(ids, [41, 7, 63, 12, 30, 9])])
    torch.testing.assert_close(scattered, contiguous, rtol=0, atol=1e-5)


def test_chunked_prefill_and_decode_equal_one_prefill(runner):
    ids = tokens(30, 1)
    table = [50, 3, 17, 28, 8, 44, 60, 21]
    full = all_logits(runner, [seq(ids, table)])
    parts = []
    for start, end in [(0, 7), (7, 8), (8, 19), (19, 30)]:  # chunks straddle block edges
        parts.append(all_logits(runner, [seq(ids[start:end], table, num_computed=start)]))
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-5)


def test_mixed_batch_of_decodes_and_prefills_equals_each_alone(runner):
    a, b, c, d = tokens(9, 2), tokens(17, 3), tokens(5, 4), tokens(12, 5)
    ta, tb, tc, td = [1, 2, 3, 4], [10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33]
    # Each alone: a and b decode their last token, c is a fresh prefill, d a second chunk.
    all_logits(runner, [seq(a[:-1], ta)])
    all_logits(runner, [seq(b[:-1], tb)])
    all_logits(runner, [seq(d[:6], td)])
    alone = torch.cat(
        [
            all_logits(runner, [seq(a[-1:], ta, 8)]),
            all_logits(runner, [seq(b[-1:], tb, 16)]),
            all_logits(runner, [seq(c, tc)]),
            all_logits(runner, [seq(d[6:], td, 6)]),
        ]
    )
    # Together, over the same cached prefixes: one step, two decodes then two prefills.
    mixed = all_logits(
        runner,
        [seq(a[-1:], ta, 8, "a"), seq(b[-1:], tb, 16, "b"), seq(c, tc, 0, "c"), seq(d[6:], td, 6, "d")],
    )
    torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-5)


def test_decodes_of_very_different_lengths_equal_each_alone(runner):
    """Decodes are grouped by context length; each group pads only to its own longest."""
    from tokenmill.model.layers.attention import build_decode_groups

    lengths = [3, 90, 5, 41, 2, 60]
    free = list(range(63, -1, -1))  # hand out blocks from the top: scattered, non-overlapping
    tables = [[free.pop(0) for _ in range(-(-n // BS))] for n in lengths]
    seqs_ids = [tokens(n, 10 + i) for i, n in enumerate(lengths)]
    alone = []
    for ids, table in zip(seqs_ids, tables, strict=True):
        if len(ids) > 1:
            all_logits(runner, [seq(ids[:-1], table)])
        alone.append(all_logits(runner, [seq(ids[-1:], table, len(ids) - 1)]))
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batched = all_logits(runner, [seq(seqs_ids[i][-1:], tables[i], lengths[i] - 1, str(i)) for i in order])
    torch.testing.assert_close(batched, torch.cat([alone[i] for i in order]), rtol=0, atol=1e-5)
    groups = build_decode_groups(sorted(lengths), [[0] * 23] * 6, BS, torch.device("cpu"))
    assert [(g.start, g.end) for g in groups] == [(0, 2), (2, 3), (3, 5), (5, 6)]  # 2,3 | 5 | 41,60 | 90
