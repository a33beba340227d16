"""Integer weights per group of input channels, as compressed-tensors stores them.

A weight ``W [N, K]`` is cut along K into groups of ``group_size`` columns; each row of
each group gets a scale (and, asymmetric, a zero point), and its values become integers in
``[-2^(b-1), 2^(b-1) - 1]`` (int8 storage, signed: the library's ``pack_to_int32`` adds
``2^(b-1)`` when it packs). The dequantised weight is ``(q - zero) * scale``. Scales follow
llm-compressor's min-max observer (the range always holds 0; symmetric: ``absmax / (range / 2)``,
asymmetric: ``(max - min) / range``), and are rounded to the dtype they will be stored in
*before* the integers are chosen, so the stored scale is the one the rounding used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantSpec:
    """How a weight is quantised: ``bits`` (4 or 8), ``group_size`` input channels per scale
    (the weight's width: one scale per output channel), ``symmetric`` (no zero points)."""

    bits: int
    group_size: int
    symmetric: bool

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


@dataclass
class QuantizedWeight:
    """One linear's integers and their group parameters."""

    q: torch.Tensor  # [N, K] int8, in [qmin, qmax]
    scale: torch.Tensor  # [N, K / G] in the storage dtype
    zero: torch.Tensor | None  # [N, K / G] int8 (asymmetric), None (symmetric)
    spec: QuantSpec

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        g = self.spec.group_size
        q = self.q.float()
        if self.zero is not None:
            q = q - self.zero.float().repeat_interleave(g, dim=1)
        return q * self.scale.float().repeat_interleave(g, dim=1)


def group_params(
    w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, shrink: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of each group of ``w`` ([..., G]: groups along the last axis),
    the range shrunk by ``shrink`` (a clipping search's ratios, [...], or one for all):
    ([...] in ``dtype``, [...] int8 or None)."""
    lo = (w.amin(dim=-1) * shrink).clamp(max=0)
    hi = (w.amax(dim=-1) * shrink).clamp(min=0)
    span = spec.qmax - spec.qmin
    tiny = torch.finfo(dtype).tiny
    if spec.symmetric:
        scale = (torch.maximum(-lo, hi) / (span / 2)).clamp(min=tiny).to(dtype)
        return scale, None
    scale = ((hi - lo) / span).clamp(min=tiny).to(dtype)
    zero = (spec.qmin - torch.round(lo / scale.float())).clamp(spec.qmin, spec.qmax).to(torch.int8)
    return scale, zero


def quantize_group(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """``w`` rounded to the grid of ``scale`` and ``zero`` (broadcast against it): int8."""
    q = torch.round(w / scale.float())
    if zero is not None:
        q = q + zero.float()
    return q.clamp(spec.qmin, spec.qmax).to(torch.int8)


def dequantize_group(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``(q - zero) * scale``, broadcast, in float32."""
    x = q.float()
    if zero is not None:
        x = x - zero.float()
    return x * scale.float()


def rtn(w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, shrink: torch.Tensor | None = None) -> QuantizedWeight:
    """Round to nearest, every group at once (``shrink``: [N, K / G] clipping ratios, or none)."""
    n, k = w.shape
    g = spec.group_size
    assert k % g == 0, f"group size {g} does not divide the weight's {k} input channels"
    groups = w.float().reshape(n, k // g, g)
    scale, zero = group_params(groups, spec, dtype, 1.0 if shrink is None else shrink)
    q = quantize_group(groups, scale[..., None], None if zero is None else zero[..., None], spec)
    return QuantizedWeight(q.reshape(n, k), scale, zero, spec)


def relative_errors(x: torch.Tensor, w: torch.Tensor, candidates: list[torch.Tensor]) -> list[float]:
    """``||X W^T - X Ŵ^T|| / ||X W^T||`` for each candidate Ŵ, on calibration inputs ``x``
    [T, K]: how far the quantised linear's outputs are from the float one's."""
    ref = x @ w.float().T
    norm = ref.norm().clamp(min=1e-12)
    return [float((x @ c.float().T - ref).norm() / norm) for c in candidates]
