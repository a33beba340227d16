"""Hugging Face folders in the compressed-tensors format (llm-compressor's, vLLM's default) and
FP8 checkpoints (``quant_method: fp8``): their linear weights decoded, exactly.

compressed-tensors describes, in ``quantization_config``, groups of layers (``config_groups``:
``targets`` "Linear", a module name or ``re:`` a pattern; minus ``ignore``) and each group's
weights: ``num_bits``, ``type`` int or float, ``symmetric``, ``strategy`` tensor / channel /
group / block, ``group_size``. How they are stored is the ``format``:

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 [N, K * bits / 32], the values
  offset by ``2^(bits-1)`` to be unsigned and packed densely along K, low bits first;
  ``weight_scale`` [N, K / G] (group), [N, 1] (channel) or [1] (tensor); asymmetric:
  ``weight_zero_point`` packed the same way along N (dim 0); act order: ``weight_g_idx`` [K].
- ``int-quantized`` / ``naive-quantized`` (W8A8): ``weight`` int8 [N, K] as it is.
- ``float-quantized`` (FP8): ``weight`` float8_e4m3fn [N, K]; per tensor, channel or block scale.

Every one means ``w = (q - zero) * scale``. The int ones come back as ``IntGroups`` (the form
the native int4/int8 kernels are laid out from, every number exact in float32); FP8 as the float
weight ``q * scale`` rounded to the scale's dtype, which is what compressed-tensors' own
decompression computes. FP8 checkpoints of ``quant_method: fp8`` (DeepSeek's and Qwen's block-wise
``weight_scale_inv``, or a per-tensor / per-channel ``weight_scale``) decode the same way.

We run the weights only: activation quantisation (W8A8's per-token int8 inputs, static
``input_scale``s) is not simulated, and the loader says so; anything we cannot decode
exactly (other formats, sparsity, transforms, other bit widths, quantised KV scales) is refused
by name before any weight is read. (quantize/compressed.py writes the pack-quantized format.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.quant.int_groups import IntGroups, unpack_last

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
CT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale")
FP8_TENSORS = ("weight_scale", "weight_scale_inv", "input_scale")
SUPPORTED_CT = (
    "compressed-tensors formats pack-quantized (int 4 or 8 bits), int-quantized / naive-quantized (int8) "
    "and float-quantized (FP8 e4m3), strategies tensor, channel, group and (FP8) block"
)


@dataclass(frozen=True)
class WeightArgs:
    """One config group's weights: how they were quantised."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str  # "tensor", "channel", "group" or "block"
    group_size: int | None
    block: tuple[int, int] | None
    format: str


@dataclass(frozen=True)
class Scheme:
    """A config group: which layers (``targets``) it quantises, and how."""

    targets: tuple[str, ...]
    weights: WeightArgs
    activations: str | None  # what the checkpoint does to a linear's inputs, for the log line


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    """compressed-tensors' matching on a module name: ``re:`` a pattern (re.match), a class
    name (every layer whose weights are quantised is a Linear here) or the name itself."""
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t in ("Linear", name):
            return True
    return False


def _stored_quantized(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class CompressedTensors:
    """A compressed-tensors folder's quantisation."""

    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]
    method: str = "compressed-tensors"

    def takes(self, part: str, tensor: torch.Tensor) -> bool:
        """Whether a stored tensor (a layer's ``part``) belongs to a quantised weight."""
        return part in CT_TENSORS or (part == "weight" and _stored_quantized(tensor))

    def scheme(self, name: str) -> Scheme:
        for s in self.schemes:
            if _matches(name, s.targets) and not _matches(name, self.ignore):
                return s
        raise ModelLoadError(f"compressed-tensors layer {name}: quantised weights, but no config group targets it")

    def decode(self, parts: dict[str, torch.Tensor], name: str) -> IntGroups | torch.Tensor:
        args = self.scheme(name).weights
        if args.type == "float":
            return _fp8_weight(parts, "weight_scale", name, args.block)
        if args.format == "pack-quantized":
            return _packed_ints(parts, args, name)
        return _plain_ints(parts, args, name)

    def notes(self) -> list[str]:
        """What the checkpoint asks that we do not do (the loader logs them)."""
        return sorted(
            {f"{s.activations} (the weights run, the activations stay float)" for s in self.schemes if s.activations}
        )


