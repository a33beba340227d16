"""Quantised linear layers and the quantised KV cache against float references,
within error bounds derived from the quantisation step."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.kv import dequantize, quantize
from tokenmill.quant.weights import Int4Linear, Int8Linear, dequantize_int4, quantize_int4


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m", [1, 5, 64])
def test_int8_linear_is_within_half_a_step_per_weight(m):
    w, x = rand(96, 128), rand(m, 128, seed=1)
    layer = Int8Linear.quantize(w, torch.float32)
    exact = x @ w.T
    # each weight is off by at most half its row's step s_n = max|w_n| / 127; the
    # kernel's bfloat16 input and output add at most 2**-8 relative each
    bound = x.abs().sum(1, keepdim=True) * layer.scales.float()[None, :] / 2 + 2**-7 * (x.abs() @ w.abs().T)
    err = (layer(x) - exact).abs()
    assert (err <= bound * 1.01 + 1e-4).all()
    assert err.max() / exact.abs().max() < 0.02


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_int4_linear_is_within_half_a_step_per_group(m, group):
    w, x = rand(64, 256), rand(m, 256, seed=1)
    layer = Int4Linear.quantize(w, group)
    q, sz = quantize_int4(w, group)
    dq = dequantize_int4(q, sz, group)
    assert ((dq - w).abs() <= sz[:, :, 0].T.repeat_interleave(group, 1) / 2 + 1e-6).all()  # half a step per weight
    out = layer(x)
    rounding = 2**-7 * (x.abs() @ dq.abs().T)  # bfloat16 input, scales and output
    assert ((out - x @ dq.T).abs() <= rounding + 1e-3).all()  # the packed kernel computes that
    step = sz[:, :, 0].T  # [N, K/G]
    bound = (x.abs().reshape(m, -1, group).sum(-1) @ step.T) / 2
    assert ((out - x @ w.T).abs() <= bound + rounding + 1e-3).all()


def test_int4_needs_a_group_that_divides_the_input():
    with pytest.raises(ValueError, match="does not divide 100"):
        Int4Linear.quantize(rand(16, 100), 64)


@pytest.mark.parametrize("kind,rel", [("int8", 1 / 254 * (1 + 2**-6)), ("fp8", 2**-4)])
def test_kv_round_trip_bounds(kind, rel):
    x = rand(500, 3, 64) * torch.logspace(-2, 2, 500)[:, None, None]  # magnitudes over four decades
    q, scale = quantize(x, kind)
    back = dequantize(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        assert ((back - x).abs() <= amax * rel + 1e-7).all()  # half a step of max|x| / 127
    else:  # 3 mantissa bits: relative to each value, plus the smallest step near zero
        assert ((back - x).abs() <= x.abs() * rel + amax * 2**-9).all()
    assert q.element_size() == 1
