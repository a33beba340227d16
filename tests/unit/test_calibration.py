"""`tokenmill quantize`'s calibration: samples spread over unlike texts, and GPTQ's act order
(columns by falling Hessian diagonal, groups' scales fixed from the original weights)."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from tokenmill.errors import TokenmillError
from tokenmill.quantize.calibrate.gptq import Hessian, gptq
from tokenmill.quantize.calibrate.rtn import QuantSpec, relative_errors, rtn
from tokenmill.quantize.calibration import (
    MIN_DOCS_CHARS,
    bundled_text,
    calibration_samples,
    calibration_texts,
    stdlib_docs,
)


class Words:
    """Token ids = the integers a text is made of (each window's origin is then readable)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) for w in text.split()]


def text(start: int, n: int) -> str:
    return " ".join(str(i) for i in range(start, start + n))


def test_samples_are_shared_between_texts_and_spread_over_each():
    a, b = text(0, 1000), text(10_000, 1000)
    windows = calibration_samples(Words(), [a, b], 6, 100)
    assert len(windows) == 6
    for w in windows:
        assert len(w) == 100 and w == list(range(w[0], w[0] + 100))  # consecutive, from one text
    assert sorted(w[0] for w in windows) == [0, 450, 900, 10_000, 10_450, 10_900]  # 3 each, first to last


def test_a_small_text_weighs_as_much_as_a_large_one():
    windows = calibration_samples(Words(), [text(0, 250), text(10_000, 5000)], 8, 100)
    small = sorted(w[0] for w in windows if w[0] < 10_000)
    assert small == [0, 50, 100, 150]  # its share, at overlapping offsets
    assert len(windows) == 8 and all(len(w) == 100 for w in windows)


def test_a_text_shorter_than_a_window_gives_itself_once():
    windows = calibration_samples(Words(), [text(0, 30), text(10_000, 1000)], 4, 100)
    assert windows[0] == list(range(30)) and len(windows) == 4
    assert calibration_samples(Words(), [text(0, 5), text(100, 30)], 4, 100) == [list(range(100, 130))]
    with pytest.raises(TokenmillError, match="fewer than 2 tokens"):
        calibration_samples(Words(), ["7"], 4, 100)


def test_a_users_text_is_the_only_source_and_an_empty_one_is_refused(tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("my own words")
    assert calibration_texts(mine) == ["my own words"]
    mine.write_text("  \n")
    with pytest.raises(TokenmillError, match="is empty"):
        calibration_texts(mine)


@pytest.mark.subprocess  # (each rendering a fresh interpreter)
def test_default_sources_are_the_bundled_prose_and_stdlib_docs_holding_no_live_values(monkeypatch):
    """The bundled prose and the standard library's docs, the same text on every call: no
    environment, no addresses, nothing this process imported or patched (transformers adds
    methods to logging.Logger; the quantisation of a model must not depend on what else ran
    before it, nor leak the environment). (One test: each rendering is a fresh interpreter,
    seconds.)"""
    first = stdlib_docs()
    keep = [object() for _ in range(1000)]  # move the allocator along
    monkeypatch.setenv("TOKENMILL_CALIBRATION_PROBE", "secret-value")
    monkeypatch.setattr(logging.Logger, "probe_once", lambda self: None, raising=False)
    monkeypatch.setattr(inspect, "getfile", lambda obj: "patched", raising=True)
    logging.getLogger("tokenmill.calibration-probe").addHandler(logging.NullHandler())
    texts = calibration_texts(None)
    assert texts[0] == bundled_text() and "Declaration of Independence" in texts[0]
    assert len(texts) == 2 and len(texts[1]) >= MIN_DOCS_CHARS and "class OrderedDict" in texts[1]
    assert texts[1] == first and keep
    assert "secret-value" not in first and " at 0x" not in first and "\nDATA\n" not in first
    assert "probe_once" not in first and "getfile(object)" in first


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_act_order_keeps_the_groups_and_beats_rtn_on_its_inputs(symmetric):
    """Act order takes columns in another order but stores the usual contiguous groups, each
    with the scale (and zero point) RTN gives the original weights; GPTQ in either order
    reconstructs ``X W^T`` better than RTN on correlated inputs of unequal loudness (as a
    layer's are: on independent inputs there is no other column to absorb an error)."""
    torch.manual_seed(0)
    k, n, g = 128, 48, 32
    x = torch.randn(2048, 16) @ torch.randn(16, k) + 0.1 * torch.randn(2048, k)
    x = x * torch.linspace(0.2, 3.0, k)[torch.randperm(k)]
    w = torch.randn(n, k)
    h = Hessian(k)
    h.add(x)
    spec = QuantSpec(4, g, symmetric)
    base = rtn(w, spec, torch.float32)
    ordered = gptq(w, h.h, spec, torch.float32, act_order=True)
    plain = gptq(w, h.h, spec, torch.float32, act_order=False)
    assert torch.equal(ordered.scale, base.scale)
    if not symmetric:
        assert torch.equal(ordered.zero, base.zero)
    assert ordered.q.shape == (n, k) and int(ordered.q.min()) >= spec.qmin and int(ordered.q.max()) <= spec.qmax
    e_rtn, e_ordered, e_plain = relative_errors(x, w, [base.dequantize(), ordered.dequantize(), plain.dequantize()])
    assert e_ordered < 0.5 * e_rtn and e_plain < 0.5 * e_rtn


def _column_major_sweep(w, u, block, spec, params):
    """GPTQ's sweep as first written: the block in the weight's own [N, K] layout, a column a
    step (strided), the lazy once-a-block update on the same matrices."""
    n, k = w.shape
    q = torch.empty(n, k)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1 = w[:, b0:b1].clone()
        err = torch.zeros_like(w1)
        u1 = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            s, z = params(b0 + i, w1[:, i:])
            col = w1[:, i]
            qi = (torch.round(col / s) + z).clamp_(spec.qmin, spec.qmax)
            q[:, b0 + i] = qi
            e = (col - (qi - z) * s) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return q


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_on_the_blocks_transpose_gives_the_column_major_sweeps_bits(monkeypatch, act_order, symmetric):
    """The sweep works on each block's transpose (contiguous rows, 1.3x the command's speed):
    the same integers, scales and zero points as the column-major sweep, bit for bit, with
    blocks cut anywhere (K not a multiple of the block)."""
    from tokenmill.quantize.calibrate import gptq as gptq_module

    g = torch.Generator().manual_seed(4)
    n, k = 40, 320
    x = torch.randn(512, k, generator=g) * torch.rand(k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    h = Hessian(k)
    h.add(x)
    spec = QuantSpec(4, 32, symmetric)
    ours = gptq(w, h.h, spec, torch.bfloat16, act_order=act_order)
    monkeypatch.setattr(gptq_module, "_sweep", _column_major_sweep)
    first = gptq(w, h.h, spec, torch.bfloat16, act_order=act_order)
    assert torch.equal(ours.q, first.q) and torch.equal(ours.scale, first.scale)
    assert (ours.zero is None) == symmetric and (symmetric or torch.equal(ours.zero, first.zero))
