"""Linear layers at decode time: a few rows against the whole weight matrix.

At batch 1 a linear layer is a pass over its weights, so it should run at memory
bandwidth; PyTorch's CPU matmul reaches about half of it for bfloat16 weights (8-10
GB/s where a read streams at 16-20, bench/RESULTS.md). ``small_linear`` (the native
kernel: 4x4 register tiles, weights prefetched a tile ahead) takes over up to a few
rows, where it was measured faster; bigger float32 batches and prefill go to ``tile_gemm``
(our own 6x16 GEMM tiles, see TILE_ROWS), bfloat16 ones to PyTorch's (oneDNN's) GEMM: on a
weight packed once in oneDNN's layout where this machine measured that faster and memory
allows a second copy, in float32 for big batches where it measured that faster
(kernels/gemm_choice.py).
The swap happens once at load, on the CPU, when the native kernels are in use.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from tokenmill.configuration.memory import available_memory
from tokenmill.kernels.cpu import cpu_info
from tokenmill.quant.packed import QuantLinear
from tokenmill.quant.weights import Int8Linear, linear_layers

# Up to these many rows the native kernel beat torch in bench/hot_path.py's sweep
# (30 layers of SmolLM2 shapes, weights streamed from memory): float32/bfloat16 to
# 8 rows, int8 to 4.
FLOAT_ROWS, INT8_ROWS = 8, 4
# A 16-bit weight multiplied in float32 is upcast a slab of this many bytes (as float32) at a time
# (8 MiB: measured best, 512 KiB-32 MiB, on a 1B F16 prefill; from 32 MiB glibc maps each afresh):
# upcasting the whole matrix each call allocated and faulted in 4 fresh bytes a weight per call
# (a 1B F16 file's prefill under float32: ~30 tok/s, half llama.cpp's).
SLAB_BYTES = 1 << 23
# float32 activations go to the own GEMM tiles (csrc/gemm.cpp) past FLOAT_ROWS: always for 16-bit
# weights (converted as they are packed, no float32 copy; 1B F16 prefill 0.74x -> 0.87x llama.cpp),
# up to this many rows for float32 weights, where it beat PyTorch's (MKL's) GEMM on an AVX2 EPYC
# (SmolLM2 and Llama-1B shapes, 2 threads: 1.3-2.0x at 9-64 rows, 1.02-1.17x at 256; at 512-1024
# rows 0.91-1.06x).
TILE_ROWS = 256
log = logging.getLogger("tokenmill")
# A packed copy doubles a bfloat16 weight's memory: packed only while every packed copy together
# takes at most this share of the memory available at load (an 8B model's 16 GB is not copied).
PACKED_MEMORY_SHARE = 0.25


class NativeLinear(nn.Module):
    """nn.Linear whose small-batch calls go to the native kernel (the bias, if any, added after)."""

    def __init__(
        self,
        weight: torch.Tensor,
        upcast_rows: int | None = None,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        split: torch.Tensor | None = None,
        split_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.upcast_rows = upcast_rows  # bfloat16 batches this big multiply in float32 (None: never)
        self.packed = packed  # the weight in oneDNN's layout (pack()), for bfloat16 batches; None: the plain GEMM
        # a float16 weight as two bfloat16 halves (split_float16), multiplied in the bfloat16 GEMM by
        # bfloat16 batches of split_rows and more (None: the float32 tiles at every size); the halves
        # kept (split), or made per call where memory would not hold them (split None)
        self.split, self.split_rows = split, split_rows
        # one activation row: a single stream through the weight (True), or the tiles' four side by side
        # (the same outputs; which streams faster is the machine's answer, gemm_choice.one_row_stream)
        self.one_stream = True
        self.tiles = hasattr(torch.ops.tokenmill, "tile_gemm")  # (looked up once: not on every call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows, same = flat.shape[0], flat.dtype == self.weight.dtype
        sixteen = self.weight.dtype in (torch.float16, torch.bfloat16)  # a GGUF's F16/BF16 kept as stored
        if rows <= FLOAT_ROWS and (same or sixteen) and flat.dtype in (torch.float32, torch.bfloat16):
            out = torch.ops.tokenmill.small_linear(flat, self.weight, None, self.one_stream)
        elif self.split_rows is not None and rows >= self.split_rows and flat.dtype == torch.bfloat16:
            out = split_linear(flat, self.split) if self.split is not None else split_linear_slabs(flat, self.weight)
        elif self.tiles and flat.dtype == torch.float32 and (sixteen or rows <= TILE_ROWS):
            out = torch.ops.tokenmill.tile_gemm(flat, self.weight)
        elif self.tiles and sixteen and not same and flat.dtype == torch.bfloat16:
            # a 16-bit weight of another type (a GGUF's F16 under bfloat16): the same tiles, the
            # activations widened exactly (1.05-1.18x faster than upcast_linear on a Zen 4 EPYC, 512 rows)
            out = torch.ops.tokenmill.tile_gemm(flat.float(), self.weight).to(flat.dtype)
        elif not same:  # 16-bit weights under another compute dtype: multiply in float32, round once
            out = upcast_linear(flat, self.weight).to(flat.dtype)
        elif self.upcast_rows is not None and rows >= self.upcast_rows and same and flat.dtype == torch.bfloat16:
            out = upcast_linear(flat, self.weight).to(flat.dtype)
        elif self.packed is not None and same and flat.dtype == torch.bfloat16:
            out = packed_linear(flat, self.packed)
        else:
            out = nn.functional.linear(flat, self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32, the weight upcast a slab of SLAB_BYTES at a time (each slab's
    float32 copy stays in the last-level cache for the GEMM; no call allocates the whole
    matrix again)."""
    n, k = weight.shape
    step = slab_rows(k)
    xt = x.float().t()
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32, device=x.device)
    for r0 in range(0, n, step):
        torch.mm(weight[r0 : r0 + step].float(), xt, out=out_t[r0 : r0 + step])
    return out_t.t().contiguous()


