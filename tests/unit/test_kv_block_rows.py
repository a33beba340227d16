"""KV blocks as raw rows (what the host and disk tiers and disaggregated prefill move): blocks
read out and written into other blocks come back bit for bit, whether their bytes move as
8-byte words (aligned layouts) or as bytes (any other), scales of quantised caches included."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.layers.kv_cache import KVCacheLayer, block_nbytes, read_blocks, write_blocks


def layers(block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, scales: bool) -> list[KVCacheLayer]:
    g = torch.Generator().manual_seed(block_size * 100 + head_dim)
    shape = (6, block_size, kv_heads, head_dim)

    def rand(*s):
        return torch.randn(*s, generator=g).to(dtype)

    out = []
    for _ in range(2):
        ks = torch.rand(6, block_size, kv_heads, generator=g) if scales else None
        vs = torch.rand(6, block_size, kv_heads, generator=g) if scales else None
        out.append(KVCacheLayer(rand(*shape), rand(*shape), torch.float32, "int8" if scales else None, ks, vs))
    return out


@pytest.mark.parametrize(
    "block_size,kv_heads,head_dim,dtype,scales",
    [(16, 2, 8, torch.float32, False), (1, 1, 3, torch.float16, False), (3, 1, 5, torch.int8, True)],
    ids=["words", "bytes", "int8-with-scales"],
)
def test_blocks_read_and_written_elsewhere_come_back_bit_for_bit(block_size, kv_heads, head_dim, dtype, scales):
    cache = layers(block_size, kv_heads, head_dim, dtype, scales)
    rows = read_blocks(cache, [4, 1])
    assert rows.dtype == torch.uint8 and rows.shape == (2, block_nbytes(cache))
    before = [t.clone() for layer in cache for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    write_blocks(cache, [0, 5], rows)
    after = [t for layer in cache for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new[0].view(torch.uint8), old[4].view(torch.uint8))
        assert torch.equal(new[5].view(torch.uint8), old[1].view(torch.uint8))
        assert torch.equal(new[1:5].view(torch.uint8), old[1:5].view(torch.uint8))  # the others untouched
    assert torch.equal(read_blocks(cache, [0, 5]), rows)
    with pytest.raises(ValueError, match="do not fit"):
        write_blocks(cache, [0], rows)
