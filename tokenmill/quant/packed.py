"""Quantised weights served as they are stored: GGUF blocks repacked once for the kernels.

A GGUF file's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 tensors all decompose exactly
into one of two forms (``decompose``): 4-bit values 0..15 in groups of 32, or signed 8-bit
values in groups of 16 or 32, each group with a float32 scale and, for the asymmetric types,
a float32 min (``w = scale * q + min``). GGUF's float16 scales and the K-quants' 6- and 8-bit
sub-scales multiply into float32 without rounding, so the decomposition holds the very numbers
``gguf.dequantize`` produces (Q4_0's ``d * (q - 8)`` becomes ``d * q - 8 d``, equal up to one
float32 rounding). ``PackedWeight`` holds the form laid out for ``csrc/quant_ops.cpp``:

- 4-bit: each row in chunks of 64 values (32 bytes, eight little-endian 32-bit words); word
  ``l`` holds value ``8 i + l`` of the chunk in bits ``4 i .. 4 i + 3``. Unpacking is a shift
  and a mask per 8 consecutive values, no shuffles (AVX2 and AVX-512 alike).
- 8-bit: the values row-major as int8.

Bytes per weight: Q4_x 0.75 (0.5 + 8 bytes of float32 scale and min per 32), Q8_0 1.125.

``QuantLinear`` runs a layer from these: the native ``quant_linear`` op for any number of rows
(GEMV tiles for a few, weight rows unpacked into L1 for decode batches, the weight dequantised
for the call into PyTorch's GEMM for long prefills), and ``dequantize`` (pure torch) as the
reference every kernel is tested against. ``QuantEmbedding`` looks tokens up in the same
blocks (and a tied LM head reads them too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

# GGML types served from their blocks (the others are dequantised at load).
NATIVE_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
QK_K = 256
# bfloat16 batches up to this many rows multiply float32 weights; past it, on CPUs with native
# bfloat16 dot products, the weight rounded to bfloat16 (csrc/quant_ops.cpp's EXACT_BF16_ROWS;
# which kernel runs for how many rows is the build's choice, measured there).
EXACT_BF16_ROWS = 8


@dataclass
class Decomposed:
    """A weight as ``scale * q + min`` per group of ``group`` input values."""

    q: np.ndarray  # [n, k] uint8 0..15 (bits 4) or int8 (bits 8)
    scale: np.ndarray  # [n, k / group] float32
    minv: np.ndarray | None  # [n, k / group] float32, or None
    bits: int
    group: int


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles_lo_hi(qs: np.ndarray, half: int) -> np.ndarray:
    """[..., half] bytes -> [..., 2 * half] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decompose(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> Decomposed:
    """A GGUF tensor's raw rows ([n, bytes per row] uint8) -> its exact (q, scale, min) form."""
    n, k = shape
    if type_name == "Q8_0":
        b = data.reshape(n, k // 32, 34)
        return Decomposed(b[..., 2:].view(np.int8).reshape(n, k), _f16(b[..., :2]).reshape(n, -1), None, 8, 32)
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        b = data.reshape(n, k // 32, head + 16)
        d = _f16(b[..., :2]).reshape(n, -1)
        q = _nibbles_lo_hi(b[..., head:], 16).reshape(n, k)
        m = -8 * d if type_name == "Q4_0" else _f16(b[..., 2:4]).reshape(n, -1)
        return Decomposed(q, d, m, 4, 32)
    if type_name in ("Q5_0", "Q5_1"):
        head = 2 if type_name == "Q5_0" else 4
        b = data.reshape(n, k // 32, head + 20)
        d = _f16(b[..., :2]).reshape(n, -1)
        qh = np.ascontiguousarray(b[..., head : head + 4]).view(np.uint32)  # [n, g, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles_lo_hi(b[..., head + 4 :], 16) | (high << 4)
        if type_name == "Q5_0":
            return Decomposed((q.astype(np.int16) - 16).astype(np.int8).reshape(n, k), d, None, 8, 32)
        return Decomposed(q.astype(np.int8).reshape(n, k), d, _f16(b[..., 2:4]).reshape(n, -1), 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        size = 144 if type_name == "Q4_K" else 176
        b = data.reshape(n * (k // QK_K), size)
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        scale = d * sc.astype(np.float32)  # [blocks, 8]: exact (float16 x 6-bit integer)
        minv = -(dmin * mn.astype(np.float32))
        if type_name == "Q4_K":
            qs = b[:, 16:].reshape(-1, 4, 32)  # 4 x 32 bytes: 64 values each, low nibbles first
            q = _nibbles_lo_hi(qs, 32).reshape(n, k)
            return Decomposed(q, scale.reshape(n, -1), minv.reshape(n, -1), 4, 32)
        qh = b[:, 16:48]
        ql = _nibbles_lo_hi(b[:, 48:].reshape(-1, 4, 32), 32).reshape(-1, 8, 32)
        high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).astype(np.uint8)
        q = (ql | (high << 4)).astype(np.int8)
        return Decomposed(q.reshape(n, k), scale.reshape(n, -1), minv.reshape(n, -1), 8, 32)
    if type_name == "Q6_K":
        b = data.reshape(n * (k // QK_K), 210)
        ql, qh = b[:, :128], b[:, 128:192]
        scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        low = _nibbles_lo_hi(ql.reshape(-1, 2, 64), 64).reshape(-1, 8, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low | (high.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
        return Decomposed(q.astype(np.int8).reshape(n, k), (d * scales).reshape(n, -1), None, 8, 16)
    raise ValueError(f"no native form for GGUF type {type_name}")


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, k] values 0..15 -> [n, ceil(k / 64) * 32] bytes in the 4-bit chunk layout."""
    n, k = q.shape
    chunks = -(-k // 64)
    padded = np.zeros((n, chunks * 64), dtype=np.uint32)
    padded[:, :k] = q
    v = padded.reshape(n, chunks, 8, 8)  # [n, chunk, i, l]: value 8 i + l
    words = np.zeros((n, chunks, 8), dtype=np.uint32)
    for i in range(8):
        words |= v[:, :, i, :] << np.uint32(4 * i)
    return words.astype("<u4").view(np.uint8).reshape(n, chunks * 32)


def unpack_nibbles(qs: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_nibbles, in torch: [n, bytes] -> [n, k] int32 values 0..15."""
    n = qs.shape[0]
    words = qs.contiguous().view(torch.int32).reshape(n, -1, 1, 8)  # [n, chunk, 1, l]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qs.device).reshape(1, 1, 8, 1)
    return ((words >> shifts) & 0xF).reshape(n, -1)[:, :k]


class PackedWeight(nn.Module):
    """One weight [out_features, in_features] in the kernels' layout (buffers: qs, scale, minv)."""

    def __init__(
        self,
        qs: torch.Tensor,
        scale: torch.Tensor,
        minv: torch.Tensor | None,
        bits: int,
        group: int,
        in_features: int,
        source: str,
    ) -> None:
        super().__init__()
        self.register_buffer("qs", qs)
        self.register_buffer("scale", scale)
        self.register_buffer("minv", minv)
        self.bits, self.group, self.in_features, self.source = bits, group, in_features, source
        self.out_features = qs.shape[0]

    @classmethod
    def from_decomposed(cls, d: Decomposed, source: str) -> PackedWeight:
        qs = pack_nibbles(d.q) if d.bits == 4 else np.ascontiguousarray(d.q, dtype=np.int8)
        minv = None if d.minv is None else torch.from_numpy(np.ascontiguousarray(d.minv, dtype=np.float32))
        scale = torch.from_numpy(np.ascontiguousarray(d.scale, dtype=np.float32))
        return cls(torch.from_numpy(qs), scale, minv, d.bits, d.group, d.q.shape[1], source)

    @classmethod
    def from_gguf(cls, type_name: str, data: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
        return cls.from_decomposed(decompose(type_name, data, shape), type_name)

    @property
    def layout(self) -> tuple[int, int, bool]:
        return self.bits, self.group, self.minv is not None

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """These rows, in this order (llama.cpp's Q/K row permutation undone)."""
        minv = None if self.minv is None else self.minv[index].contiguous()
        return PackedWeight(
            self.qs[index].contiguous(),
            self.scale[index].contiguous(),
            minv,
            self.bits,
            self.group,
            self.in_features,
            self.source,
        )

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.minv) if t is not None)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Stack the rows of weights of one layout (q, k, v -> qkv)."""
        first = parts[0]
        assert all(p.layout == first.layout and p.in_features == first.in_features for p in parts)
        minv = None if first.minv is None else torch.cat([p.minv for p in parts])
        source = "+".join(dict.fromkeys(p.source for p in parts))
        return PackedWeight(
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scale for p in parts]),
            minv,
            first.bits,
            first.group,
            first.in_features,
            source,
        )

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or rows ``ids`` of it), in pure torch: the reference."""
        qs, scale, minv = self.qs, self.scale, self.minv
        if ids is not None:
            qs, scale = qs[ids], scale[ids]
            minv = None if minv is None else minv[ids]
        q = unpack_nibbles(qs, self.in_features) if self.bits == 4 else qs.to(torch.int32)
        n = q.shape[0]
        w = q.float().reshape(n, -1, self.group) * scale[..., None]
        if minv is not None:
            w = w + minv[..., None]
        return w.reshape(n, self.in_features)

    @classmethod
    def for_native(cls, run: list[PackedWeight]) -> list[PackedWeight]:
        """Neighbouring parts of one layout as the native kernels take them (this layout is
        theirs already; BlockWeight regroups its rows)."""
        return run

    def dequantize_rows(self, ids: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
        """Rows ``ids`` (all when None) as float32, or rounded to bfloat16: the native kernel on
        the CPU, the reference elsewhere."""
        if self.qs.device.type == "cpu" and hasattr(torch.ops.tokenmill, "quant_dequantize"):
            return torch.ops.tokenmill.quant_dequantize(
                self.qs, self.scale, self.minv, self.bits, self.group, self.in_features, ids, bf16
            )
        w = self.dequantize(ids)
        return w.bfloat16() if bf16 else w

    def matmul(
        self,
        x: torch.Tensor,
        native: bool,
        bf16_gemm: bool = False,
        long_rows: tuple[tuple[int, int], ...] | None = None,
    ) -> torch.Tensor:
        """x [rows, in] @ W^T -> [rows, out] in x's dtype; ``native`` False: the reference.
        ``bf16_gemm``: bfloat16 batches past EXACT_BF16_ROWS multiply the weight rounded to
        bfloat16 (what the dequantised bfloat16 model multiplies) on the CPU's bfloat16 units.
        ``long_rows`` is for GGUF blocks (BlockWeight): these weights' models run float
        activations, which are not held batch-invariant (model/ops.py), so the call's rows decide."""
        if not native or x.dtype not in (torch.float32, torch.bfloat16):
            return nn.functional.linear(x.float(), self.dequantize()).to(x.dtype)
        return torch.ops.tokenmill.quant_linear(x, self.qs, self.scale, self.minv, self.bits, self.group, bf16_gemm)

    def extra_repr(self) -> str:
        return f"{self.source}: {self.out_features}x{self.in_features}, {self.bits}-bit, group {self.group}"


class QuantLinear(nn.Module):
    """A linear layer over packed weights. A fused projection (qkv, gate_up) whose parts
    differ in type (Q4_K_M files keep some attn_v / ffn_down in Q6_K) holds one part per
    layout and concatenates their outputs."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        merged: list[PackedWeight] = []
        for p in parts:  # neighbours of one layout become one weight (one kernel call), but a view of
            # the mapped file stays a part of its own: copying it into one weight would read the whole
            # file at load (0.75 s of a 1B model's) and hold its bytes twice
            if (
                merged
                and merged[-1].layout == p.layout
                and not (getattr(p, "mapped", False) or getattr(merged[-1], "mapped", False))
            ):
                merged[-1] = type(p).cat([merged[-1], p])
            else:
                merged.append(p)
        self.parts = nn.ModuleList(merged)
        self.register_buffer("bias", bias)
        self.in_features = merged[0].in_features
        self.out_features = sum(p.out_features for p in merged)
        self.native = False  # use_native(): the native kernels, else the torch reference
        self.bf16_gemm = False  # bfloat16 batches past EXACT_BF16_ROWS: a bfloat16 weight

    def use_native(self, bf16_gemm: bool, block_gemm_rows: Mapping[str, int | None] | None = None) -> None:
        """Run on the native kernels; ``bf16_gemm``: the CPU multiplies bfloat16 natively
        (kernels/cpu.py says, from above this package); ``block_gemm_rows``: per GGUF block type,
        from how many rows a bfloat16 batch dequantises into a GEMM (None or absent: never)."""
        self.native = True
        self.bf16_gemm = bf16_gemm
        runs: list[list[PackedWeight]] = []  # neighbours of one layout
        for p in self.parts:
            if runs and type(runs[-1][0]) is type(p) and runs[-1][0].layout == p.layout:
                runs[-1].append(p)
            else:
                runs.append([p])
        self.parts = nn.ModuleList(q for run in runs for q in type(run[0]).for_native(run))
        for p in self.parts:
            if hasattr(p, "gemm_rows"):  # a BlockWeight
                p.gemm_rows = (block_gemm_rows or {}).get(p.source) or 0

    def forward(self, x: torch.Tensor, long_rows: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
        """``long_rows``: the row ranges [start, end) of long prompt chunks, the only rows a GGUF
        block weight may multiply in its dequantised GEMM (model/ops.py's ``long_rows``: where
        the arithmetic must not depend on a row's neighbours); None: each call's rows decide."""
        flat = x.reshape(-1, self.in_features)
        outs = [p.matmul(flat, self.native, self.bf16_gemm, long_rows) for p in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """Token lookups in a packed table (the rows asked for, dequantised); ``weight`` is the
    table itself, so a tied LM head can share it."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.weight.dequantize_rows(flat).to(self.dtype).reshape(*ids.shape, self.embedding_dim)
