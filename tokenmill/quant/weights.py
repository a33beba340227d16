"""Weight-only quantisation of linear layers, applied once at load (a module swap).

- **int8**: one float scale per output channel, symmetric (w ~ q * s, q in
  [-127, 127]); the matmul is PyTorch's ``_weight_int8pack_mm``, which reads int8
  weights and scales them inside the kernel, never materialising a float weight.
- **int4**: asymmetric per group of ``group_size`` input channels (w ~ (q - 8) * s + z,
  q in [0, 15]), packed two per byte for ``_weight_int4pack_mm_for_cpu`` (the tinygemm
  layout on CUDA); again dequantised tile by tile inside the kernel.

On the CPU both kernels take bfloat16 activations: their float32 paths are 5-20x
slower on this AVX2 machine than their bfloat16 ones (int8: 18.9 vs 3.6 ms, int4: 30
vs 1.5 ms, for 8 layers' weights at one row; float32 nn.Linear: 13.3 ms), so a layer
rounds its input to bfloat16 (accumulation stays float32 inside the kernel) and
returns the model's dtype. Where a fused kernel is missing for a device the layer
falls back to dequantising its weight for the call (correct, not fast).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.quant.packed import PackedWeight

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")  # auto: keep what the checkpoint stores (quant/packed.py)

logger = logging.getLogger(__name__)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] int8, [N] scales)."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] int32 in [0, 15], [K / group, N, 2] (scale, zero))."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scales = (hi - lo).clamp(min=1e-8) / 15
    zeros = lo + 8 * scales  # so that w = (q - 8) * s + z
    q = ((g - lo) / scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.cat([scales, zeros], dim=2).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    sz = scales_and_zeros.transpose(0, 1)  # [N, K/G, 2]
    g = q.reshape(n, k // group_size, group_size).float()
    return ((g - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


class Int8Linear(nn.Module):
    """Built from quantised parts (``quantize`` makes them from a float weight; a
    tensor-parallel shard cuts them from the whole weight's)."""

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q)
        self.register_buffer("bias", bias)  # kept in the model's dtype, added after the matmul
        self.act_dtype = torch.bfloat16 if q.device.type == "cpu" else dtype
        self.register_buffer("scales", scales.to(self.act_dtype))
        self.native_rows = 0  # set by enable_small_batch_kernel: batches this small use the native kernel
        self.scales_f32: torch.Tensor | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Int8Linear:
        return cls(*quantize_int8(weight), dtype, bias)

    def enable_small_batch_kernel(self, rows: int) -> None:
        """Batches of up to ``rows`` go to tokenmill's native small_linear (float32 scales)."""
        self.native_rows = rows
        self.scales_f32 = self.scales.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.native_rows:
            out = torch.ops.tokenmill.small_linear(flat.to(self.act_dtype), self.weight, self.scales_f32).to(x.dtype)
        elif flat.device.type == "cpu":
            out = torch._weight_int8pack_mm(flat.to(self.act_dtype), self.weight, self.scales).to(x.dtype)
        else:
            out = nn.functional.linear(flat, self.weight.to(flat.dtype)) * self.scales
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


INT4_GROUP_SIZES = (32, 64, 128, 256)


