"""KV-cache quantisation: one scale per token and head.

K and V are written as they are computed, one token at a time, so each token's
vector (per KV head) gets its own symmetric scale: ``x ~ q * s`` with
``s = max|x| / qmax``. Nothing is calibrated ahead and no block-wide scale has to be
revised when a later token is larger. The scales are stored in bfloat16 (2 bytes per
64-value head vector, 3% on top of the int8 values).

- ``int8``: q in [-127, 127].
- ``fp8``: float8 e4m3 (max 448): the scale maps each vector's largest value to 448,
  and the 3-bit mantissa keeps relative precision for small values.
"""

from __future__ import annotations

import torch

from tokenmill.configuration.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "QUANTIZED_KV", "SCALE_DTYPE", "dequantize", "quantize"]
QUANTIZED_KV = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.bfloat16


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (values [..., head_dim], scales [...])."""
    storage, qmax = QUANTIZED_KV[kind]
    # nudged up before rounding to bfloat16 so that the stored scale never maps max|x| past qmax
    scale = (x.float().abs().amax(dim=-1) * ((1 + 2**-7) / qmax)).clamp(min=1e-8).to(SCALE_DTYPE)
    scaled = x.float() / scale.float()[..., None]
    if kind == "int8":
        return scaled.round().clamp(-qmax, qmax).to(storage), scale
    return scaled.clamp(-qmax, qmax).to(storage), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
