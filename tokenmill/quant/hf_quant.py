"""Hugging Face folders quantised by AWQ (GEMM layout) or GPTQ (v1): their int4 tensors decoded.

Both store, per linear layer, 4-bit values packed eight to an int32, a float16 scale and a
4-bit zero per group of ``G`` input channels: ``w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]``.

- **AWQ GEMM** (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` [K, N/8] and ``qzeros`` [K/G, N/8]
  packed along N in AWQ's interleaved order (nibble ``i`` of word ``c`` holds column
  ``8c + AWQ_ORDER[i]``); ``scales`` [K/G, N]; group ``g(k) = k // G``.
- **GPTQ v1** (AutoGPTQ / GPTQModel ``checkpoint_format`` "gptq"): ``qweight`` [K/8, N] packed
  along K (nibble ``i`` of word row ``r`` is input row ``8r + i``), ``qzeros`` [K/G, N/8] packed
  along N in plain order and stored as ``zero - 1`` (the kernels add the 1 back, without a mask:
  zeros 1..16), ``scales`` [K/G, N], ``g_idx`` [K] each input row's group. With act order
  (``desc_act``) ``g_idx`` is not ``k // G``: the groups are not runs of the input.

``decode`` turns them into ``IntGroups``: q [N, K] in 0..15, and per group a float32 scale and
min (``-zero * scale``), so that ``w = q * scale + min`` — the form ``packed_weight`` (quant/
weights.py) lays out for the native kernels, exact: every product and the sum are float32
numbers without rounding (4- and 5-bit integers times float16 scales). An act-order weight
comes back with groups of one input row (its scale and min gathered by ``g_idx``): not
something the kernels' groups of 32 can hold, so the loader dequantises it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.quant.hf_compressed import CompressedTensors, FP8Checkpoint, compressed_tensors_quant, fp8_quant
from tokenmill.quant.int_groups import IntGroups, unpack_last

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j is in nibble AWQ_REVERSE_ORDER[j]
QUANT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # a quantised linear's tensors (beside its bias)
SUPPORTED = (
    "awq (version gemm, 4-bit), gptq (checkpoint_format gptq, 4-bit), compressed-tensors (int4/int8/fp8) and fp8"
)


@dataclass(frozen=True)
class HFQuant:
    """A folder's quantization_config, as far as decoding needs it."""

    method: str  # "awq" or "gptq"
    bits: int
    group_size: int  # -1: one group over the whole input
    sym: bool  # gptq: zeros all 8 (the stored ones say so anyway)
    desc_act: bool  # gptq: act order (g_idx not sorted)

    def takes(self, part: str, tensor: torch.Tensor) -> bool:
        """Whether a stored tensor (a layer's ``part``) belongs to a quantised weight."""
        return part in QUANT_TENSORS

    def decode(self, parts: dict[str, torch.Tensor], name: str) -> IntGroups:
        return decode(self, parts, name)

    def notes(self) -> list[str]:
        return []


# What a quantised folder's config decodes to: each has ``method``, ``takes(part, tensor)`` (which
# stored tensors are its), ``decode(parts, layer)`` (IntGroups or a float weight) and ``notes()``.
FolderQuant = Union["HFQuant", CompressedTensors, FP8Checkpoint]


def hf_quantization(raw: dict[str, Any], path: Path) -> FolderQuant | None:
    """The folder's quantisation (None: plain float weights); anything we do not decode
    exactly is refused here, before any weights are read."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    where = path / "config.json"
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return compressed_tensors_quant(qc, path)
    if method == "fp8":
        return fp8_quant(qc, path)
    if method not in ("awq", "gptq"):
        raise ModelLoadError(
            f"{where}: quantization_config quant_method {method or None!r} is not supported; supported: {SUPPORTED}"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    if bits != 4 and not (method == "gptq" and bits == 8):
        raise ModelLoadError(f"{where}: {method} with {bits} bits is not supported yet; supported: {SUPPORTED}")
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group != -1 and group <= 0:
        raise ModelLoadError(f"{where}: invalid {method} group_size {group}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{where}: AWQ version {version!r} is not supported; supported: {SUPPORTED}")
        if not qc.get("zero_point", True):
            raise ModelLoadError(f"{where}: AWQ without zero points is not supported; supported: {SUPPORTED}")
        return HFQuant("awq", bits, group, sym=False, desc_act=False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt != "gptq":
        raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: {SUPPORTED}")
    return HFQuant("gptq", bits, group, sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)))


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, N/8] words -> [R, N] values in column order."""
    vals = unpack_last(packed)
    return vals.reshape(vals.shape[0], -1, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(vals.shape[0], -1)


def decode(quant: HFQuant, parts: dict[str, torch.Tensor], name: str) -> IntGroups:
    """One linear layer's stored tensors (``parts``: qweight, qzeros, scales, and GPTQ's g_idx)
    -> its IntGroups; shapes that do not fit each other are refused naming the layer."""
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise ModelLoadError(f"{quant.method} layer {name}: missing {', '.join(missing)}")
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ModelLoadError(
            f"{quant.method} layer {name}: qweight/qzeros are {qweight.dtype}/{qzeros.dtype}, not int32"
        )
    if quant.method == "awq":
        q = _awq_columns(qweight)  # [K, N]
        zeros = _awq_columns(qzeros)  # [K/G, N]
    else:
        rows, n = qweight.shape
        shifts = torch.arange(0, 32, quant.bits, dtype=torch.int32)
        mask = (1 << quant.bits) - 1
        q = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, n)  # [K, N]
        zeros = unpack_last(qzeros, quant.bits)[:, :n] + 1  # v1: stored as zero - 1
    k, n = q.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or zeros.shape != (groups, n) or k % groups:
        raise ModelLoadError(
            f"{quant.method} layer {name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} "
            f"and scales {tuple(scales.shape)} do not fit together"
        )
    group = k // groups
    if quant.group_size != -1 and quant.group_size != group:
        raise ModelLoadError(f"{quant.method} layer {name}: groups of {group} inputs, config says {quant.group_size}")
    if quant.bits == 8:  # the int8 kernels' form: signed q, w = (q + 128 - zero) * scale
        q, zeros = q - 128, zeros - 128
    q = q.T.to(torch.uint8 if quant.bits == 4 else torch.int8).contiguous()
    minv = -zeros.float() * scales  # exact: a 5- (9-) bit integer times a float16
    g_idx = parts.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ModelLoadError(f"{quant.method} layer {name}: g_idx does not fit {k} inputs in {groups} groups")
        rows = g_idx.long()  # act order: each input row its own group's scale and min
        return IntGroups(q, scales[rows].T.contiguous(), minv[rows].T.contiguous(), 1, quant.bits)
    return IntGroups(q, scales.T.contiguous(), minv.T.contiguous(), group, quant.bits)
