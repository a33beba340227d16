"""LoRA in the model: slots of adapter weights beside each base projection, applied
per token, unmerged, on top of any base weights (float, int8, int4, native).

Each adapted projection (``LoRALinear``) keeps ``max_loras`` slots. For a fused
projection (qkv, gate-up) a slot holds the sub-projections' A matrices stacked
(``[subs * r, in]``) and their B matrices block-diagonal (``[out, subs * r]``), so a
slot costs two matmuls whatever its targets; ranks below ``max_lora_rank`` are
zero-padded. A step's ``LoRAMapping`` says which rows of the flat token batch use
which slot (rows of the base model use none): the projection adds
``(x[rows] A^T) B^T`` to its output for each slot in the step, the adapter's tokens
gathered by index (prefill chunks and decodes alike).

The model never sees a request: the runner hands ``forward`` the mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.lora.adapter import LoRAAdapter, target_shapes

# each module of a decoder layer that LoRA may touch, and the checkpoint projections fused in it
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}  # fmt: skip


@dataclass
class LoRAMapping:
    """One step's rows per slot: ``segments[i] = (slot, row indices)``."""

    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LoRAState:
    """The mapping of the forward in progress (set by ``LlamaForCausalLM.forward``)."""

    mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, subs: tuple[str, ...], cfg: ModelConfig, max_loras: int, max_rank: int,
                 state: LoRAState, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.subs = subs
        self.state = state
        self.max_rank = max_rank
        shapes = target_shapes(cfg)
        self.out_slices = []
        start = 0
        for s in subs:
            out = shapes[s][0]
            self.out_slices.append((start, start + out))
            start += out
        inp = shapes[subs[0]][1]
        n = len(subs) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, n, inp, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, start, n, dtype=dtype, device=device), persistent=False)
        self.active = [False] * max_loras  # slot holds weights for this projection

    def set_slot(self, slot: int, layer: int, adapter: LoRAAdapter | None) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.active[slot] = False
        if adapter is None:
            return
        r = adapter.rank
        for j, sub in enumerate(self.subs):
            pair = adapter.weights.get((layer, sub))
            if pair is None:
                continue
            a, b = pair
            lo, hi = self.out_slices[j]
            col = j * self.max_rank
            self.lora_a[slot, col : col + r].copy_(a)
            self.lora_b[slot, lo:hi, col : col + r].copy_(b)
            self.active[slot] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.state.mapping
        if mapping is None:
            return y
        for slot, rows in mapping.segments:
            if not self.active[slot]:
                continue
            xs = x.index_select(0, rows)
            y.index_add_(0, rows, (xs @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return y


def add_lora_slots(model: nn.Module, max_loras: int, max_rank: int) -> LoRAState:
    """Wrap every adaptable projection of the model in a LoRALinear; returns the shared
    state through which ``forward`` passes each step's mapping."""
    state = LoRAState()
    cfg = model.config
    ref = model.embed_tokens.weight
    for layer in model.layers:
        for path, subs in FUSED.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), subs, cfg, max_loras, max_rank, state,
                                             ref.dtype, ref.device))  # fmt: skip
    return state


def set_adapter_slot(model: nn.Module, slot: int, adapter: LoRAAdapter | None) -> None:
    """Load an adapter's weights into a slot of every projection (None: clear it)."""
    for i, layer in enumerate(model.layers):
        for path in FUSED:
            parent_name, attr = path.split(".")
            module = getattr(getattr(layer, parent_name), attr)
            module.set_slot(slot, i, adapter)
