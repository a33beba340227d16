"""GGUF weights kept in their file's own blocks, multiplied with llama.cpp's integer arithmetic.

``PackedWeight`` (packed.py) widens every GGUF type at load into float-scaled groups and
multiplies in float ("float" arithmetic: the dequantised weights' numbers). A ``BlockWeight``
keeps a tensor's bytes as the file has them, [rows, bytes per row] uint8: Q4_K is read at 0.5625
bytes a weight instead of 0.75, Q6_K at 0.82 instead of 1.25, Q4_1 at 0.625 instead of 0.75. A
step's activations are quantised once per call to 8-bit blocks (``quantise_activations``) and
the dot products are integer (``csrc/ggml_ops.cpp``), as llama.cpp computes them: "int8"
arithmetic (``--quant-arithmetic``). Its outputs differ from the float path's by the activations'
rounding, as llama.cpp's do; ``int8_reference`` computes them in pure torch, the reference the
kernel is tested against.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from tokenmill.quant.packed import QK_K, PackedWeight, decompose

# GGML type codes, and each type's (weights, bytes) per block.
BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
GROUPED = 256  # csrc/ggml_common.h's X8: the type code's flag for rows interleaved eight by eight
_FORMATS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def block_format(type_name: str) -> tuple[int, int]:
    """(weights, bytes) per block of a GGML type served in its own blocks."""
    return _FORMATS[type_name]


INT8_MAX_ROWS = 32  # csrc/ggml_common.h: activation rows per pass of the integer kernel over a weight


class BlockWeight(PackedWeight):
    """One weight [out_features, in_features] as its GGUF blocks (buffer ``qs``; ``scale`` is
    empty). ``bits`` is minus the GGML type code, the form decode_layers reads it in."""

    def __init__(self, blocks: torch.Tensor, type_name: str, in_features: int, mapped: bool = False) -> None:
        elems, size = _FORMATS[type_name]
        assert blocks.dtype == torch.uint8 and blocks.shape[1] == in_features // elems * size, (blocks.shape, type_name)
        super().__init__(blocks, torch.empty(0), None, -BLOCK_TYPES[type_name], elems, in_features, type_name)
        self.mapped = mapped  # a view of the memory-mapped file (QuantLinear keeps it a part of its own)
        self.grouped = False  # rows interleaved eight by eight for the native group kernels (for_native)
        # bfloat16 batches of this many rows or more dequantise into a GEMM (0: never), where the
        # machine measured that faster than the integer dots (kernels/gemm_choice.block_gemm_rows)
        self.gemm_rows = 0

    @classmethod
    def from_gguf(cls, type_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockWeight:
        """The tensor's rows as they are: a view of the memory-mapped file (read-only; never
        written), so that loading reads nothing until a step does."""
        n, k = shape
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(n, -1))
        return cls(blocks, type_name, k, mapped=isinstance(data, np.ndarray) and not data.flags.writeable)

    @property
    def type_code(self) -> int:
        return -self.bits

    @classmethod
    def for_native(cls, run: list[PackedWeight]) -> list[PackedWeight]:
        """Neighbouring parts of one type (gate and up; q, k and v) as the native kernels take
        them: their rows interleaved eight by eight into one weight, one copy of the mapped
        file's bytes (the same bytes), where this build has group kernels for the type: one
        register then holds eight rows' weights and their scales unpack once for all eight
        (csrc/ggml_groups.cpp). A single part is regrouped in place (a tied head and its
        embedding share it). A type with no group kernels (Q6_K) has its parts joined row after
        row, one copy too: one kernel call and one C++ layer loop (decode_layers takes a linear of
        at most two parts) where three calls and a concatenation ran the Python loop. A single
        part of such a type stays as it is (mapped), and so does a weight grouped already
        (use_native called again)."""
        first = run[0]
        assert all(isinstance(p, BlockWeight) and p.source == first.source and p.grouped == first.grouped for p in run)
        base = BLOCK_TYPES[first.source]
        n = sum(p.out_features for p in run)
        if first.grouped or n < 8:
            return run
        if not torch.ops.tokenmill.block_has_groups(base):
            return run if len(run) == 1 else [cls.cat(run)]
        blocks = torch.ops.tokenmill.block_interleave([p.qs for p in run], base)
        target = first if len(run) == 1 else BlockWeight(blocks, first.source, first.in_features)
        target.qs, target.out_features = blocks, n
        target.grouped, target.mapped, target.bits = True, False, -(base | GROUPED)
        return [target]

    def plain_blocks(self) -> torch.Tensor:
        """The rows as the file has them, one after another (undoing ``for_native``'s grouping)."""
        if not self.grouped:
            return self.qs
        return torch.ops.tokenmill.block_deinterleave(self.qs, BLOCK_TYPES[self.source])

    def rows(self, index: torch.Tensor) -> BlockWeight:
        return BlockWeight(self.plain_blocks()[index].contiguous(), self.source, self.in_features)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> BlockWeight:
        first = parts[0]
        assert all(isinstance(p, BlockWeight) and p.source == first.source for p in parts)
        return BlockWeight(torch.cat([p.plain_blocks() for p in parts]), first.source, first.in_features)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or rows ``ids``): the file's numbers (packed.decompose)."""
        qs = self.plain_blocks() if ids is None else self.plain_blocks()[ids]
        exact = decompose(self.source, qs.cpu().numpy(), (qs.shape[0], self.in_features))
        return PackedWeight.from_decomposed(exact, self.source).dequantize().to(self.qs.device)

    def dequantize_rows(self, ids: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
        if self.qs.device.type == "cpu" and hasattr(torch.ops.tokenmill, "block_dequantize"):
            return torch.ops.tokenmill.block_dequantize(self.qs, self.type_code, self.in_features, ids, bf16)
        w = self.dequantize(ids)
        return w.bfloat16() if bf16 else w

    def matmul(
        self,
        x: torch.Tensor,
        native: bool,
        bf16_gemm: bool = False,
        long_rows: tuple[tuple[int, int], ...] | None = None,
    ) -> torch.Tensor:
        """x [rows, in] @ W^T in x's dtype: the integer kernel (native), else int8_reference.
        ``long_rows``: the row ranges (long prompt chunks) that may take the dequantised GEMM,
        each where it has ``gemm_rows`` rows or more; every other row takes the integer dots,
        whatever its neighbours (None: the whole call is one range)."""
        if not (native and x.dtype in (torch.float32, torch.bfloat16)):
            return int8_reference(x, self).to(x.dtype)
        if long_rows is None or not self.gemm_rows or x.dtype != torch.bfloat16:
            return torch.ops.tokenmill.block_linear(x, self.qs, self.type_code, self.gemm_rows)
        spans = [(a, b) for a, b in long_rows if b - a >= self.gemm_rows]
        if not spans:
            return torch.ops.tokenmill.block_linear(x, self.qs, self.type_code, 0)
        if spans == [(0, x.shape[0])]:
            return torch.ops.tokenmill.block_linear(x, self.qs, self.type_code, 1)
        # the long rows in one GEMM (one dequantisation of the weight), the rest in one integer call
        long = torch.zeros(x.shape[0], dtype=torch.bool)
        for a, b in spans:
            long[a:b] = True
        rows_long, rows_short = long.nonzero().flatten(), (~long).nonzero().flatten()
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        y.index_copy_(0, rows_long, torch.ops.tokenmill.block_linear(x[rows_long], self.qs, self.type_code, 1))
        y.index_copy_(0, rows_short, torch.ops.tokenmill.block_linear(x[rows_short], self.qs, self.type_code, 0))
        return y

    def extra_repr(self) -> str:
        return f"{self.source} blocks: {self.out_features}x{self.in_features}"


def quantise_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] float -> (q [rows, k / block, block] int8 values as float32, d [rows, k / block]):
    per block, d = max |x| / 127 and q = x / d rounded half to even (csrc/ggml_ops.cpp's rule)."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).clamp(-127, 127), d


def int8_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """What the integer kernel computes, in pure torch: the dequantised weight times the
    activations quantised to 8-bit blocks, summed in float64 (the kernel sums the integer
    products exactly; a bfloat16 call of ``gemm_rows`` rows or more multiplies the same
    rounded activations in a bfloat16 GEMM)."""
    w = weight.dequantize().to(x.device)
    q, d = quantise_activations(x, weight.group)
    xq = (q.double() * d.double()[..., None]).reshape(x.shape[0], -1)
    return (xq @ w.double().T).float()
