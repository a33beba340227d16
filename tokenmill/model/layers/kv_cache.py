"""One layer's paged K/V cache, plain or quantised.

The cache is addressed by slot (``block * block_size + offset``); attention only
writes new tokens' K/V and gathers whole blocks, so those two operations (and
copy-on-write of a block) are all a layer cache offers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.quant.kv import dequantize, quantize


@dataclass
class KVCacheLayer:
    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor
    dtype: torch.dtype  # what attention computes in
    quant: str | None = None  # None, "int8" or "fp8"
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads] when quantised
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] -> their slots."""
        if self.quant is None:
            self.k.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
            self.v.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(self.v.dtype))
            return
        assert self.k_scale is not None and self.v_scale is not None
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize(x, self.quant)
            _bytes(data).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, _bytes(q))
            scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, s)

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, [len(block_ids), block_size, kv_heads, head_dim],
        in the compute dtype."""
        if self.quant is None:
            # index_select on the block axis: ~5x faster on CPU than advanced indexing
            k, v = self.k.index_select(0, block_ids), self.v.index_select(0, block_ids)
            return k.to(self.dtype), v.to(self.dtype)  # no copy when stored in the compute dtype
        assert self.k_scale is not None and self.v_scale is not None
        k = _bytes(self.k).index_select(0, block_ids).view(self.k.dtype)
        v = _bytes(self.v).index_select(0, block_ids).view(self.v.dtype)
        k = dequantize(k, self.k_scale.index_select(0, block_ids), self.dtype)
        v = dequantize(v, self.v_scale.index_select(0, block_ids), self.dtype)
        return k, v

    def copy_block(self, src: int, dst: int) -> None:
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                _bytes(t)[dst] = _bytes(t)[src]


def copy_blocks(layers: list[KVCacheLayer], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: block dst gets block src's K/V in every layer, in list order."""
    for src, dst in copies:
        for layer in layers:
            layer.copy_block(src, dst)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as raw bytes: index_copy_ and index_select have no float8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