def slab_rows(k: int) -> int:
    """Weight rows of k inputs in a slab of SLAB_BYTES at 4 bytes a weight (a float32 copy, or two
    bfloat16 halves)."""
    return max(8, SLAB_BYTES // (4 * k))


def split_float16(weight: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """A float16 [out, in] weight as [out, 2 * in] bfloat16: each value's nearest bfloat16 and, beside
    it, what that leaves over. Both are exact (float16's 11 significant bits are bfloat16's 8 plus a
    remainder of at most 4, inside bfloat16's range), so ``split_linear`` multiplies the float16
    weight itself, on the machine's bfloat16 GEMM (AMX tiles where it has them) at twice the inner
    length; ``packed``: in oneDNN's layout (``pack``)."""
    high = weight.to(torch.bfloat16)
    low = (weight.float() - high.float()).to(torch.bfloat16)
    both = torch.cat([high, low], dim=1).contiguous()
    return pack(both) if packed else both


def split_linear(x: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for ``split = split_float16(weight)`` and bfloat16 x: every product exact, summed in
    float32, rounded once to bfloat16 (as the float32 tiles do, in another order)."""
    both = torch.cat([x, x], dim=1)
    return packed_linear(both, split) if split.is_mkldnn else nn.functional.linear(both, split)


def split_linear_slabs(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``split_linear`` for a float16 weight whose halves are not kept: made per call, SLAB_BYTES of
    them at a time (csrc/gemm.cpp's float16_halves, one pass), each slab's GEMM into its columns."""
    n, k = weight.shape
    step = slab_rows(k)
    both = torch.cat([x, x], dim=1)
    if step >= n:
        return nn.functional.linear(both, torch.ops.tokenmill.float16_halves(weight))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        out[:, r0 : r0 + step] = nn.functional.linear(both, torch.ops.tokenmill.float16_halves(weight[r0 : r0 + step]))
    return out


@functools.cache
def packing_available() -> bool:
    """oneDNN packs bfloat16 weights on this CPU: asked of oneDNN itself with a small weight (it
    refuses CPUs without AVX-512 or AVX-NE-CONVERT, and a CPU flag is not the judge: the library is)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a bfloat16 [out, in] weight for ``packed_linear`` (its layout
    chosen for 64 rows; any batch may use it, with the plain GEMM's results bit for bit)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def use_native_linears(
    model: nn.Module,
    upcast: int | None = None,
    prepack: bool = False,
    block_gemm_rows: dict[str, int | None] | None = None,
    f16_split_rows: tuple[int | None, int | None] = (None, None),
    one_stream: bool = True,
) -> None:
    """Swap the decoder's float linears (and the LM head, sharing a tied embedding's
    weight) for NativeLinear, and let int8 layers use the kernel for small batches;
    ``upcast``: from how many rows bfloat16 batches multiply in float32 (None: never;
    the machine's measured answer is gemm_choice.upcast_rows); ``prepack``: bfloat16
    weights also packed in oneDNN's layout (gemm_choice.prepacked), where memory allows;
    ``block_gemm_rows``: per GGUF block type, from how many rows a bfloat16 batch dequantises
    the blocks into the GEMM (gemm_choice.block_gemm_rows; absent: never); ``f16_split_rows``: from
    how many rows a bfloat16 batch multiplies a float16 weight as two bfloat16 halves in the GEMM,
    the halves kept where memory allows, and where they are made per call (gemm_choice.f16_split_rows;
    None: never); ``one_stream``: a single row
    reads each weight in one stream (gemm_choice.one_row_stream), else four rows side by side."""
    if next(model.parameters()).device.type != "cpu":
        return

    def swap(module: nn.Module) -> nn.Module:
        if type(module) is nn.Linear:
            return NativeLinear(module.weight, upcast, module.bias)
        if isinstance(module, Int8Linear):
            module.enable_small_batch_kernel(INT8_ROWS)
        if isinstance(module, QuantLinear):
            module.use_native(cpu_info().native_bf16, block_gemm_rows)
        return module

    for layer in model.layers:
        for parent, name in linear_layers(layer):
            setattr(parent, name, swap(getattr(parent, name)))
    if model.lm_head is None:
        if model.config.tie_word_embeddings:  # the head reads the embedding table (shared, not copied)
            model.lm_head = NativeLinear(model.embed_tokens.weight, upcast)
    else:  # (a pipeline stage before the last has no head at all)
        model.lm_head = swap(model.lm_head)
    for m in model.modules():
        if isinstance(m, NativeLinear):
            m.one_stream = one_stream
    if prepack:
        pack_bfloat16_weights(model)
    if f16_split_rows != (None, None):
        split_float16_weights(model, *f16_split_rows, packed=prepack and packing_available())
    model.reset_fused_plan()


def split_float16_weights(model: nn.Module, kept_rows: int | None, per_call_rows: int | None, packed: bool) -> None:
    """Give the model's float16 NativeLinears their bfloat16 halves (split_float16) for batches of
    ``kept_rows`` and more, where those copies (4 bytes a weight) take at most PACKED_MEMORY_SHARE of
    the memory free now; else the halves are made per call (split_linear_slabs), from ``per_call_rows``."""
    layers = [m for m in model.modules() if isinstance(m, NativeLinear) and m.weight.dtype == torch.float16]
    total = sum(2 * m.weight.numel() * torch.bfloat16.itemsize for m in layers)
    keep = kept_rows is not None and total <= PACKED_MEMORY_SHARE * available_memory()
    if not keep:
        log.info(
            "tokenmill: float16 weights' bfloat16 halves made per call, from %s rows (kept: %.1f GB)",
            per_call_rows,
            total / 1e9,
        )
    for m in layers:
        m.split, m.split_rows = (split_float16(m.weight, packed), kept_rows) if keep else (None, per_call_rows)


def pack_bfloat16_weights(model: nn.Module) -> None:
    """Give the model's bfloat16 NativeLinears their oneDNN-packed copies, where that second
    copy of every weight takes at most PACKED_MEMORY_SHARE of the memory free now."""
    layers = [m for m in model.modules() if isinstance(m, NativeLinear) and m.weight.dtype == torch.bfloat16]
    total = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if not packing_available() or total > PACKED_MEMORY_SHARE * available_memory():
        log.info(
            "tokenmill: bfloat16 weights not packed for oneDNN (%.1f GB; packing available: %s)",
            total / 1e9,
            packing_available(),
        )
        return
    for m in layers:
        m.packed = pack(m.weight)
