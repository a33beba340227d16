"""A quantised weight as integers with a float scale and min per group of inputs: what every
quantised folder's linears decode to (AWQ, GPTQ, compressed-tensors), and the form
``packed_weight`` (quant/weights.py) lays out for the native kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntGroups:
    """A weight as ``q * scale + min`` per group of ``group`` input values (``group`` 1: a
    scale and min per input row, act order). The form ``packed_weight`` (quant/weights.py)
    lays out for the native kernels."""

    q: torch.Tensor  # [N, K]: bits 4: uint8 0..15; bits 8: int8 -128..127
    scale: torch.Tensor  # [N, K / group] float32
    minv: torch.Tensor | None  # [N, K / group] float32: -zero * scale (None: symmetric 8-bit, zero 0)
    group: int
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (exactly (q - zero) * scale)."""
        n, k = self.q.shape
        w = self.q.float().reshape(n, -1, self.group) * self.scale[..., None]
        if self.minv is not None:
            w = w + self.minv[..., None]
        return w.reshape(n, k)


def unpack_last(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., C] -> [..., 32 / bits * C] unsigned values, low bits first: value i of word c
    at position 32 / bits * c + i (GPTQ's zeros, compressed-tensors' weights and zeros)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)
