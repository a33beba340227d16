"""The compressed-tensors ``pack-quantized`` format, written: what llm-compressor saves for
W4A16 / W8A16 and what vLLM (its default for these schemes), transformers (with the
``compressed-tensors`` library) and tokenmill load.

Per quantised linear ``model.layers.i.<proj>``:

- ``weight_packed`` int32 [N, ceil(K * bits / 32)]: the integers, offset by 2^(bits-1) so
  they are unsigned, 32 / bits to a word along K;
- ``weight_scale`` [N, K / G] in the model's float dtype;
- ``weight_zero_point`` int32 [ceil(N * bits / 32), K / G], packed along N (asymmetric only);
- ``weight_shape`` int64 [2]: (N, K).

The bytes come from the library's own ``pack_to_int32`` and ``config.json``'s
``quantization_config`` from its ``QuantizationConfig`` and ``ModelCompressor.update_config``,
so the folder is what the library would write for the same integers. The library is an
optional dependency (``pip install 'tokenmill[quantize]'``), imported on use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.errors import TokenmillError
from tokenmill.quantize.calibrate.rtn import QuantizedWeight

INSTALL_HINT = "pip install 'tokenmill[quantize]'"


def require_library() -> None:
    """Fail early, naming the extra, when compressed-tensors is not installed."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise TokenmillError(
            f"tokenmill quantize writes with the compressed-tensors library, which is not installed: {INSTALL_HINT}"
        ) from None


@dataclass(frozen=True)
class Scheme:
    """One config group: the linears it targets (class names or ``re:`` patterns of their
    names) and how their weights are stored (``group_size`` None: one scale per row)."""

    targets: tuple[str, ...]
    bits: int
    group_size: int | None
    symmetric: bool


def linear_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors of one quantised linear, under ``name`` (e.g. ``model.layers.0.mlp.up_proj``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    bits = qw.spec.bits
    out = {
        f"{name}.weight_packed": pack_to_int32(qw.q.contiguous(), bits),
        f"{name}.weight_scale": qw.scale.contiguous(),
        f"{name}.weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if qw.zero is not None:
        out[f"{name}.weight_zero_point"] = pack_to_int32(qw.zero.contiguous(), bits, packed_dim=0)
    return out


def write_quantization_config(folder: Path, schemes: list[Scheme], ignore: list[str]) -> None:
    """Add ``quantization_config`` to ``folder/config.json`` (written before, without it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups = {
        f"group_{i}": QuantizationScheme(
            targets=list(s.targets),
            weights=QuantizationArgs(
                num_bits=s.bits,
                type="int",
                symmetric=s.symmetric,
                strategy="channel" if s.group_size is None else "group",
                group_size=s.group_size,
                dynamic=False,
                observer="minmax",
            ),
        )
        for i, s in enumerate(schemes)
    }
    config = QuantizationConfig(
        config_groups=groups, format="pack-quantized", quantization_status="compressed", ignore=ignore
    )
    ModelCompressor(quantization_config=config).update_config(str(folder))


def save_weights(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """One ``model.safetensors`` (the models this runs on fit one file)."""
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path
