"""LoRA adapters in PEFT's format, read and checked against the base model.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``...) and ``adapter_model.safetensors`` with, per
adapted projection, ``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` (``[r, in]``)
and ``lora_B.weight`` (``[out, r]``). The projection computes
``W x + s * B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA); the
scale is folded into B here, once.

Supported: q/k/v/o/gate/up/down projections of the decoder layers. Refused with an
error naming them: embedding or LM-head adapters, DoRA, trained biases, extra saved
modules, ranks above ``max_lora_rank``, shapes that do not fit the model, weights or a
``lora_alpha`` that are not finite numbers. Nothing is read whole before its size is
checked: ``adapter_config.json`` is capped at ``MAX_CONFIG_BYTES`` and the safetensors
header at ``MAX_HEADER_BYTES``, and a malformed file (a config that is not an object,
nested past JSON's recursion limit, a path the OS refuses) is a LoRAError, never an
exception of another kind.

A client may name any path (``/v1/load_lora_adapter``), so what the error tells it must
not map the disk: every way a path fails to hold the two files, readable and of a sane
size (nothing there, a file, no permission, a name too long, a file too big or not
JSON), gets one message, ``NOT_LOADABLE``; the reason goes to the server's log. With
``root`` (``--lora-root``), a path that resolves outside it is refused before anything
is read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.configuration.config import ModelConfig
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)
NOT_LOADABLE = (
    "no loadable adapter at this path (adapter_config.json and adapter_model.safetensors); see the server log"
)
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
MAX_HEADER_BYTES = 16 << 20  # a safetensors header: names, dtypes, shapes, offsets
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAError(TokenmillError):
    """An adapter that cannot be used with this model (the server answers 400)."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, target) -> (A [r, in], B [out, r] already multiplied by the scaling), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.weights}


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def load_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int, root: str | Path | None = None
) -> LoRAAdapter:
    """Read and check a PEFT adapter folder; LoRAError names what is wrong (a path that
    holds no adapter: ``NOT_LOADABLE``, with the reason logged)."""
    folder = Path(path)
    if root is not None and not _inside(folder, Path(root)):
        raise LoRAError(
            f"LoRA adapter {name!r}: the path is outside the folder this server loads adapters from (--lora-root)"
        )
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    try:
        _check_file(config_file, MAX_CONFIG_BYTES)
        _check_file(weights_file, None)
        conf = json.loads(config_file.read_bytes())
        header = _safetensors_header_size(weights_file)
    except OSError as e:  # a path the OS refuses (a name too long, no permission)
        raise _not_loadable(name, folder, f"cannot read it: {e.strerror or type(e).__name__}") from None
    except (ValueError, RecursionError) as e:
        raise _not_loadable(name, folder, f"adapter_config.json is not valid JSON: {type(e).__name__}") from None
    except _FileProblem as e:
        raise _not_loadable(name, folder, str(e)) from None
    if header > MAX_HEADER_BYTES:
        raise _not_loadable(
            name, folder, f"{weights_file.name} claims a header of {header} bytes (more than {MAX_HEADER_BYTES})"
        )
    if not isinstance(conf, dict):
        raise _not_loadable(name, folder, "adapter_config.json does not hold a JSON object")
    _check_config(name, conf, max_rank)
    rank, alpha = conf["r"], conf.get("lora_alpha", conf["r"])
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except Exception as e:
        raise _not_loadable(name, folder, f"cannot read {weights_file.name}: {type(e).__name__}: {e}") from None
    shapes = target_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {name!r}: unsupported weight {key!r} (only q/k/v/o/gate/up/down "
                "projections of the decoder layers can be adapted)"
            )
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in shapes or layer >= cfg.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: weight {key!r} does not match a projection of this model")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise LoRAError(f"LoRA adapter {name!r}: weight {key!r} holds values that are not finite (NaN or inf)")
        halves.setdefault((layer, target), {})[half] = tensor
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        out, inp = shapes[target]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, expected A ({rank}, {inp}) and B ({out}, {rank})"
            )
        weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file.name} holds no LoRA weights")
    return LoRAAdapter(name, str(folder), rank, scaling, weights)


class _FileProblem(Exception):
    """One of the two files is missing or too big (logged, never told to the client)."""


def _check_file(path: Path, max_bytes: int | None) -> None:
    if not path.is_file():
        raise _FileProblem(f"no file {path.name} there")
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise _FileProblem(f"{path.name} is {path.stat().st_size} bytes (more than {max_bytes})")


def _not_loadable(name: str, folder: Path, why: str) -> LoRAError:
    logger.warning("LoRA adapter %r at %r is not loadable: %s", name, str(folder)[:300], why)
    return LoRAError(f"LoRA adapter {name!r}: {NOT_LOADABLE}")


def _inside(folder: Path, root: Path) -> bool:
    """``folder`` resolves (symlinks and '..' followed) to ``root`` or below it."""
    try:
        return folder.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        return False


def _safetensors_header_size(path: Path) -> int:
    """The length safetensors' first 8 bytes give its JSON header (read before the file is)."""
    with open(path, "rb") as f:
        head = f.read(8)
    return struct.unpack("<Q", head)[0] if len(head) == 8 else 0


def _check_config(name: str, conf: dict, max_rank: int) -> None:
    def refuse(why: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r}: {why}")

    if conf.get("peft_type", "LORA") != "LORA":
        raise refuse("its peft_type is not supported (only LORA)")  # the value is not echoed
    rank = conf.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse("r must be a positive integer")
    if rank > max_rank:
        raise refuse(f"rank {rank} is above --max-lora-rank {max_rank}")
    alpha = conf.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise refuse("lora_alpha must be a finite number")
    if conf.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if conf.get("bias", "none") != "none":
        raise refuse("trained biases (bias other than 'none') are not supported")
    if conf.get("modules_to_save"):
        raise refuse("modules_to_save are not supported")
    targets = conf.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if targets in TARGETS + ("embed_tokens", "lm_head") else []
    unsupported = sorted(set(targets) - set(TARGETS))
    if unsupported:
        raise refuse(f"target_modules {unsupported} are not supported (supported: {', '.join(TARGETS)})")
    if conf.get("layers_to_transform") is not None and not isinstance(conf["layers_to_transform"], list | int):
        raise refuse("layers_to_transform must be a list of layer indices")
