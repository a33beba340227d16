"""RoPE keys moved to other positions (``RotaryEmbedding.shift``): what KV eviction re-rotates."""

from __future__ import annotations

import pytest
import torch

from tokenmill.configuration.config import RopeScaling
from tokenmill.model.layers.rotary import rotary_for


def test_a_shifted_key_is_the_key_rotated_at_its_new_position():
    scaling = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)
    for rotary in (rotary_for(64, 10000.0, None, 4096), rotary_for(64, 500000.0, scaling, 4096)):
        x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0))
        positions = torch.tensor([0, 3, 100, 2000, 4000])
        _, at_p = rotary(positions, x, x)
        for delta in (-4000 + 4095, -3, 17):
            moved = torch.clamp(positions + delta, 0, 4095)
            d = moved - positions
            for i in range(5):
                _, want = rotary(moved[i : i + 1], x[i : i + 1], x[i : i + 1])
                got = rotary.shift(at_p[i : i + 1], int(d[i]))
                # (the table's own float32 angles are ~5e-4 rad off at position 4,000)
                assert torch.allclose(got, want, atol=1e-3), (delta, i, (got - want).abs().max())


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
def test_a_cache_layers_keys_rotate_in_place_and_only_in_the_blocks_named(quant):
    """``KVCacheLayer.rotate_keys``: the named blocks' keys become the rotated ones (quantised
    caches: dequantised, rotated, quantised again), values and other blocks untouched."""
    from tokenmill.model.layers.kv_cache import KVCacheLayer
    from tokenmill.quant.kv import QUANTIZED_KV, SCALE_DTYPE, quantize

    gen = torch.Generator().manual_seed(1)
    shape = (4, 16, 2, 64)  # blocks, block size, kv heads, head dim
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if quant is None:
        layer = KVCacheLayer(k.clone(), v.clone(), torch.float32)
    else:
        (qk, sk), (qv, sv) = quantize(k, quant), quantize(v, quant)
        assert qk.dtype == QUANTIZED_KV[quant][0] and sk.dtype == SCALE_DTYPE
        layer = KVCacheLayer(qk, qv, torch.float32, quant, sk, sv)
    before_k, before_v = layer.gather(torch.arange(4))
    rotary = rotary_for(64, 10000.0, None, 4096)
    blocks = torch.tensor([1, 3])
    layer.rotate_keys(blocks, lambda x: rotary.shift(x, -37))
    after_k, after_v = layer.gather(torch.arange(4))
    want = rotary.shift(before_k[blocks], -37)
    tol = 0 if quant is None else (0.05 if quant == "int8" else 0.3)
    assert (after_k[blocks] - want).abs().max() <= max(tol, 1e-5)
    assert torch.equal(after_k[[0, 2]], before_k[[0, 2]]) and torch.equal(after_v, before_v)
