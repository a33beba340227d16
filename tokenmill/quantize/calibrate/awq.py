"""AWQ (Lin et al., 2023): a few input channels carry large activations, and the weights
that multiply them matter most. Scaling those weights' columns up by ``s`` (and the inputs
down by ``s``, folded into whatever produces them: an RMSNorm's weight, or the rows of the
linear before) leaves the float model unchanged but gives those columns more of the
quantisation grid.

Per group of linears that share one input ``X`` (q/k/v after the input norm, gate/up after
the post-attention norm, down alone, o alone where v's rows can take the scale), the scale
is ``s = mean|X|^alpha`` over the calibration tokens (normalised to a geometric mean of 1),
``alpha`` chosen on a grid of 20 points in [0, 1] by the output error of those linears:
``||X W^T - (X / s) Q(W s)^T||``. Then, optionally, each group's range is clipped by the
ratio (1, 0.95, ..., 0.55) that minimises the same error, and the weight is rounded to
nearest. ``alpha = 0`` (s = 1) is on the grid, so the chosen scale is never worse than RTN
on the tokens it is chosen by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.quantize.calibrate.rtn import (
    QuantSpec,
    dequantize_group,
    group_params,
    quantize_group,
    rtn,
)
from tokenmill.quantize.calibrate.threads import single_thread

GRID = 20  # alphas tried: 0, 1/20, ..., 19/20
CLIP_RATIOS = 10  # range shrinks tried: 1.0, 0.95, ..., 0.55
MAX_TOKENS = 2048  # calibration tokens the scale search scores on (a fixed, spread subset)
CLIP_TOKENS = 512  # and the clipping search (AutoAWQ's n_sample_token)


@dataclass
class ActivationStats:
    """A linear's inputs as AWQ reads them: the mean magnitude per input channel over every
    calibration token, and an evenly spread subset of tokens to score candidates on."""

    abs_sum: torch.Tensor  # [K]
    tokens: int
    sample: list[torch.Tensor]
    _x: torch.Tensor | None = None  # the sample, joined on first use

    @classmethod
    def empty(cls, k: int) -> ActivationStats:
        return cls(torch.zeros(k), 0, [])

    def add(self, x: torch.Tensor, keep_every: int) -> None:  # x: [T, K]
        x = x.reshape(-1, x.shape[-1]).float()
        self.abs_sum += x.abs().sum(0)
        self.tokens += x.shape[0]
        self.sample.append(x[::keep_every].clone())

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

    def x(self) -> torch.Tensor:  # [≤ MAX_TOKENS, K]
        if self._x is None:
            x = torch.cat(self.sample)
            self._x = x[:: max(1, -(-x.shape[0] // MAX_TOKENS))]
        return self._x


def fake_quant(w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest then back to float, all groups at once ([N, K] -> [N, K] float32)."""
    return rtn(w, spec, dtype).dequantize()


def search_scale(
    weights: list[torch.Tensor], x: torch.Tensor, mean_abs: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale ([K] float32) minimising the output error of ``weights``
    (each [N_i, K], sharing input ``x`` [T, K]) after quantisation; and its alpha."""
    w = torch.cat([t.float() for t in weights])
    ref = x @ w.T
    best = (float("inf"), torch.ones_like(mean_abs), 0.0)
    base = mean_abs.clamp(min=1e-4)
    for i in range(GRID):
        alpha = i / GRID
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        out = (x / s) @ fake_quant(w * s, spec, dtype).T
        err = float((out - ref).pow(2).mean())
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def search_clip(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """Per row and group of ``w`` [N, K] (already scaled), the range ratio that minimises that
    group's share of the output error on ``x`` [T, K] (already divided by the scale):
    [N, K / G] float32."""
    g = spec.group_size
    x = x[:: max(1, -(-x.shape[0] // CLIP_TOKENS))]
    with single_thread():
        ratios = [_clip_group(w[:, c : c + g].float(), x[:, c : c + g], spec, dtype) for c in range(0, w.shape[1], g)]
    return torch.stack(ratios, dim=1)


def _clip_group(wg: torch.Tensor, xg: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """One group's best ratio per row ([N]): ``wg`` [N, G], its inputs ``xg`` [T, G]."""
    ref = xg @ wg.T  # [T, N]
    best_err = torch.full((wg.shape[0],), float("inf"))
    best_ratio = torch.ones(wg.shape[0])
    for r in range(CLIP_RATIOS):
        ratio = 1.0 - 0.05 * r
        scale, zero = group_params(wg, spec, dtype, ratio)
        scale, zero = scale[:, None], None if zero is None else zero[:, None]
        err = (xg @ dequantize_group(quantize_group(wg, scale, zero, spec), scale, zero).T - ref).pow(2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio[better] = ratio
    return best_ratio
