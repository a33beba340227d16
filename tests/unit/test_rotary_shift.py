"""RoPE keys moved to other positions (``RotaryEmbedding.shift``): what KV eviction re-rotates."""

from __future__ import annotations

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