@dataclass(frozen=True)
class FP8Checkpoint:
    """A ``quant_method: fp8`` folder: e4m3 weights with a block-wise ``weight_scale_inv`` or a
    per-tensor / per-channel ``weight_scale``."""

    block: tuple[int, int] | None
    activation_scheme: str
    method: str = "fp8"

    def takes(self, part: str, tensor: torch.Tensor) -> bool:
        return part in FP8_TENSORS or (part == "weight" and _stored_quantized(tensor))

    def decode(self, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        scale = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        return _fp8_weight(parts, scale, name, self.block if scale == "weight_scale_inv" else None)

    def notes(self) -> list[str]:
        return [f"{self.activation_scheme} FP8 activations (the weights run, the activations stay float)"]


def compressed_tensors_quant(qc: dict[str, Any], path: Path) -> CompressedTensors:
    """A compressed-tensors ``quantization_config`` -> CompressedTensors; what we cannot decode
    exactly is refused here, naming the field."""
    where = f"{path / 'config.json'}: compressed-tensors"
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelLoadError(f"{where} quantization_status {status!r} is not supported (only 'compressed')")
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(field):
            raise ModelLoadError(f"{where} {field} is not supported; supported: {SUPPORTED_CT}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{where}: no config_groups")
    schemes = [_scheme(str(name), g, qc.get("format"), where) for name, g in groups.items()]
    return CompressedTensors(tuple(schemes), tuple(str(i) for i in qc.get("ignore") or ()))


def _scheme(gname: str, g: dict[str, Any], default_format: str | None, where: str) -> Scheme:
    w = g.get("weights")
    if not w:
        raise ModelLoadError(f"{where} config group {gname!r} quantises no weights (activations only)")
    fmt = g.get("format") or default_format
    bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int"))
    strategy = str(w.get("strategy", "tensor"))
    if fmt not in CT_FORMATS:
        raise ModelLoadError(f"{where} format {fmt!r} (group {gname!r}) is not supported; supported: {SUPPORTED_CT}")
    plain_ok = fmt == "pack-quantized" or bits == 8
    if (
        (kind, bits) not in (("int", 4), ("int", 8), ("float", 8))
        or (kind == "float") != (fmt == "float-quantized")
        or not plain_ok
    ):
        raise ModelLoadError(
            f"{where} {kind} weights of {bits} bits in format {fmt!r} (group {gname!r}) are not supported; "
            f"supported: {SUPPORTED_CT}"
        )
    if strategy not in ("tensor", "channel", "group", "block") or (strategy == "block" and kind == "int"):
        raise ModelLoadError(
            f"{where} {kind} weights in strategy {strategy!r} (group {gname!r}) are not supported; "
            f"supported: {SUPPORTED_CT}"
        )
    block = w.get("block_structure")
    if strategy == "block" and (not block or len(block) != 2):
        raise ModelLoadError(f"{where} block strategy without a block_structure [rows, columns] (group {gname!r})")
    group_size = w.get("group_size")
    if strategy == "group" and (not group_size or int(group_size) <= 0):
        raise ModelLoadError(f"{where} group strategy with group_size {group_size!r} (group {gname!r})")
    args = WeightArgs(
        bits,
        kind,
        bool(w.get("symmetric", True)),
        strategy,
        int(group_size) if group_size else None,
        (int(block[0]), int(block[1])) if strategy == "block" else None,
        fmt,
    )
    acts = g.get("input_activations")
    activations = None
    if acts:
        how = "dynamic" if acts.get("dynamic") else "static"
        activations = f"{how} {acts.get('type', 'int')}{acts.get('num_bits', '')} activations (group {gname!r})"
    targets = tuple(str(t) for t in g.get("targets") or ())
    if not targets:
        raise ModelLoadError(f"{where} config group {gname!r} has no targets")
    return Scheme(targets, args, activations)


def fp8_quant(qc: dict[str, Any], path: Path) -> FP8Checkpoint:
    """A ``quant_method: fp8`` config (transformers' FineGrainedFP8, DeepSeek, Qwen)."""
    where = f"{path / 'config.json'}: fp8"
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelLoadError(f"{where} fmt {fmt!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise ModelLoadError(f"{where} weight_block_size {block!r} is not [rows, columns]")
    return FP8Checkpoint((int(block[0]), int(block[1])) if block else None, str(qc.get("activation_scheme", "dynamic")))


def _need(parts: dict[str, torch.Tensor], name: str, *keys: str) -> None:
    missing = [k for k in keys if k not in parts]
    if missing:
        raise ModelLoadError(f"quantised layer {name}: missing {', '.join(missing)}")


def _per_group(t: torch.Tensor, n: int, k: int, name: str, what: str) -> tuple[torch.Tensor, int]:
    """A scale or zero point of a tensor, channel or group strategy -> ([N, K / group], group)."""
    t = t.reshape(1, 1) if t.numel() == 1 else t
    if t.dim() == 1:
        t = t[:, None]
    if t.dim() != 2 or t.shape[0] not in (1, n) or k % t.shape[1]:
        raise ModelLoadError(f"quantised layer {name}: {what} {tuple(t.shape)} does not fit a [{n}, {k}] weight")
    return t.expand(n, t.shape[1]), k // t.shape[1]


def _packed_ints(parts: dict[str, torch.Tensor], args: WeightArgs, name: str) -> IntGroups:
    _need(parts, name, "weight_packed", "weight_scale")
    packed = parts["weight_packed"]
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ModelLoadError(f"quantised layer {name}: weight_packed is {packed.dtype} {tuple(packed.shape)}")
    n, room = packed.shape[0], packed.shape[1] * 32 // args.num_bits
    shape = [int(x) for x in parts["weight_shape"].tolist()] if "weight_shape" in parts else [n, room]
    k = shape[1]
    if shape[0] != n or k > room:
        raise ModelLoadError(f"quantised layer {name}: weight_packed {tuple(packed.shape)} does not hold {shape}")
    raw = unpack_last(packed, args.num_bits)[:, :k]  # q + 2^(bits-1)
    scale, group = _per_group(parts["weight_scale"].float(), n, k, name, "weight_scale")
    offset = 1 << (args.num_bits - 1)
    zero = None
    if not args.symmetric:
        _need(parts, name, "weight_zero_point")
        zp = parts["weight_zero_point"]
        if zp.dtype == torch.int32 and args.strategy in ("group", "channel"):  # packed along N
            zp = unpack_last(zp.T, args.num_bits)[:, :n].T - offset
        zero, _ = _per_group(zp.to(torch.int32), n, k, name, "weight_zero_point")
    if args.num_bits == 4:  # the kernels' 4-bit form: q 0..15, min = -(zero + 8) * scale
        q = raw.to(torch.uint8)
        minv = -(offset + (0 if zero is None else zero)) * scale
    else:  # 8-bit: signed q, min = -zero * scale (none when symmetric)
        q = (raw - offset).to(torch.int8)
        minv = None if zero is None else -zero.float() * scale
    return _grouped(q, scale, minv, group, args.num_bits, parts.get("weight_g_idx"), name)


def _plain_ints(parts: dict[str, torch.Tensor], args: WeightArgs, name: str) -> IntGroups:
    _need(parts, name, "weight", "weight_scale")
    q = parts["weight"]
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ModelLoadError(f"quantised layer {name}: weight is {q.dtype} {tuple(q.shape)}, not int8 [N, K]")
    n, k = q.shape
    scale, group = _per_group(parts["weight_scale"].float(), n, k, name, "weight_scale")
    minv = None
    if not args.symmetric:
        _need(parts, name, "weight_zero_point")
        zero, _ = _per_group(parts["weight_zero_point"].to(torch.int32), n, k, name, "weight_zero_point")
        minv = -zero.float() * scale
    return _grouped(q, scale, minv, group, 8, parts.get("weight_g_idx"), name)


def _grouped(
    q: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor | None,
    group: int,
    bits: int,
    g_idx: torch.Tensor | None,
    name: str,
) -> IntGroups:
    """The parts as IntGroups; act order (``g_idx`` not runs of the input) as a scale and min
    per input row, as GPTQ's act order."""
    k = q.shape[1]
    scale = scale.contiguous()
    minv = None if minv is None else minv.contiguous()
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= scale.shape[1]:
            raise ModelLoadError(f"quantised layer {name}: weight_g_idx does not fit {k} inputs")
        rows = g_idx.long()
        return IntGroups(q, scale[:, rows].contiguous(), None if minv is None else minv[:, rows].contiguous(), 1, bits)
    return IntGroups(q.contiguous(), scale, minv, group, bits)


def _fp8_weight(
    parts: dict[str, torch.Tensor], scale_name: str, name: str, block: tuple[int, int] | None
) -> torch.Tensor:
    """e4m3 weight times its scale (per tensor, channel, or block of ``block`` rows x columns),
    rounded to the scale's dtype as compressed-tensors' and transformers' dequantisation do."""
    _need(parts, name, "weight", scale_name)
    w, scale = parts["weight"], parts[scale_name]
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ModelLoadError(f"FP8 layer {name}: weight is {w.dtype} {tuple(w.shape)}, not float8_e4m3fn [N, K]")
    n, k = w.shape
    s = scale.float()
    if block is not None:
        br, bc = block
        rows, cols = -(-n // br), -(-k // bc)
        if s.shape != (rows, cols):
            raise ModelLoadError(
                f"FP8 layer {name}: {scale_name} {tuple(s.shape)}; blocks of {block} need ({rows}, {cols})"
            )
        s = s.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
    else:
        s, _ = _per_group(s, n, k, name, scale_name)
        s = s.repeat_interleave(k // s.shape[1], 1)
    out = w.float() * s
    return out.to(scale.dtype) if scale.dtype in (torch.float16, torch.bfloat16) else out