class Int4Linear(nn.Module):
    """Built from quantised parts: q [N, K] in [0, 15] and (scale, zero) [K / group, N, 2]."""

    def __init__(
        self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.register_buffer("bias", bias)
        if q.device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        self.register_buffer("weight", packed)
        self.act_dtype = torch.bfloat16  # the packed kernels' fast path, on the CPU and on CUDA
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(self.act_dtype))

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> Int4Linear:
        if weight.shape[1] % group_size:
            raise ValueError(f"int4 group size {group_size} does not divide {weight.shape[1]} input features")
        if group_size not in INT4_GROUP_SIZES:  # what torch's packed int4 kernels take
            raise ValueError(
                f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}"
            )
        return cls(*quantize_int4(weight, group_size), group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.act_dtype)
        if flat.device.type == "cpu":
            out = torch._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size, self.scales_and_zeros)
        else:
            out = torch._weight_int4pack_mm(flat, self.weight, self.group_size, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def packed_weight(
    q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, group: int, source: str
) -> PackedWeight | None:
    """int8/int4 parts (per-row or per-group scales) as a PackedWeight for the native kernels:
    scales repeated to the kernels' groups of 32 (exact), q repacked; None where the width
    or the group is not a whole number of 32s."""
    from tokenmill.quant.packed import Decomposed, PackedWeight

    n, k = q.shape
    if k % 32 or group % 32:
        return None
    reps = group // 32
    scale = scale.float().repeat_interleave(reps, dim=1)
    minv = None if minv is None else minv.float().repeat_interleave(reps, dim=1)
    dtype = torch.uint8 if bits == 4 else torch.int8
    parts = Decomposed(q.to(dtype).numpy(), scale.numpy(), None if minv is None else minv.numpy(), bits, 32)
    return PackedWeight.from_decomposed(parts, source)


def packed_linear(
    q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, group: int, bias: torch.Tensor | None
) -> nn.Module | None:
    """``packed_weight``'s weight as a QuantLinear; None where it has none."""
    from tokenmill.quant.packed import QuantLinear

    weight = packed_weight(q, scale, minv, bits, group, f"int{bits}")
    return None if weight is None else QuantLinear([weight], bias)


def quantize_model(model: nn.Module, mode: str, group_size: int = 32, packed: bool = False) -> nn.Module:
    """Swap every linear layer of the decoder (and the LM head, also when it is tied to
    the embeddings, which stay in float for lookups) for its quantised version. ``packed``
    (the native CPU kernels run the model): int8 and int4 go to the same kernels as a
    GGUF's blocks (quant/packed.py), with float32 activations and scales; otherwise
    Int8Linear / Int4Linear (PyTorch's packed kernels, on any device)."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    if mode in ("auto", "none"):
        return model
    dtype = next(model.parameters()).dtype

    def make(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        int4 = mode == "int4" and weight.shape[1] % group_size == 0  # else int8
        if packed and int4:
            q, sz = quantize_int4(weight, group_size)
            s, z = sz[..., 0].T, sz[..., 1].T  # [n, k / group]: w = (q - 8) s + z = q s + (z - 8 s)
            layer = packed_linear(q, s, z - 8 * s, 4, group_size, bias)
        elif packed:
            q, s = quantize_int8(weight)
            layer = packed_linear(q, s[:, None], None, 8, weight.shape[1], bias)
        else:
            layer = None
        if layer is not None:
            return layer
        if int4:
            return Int4Linear.quantize(weight, group_size, bias)
        return Int8Linear.quantize(weight, dtype, bias)

    widths = set()
    for layer in model.layers:
        for parent, name in linear_layers(layer):
            linear = getattr(parent, name)
            widths.add(linear.weight.shape[1])
            setattr(parent, name, make(linear.weight.data, None if linear.bias is None else linear.bias.data))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    widths.add(head.shape[1])
    model.lm_head = make(head.data)
    odd = sorted(k for k in widths if k % group_size)
    if mode == "int4" and odd:
        logger.warning(
            "quantization int4: group size %d does not divide input widths %s: those layers are int8 "
            "(per output channel); a group size that divides them keeps them int4",
            group_size,
            ", ".join(map(str, odd)),
        )
    model.reset_fused_plan()
    return model


def linear_layers(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of a decoder layer's linear layers (a mixture-of-experts MLP's
    stacked experts are not linears: they stay in the model's dtype)."""
    found = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
    if hasattr(layer.mlp, "gate_up_proj"):
        found += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
    return found


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (what a forward reads,
    plus the embedding table, of which a step reads only a few rows)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
