"""LoRA in the model: slots of adapter weights beside each base projection, applied
per token, unmerged, on top of any base weights (float, int8, int4, native).

Each adapted projection (``LoRALinear``) keeps ``max_loras`` slots. For a fused
projection (qkv, gate-up) a slot holds the sub-projections' A matrices stacked
(``[subs * r, in]``) and their B matrices block-diagonal (``[out, subs * r]``), so a
slot costs two matmuls whatever its targets; ranks below ``max_lora_rank`` are
zero-padded. A step's ``LoRAMapping`` says which rows of the flat token batch use
which slot (rows of the base model use none): the projection adds
``(x[rows] A^T) B^T`` to its output for each slot in the step, all slots in one pair
of batched matmuls over their rows gathered and padded (prefill chunks and decodes
alike).

The model never sees a request: the runner hands ``forward`` the mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.configuration.config import ModelConfig
from tokenmill.lora.adapter import LoRAAdapter, target_shapes

# each module of a decoder layer that LoRA may touch, and the checkpoint projections fused in it
FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


PAD_ROWS = 16  # slots with more rows than this in a step are not padded together


@dataclass
class LoRAMapping:
    """One step's rows per adapter slot, in the forms the projections use.

    Slots with few rows (decodes) are computed together in the padded form: their
    rows gathered into ``[slots, max_rows]`` (``gather``; padding repeats row 0 and is
    zeroed by ``mask``), so that they cost the same two batched matmuls
    (``torch.bmm``) whatever their number: 7 ops per projection rather than 4 per
    slot. ``segments``: (slot, row indices) of the slots computed on their own (one
    with many rows, such as a prompt chunk, which would make everyone's padding
    long; or a lone slot). ``whole``: the slot of a step whose every row uses one
    adapter (no gather at all)."""

    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    slots: torch.Tensor | None = None  # [S] slot ids, for the padded form
    gather: torch.Tensor | None = None  # [S * L] row per padded position
    mask: torch.Tensor | None = None  # [S, L, 1]: 1 for real rows, 0 for padding
    whole: int | None = None
    slot_range: tuple[int, int] | None = None  # the slots are consecutive: weights are read as a view

    @classmethod
    def build(cls, rows: dict[int, list[int]], num_rows: int, dtype: torch.dtype, device: torch.device) -> LoRAMapping:
        if len(rows) == 1:
            ((slot, r),) = rows.items()
            return cls([(slot, torch.tensor(r, device=device))], whole=slot if len(r) == num_rows else None)
        # a slot with many rows (a prompt chunk) is computed on its own: padding every
        # other slot to its length would multiply the work; the rest (decodes) go together
        big = {s: r for s, r in rows.items() if len(r) > PAD_ROWS}
        small = {s: r for s, r in rows.items() if len(r) <= PAD_ROWS}
        segments = [(slot, torch.tensor(r, device=device)) for slot, r in sorted(big.items())]
        if len(small) <= 1:
            segments += [(slot, torch.tensor(r, device=device)) for slot, r in small.items()]
            return cls(segments)
        longest = max(len(r) for r in small.values())
        gather = [r + [0] * (longest - len(r)) for _, r in sorted(small.items())]
        mask = [[1.0] * len(r) + [0.0] * (longest - len(r)) for _, r in sorted(small.items())]
        slots = sorted(small)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        return cls(
            segments,
            slots=torch.tensor(slots, device=device),
            gather=torch.tensor(gather, device=device).flatten(),
            mask=torch.tensor(mask, dtype=dtype, device=device).unsqueeze(-1),
            slot_range=(slots[0], slots[0] + len(slots)) if consecutive else None,
        )


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        subs: tuple[str, ...],
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.subs = subs
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
        # stored transposed (x @ a, then @ b: no transposes per call)
        self.register_buffer("lora_a", torch.zeros(max_loras, inp, n, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, n, start, dtype=dtype, device=device), persistent=False)
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
            self.lora_a[slot, :, col : col + r].copy_(a.T)
            self.lora_b[slot, col : col + r, lo:hi].copy_(b.T)
            self.active[slot] = True

    def forward(
        self, x: torch.Tensor, m: LoRAMapping | None = None, long_rows: tuple[tuple[int, int], ...] | None = None
    ) -> torch.Tensor:
        """The base projection plus each row's adapter (``m``: this step's rows per slot,
        passed down from ``LlamaForCausalLM.forward``; None: the base model only). ``long_rows``
        goes to a base over GGUF blocks (llama.project passes it only to one)."""
        y = self.base(x) if long_rows is None else self.base(x, long_rows=long_rows)
        if m is None:
            return y
        if m.whole is not None:  # every row, one adapter
            if self.active[m.whole]:
                y.add_((x.to(self.lora_a.dtype) @ self.lora_a[m.whole]) @ self.lora_b[m.whole])
            return y
        x = x.to(self.lora_a.dtype)
        for slot, rows in m.segments:  # slots computed on their own
            if self.active[slot]:
                d = (x.index_select(0, rows) @ self.lora_a[slot]) @ self.lora_b[slot]
                y.index_add_(0, rows, d.to(y.dtype))
        if m.slots is None:
            return y
        s, n = m.mask.shape[0], m.mask.shape[1]
        if m.slot_range is not None:
            a, b = self.lora_a[m.slot_range[0] : m.slot_range[1]], self.lora_b[m.slot_range[0] : m.slot_range[1]]
        else:
            a, b = self.lora_a.index_select(0, m.slots), self.lora_b.index_select(0, m.slots)
        xs = x.index_select(0, m.gather).view(s, n, -1)
        t = torch.bmm(xs, a) * m.mask
        d = torch.bmm(t, b)
        y.index_add_(0, m.gather, d.view(s * n, -1).to(y.dtype))
        return y


def add_lora_slots(model: nn.Module, max_loras: int, max_rank: int) -> None:
    """Wrap every adaptable projection of the model in a LoRALinear (each step's mapping
    reaches them as an argument of ``forward``)."""
    cfg = model.config
    device = model.layers[0].input_layernorm.weight.device
    # float32 on the CPU: its small float32 matmuls are 3-4x faster than bfloat16 ones on
    # CPUs without AMX (measured: [16, 576] @ [576, 48] 13 us against 51 us)
    dtype = torch.float32 if device.type == "cpu" else model.layers[0].input_layernorm.weight.dtype
    for layer in model.layers:
        for path, subs in FUSED.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), subs, cfg, max_loras, max_rank, dtype, device))
    model.has_lora_slots = True
    model.reset_fused_plan()


def set_adapter_slot(model: nn.Module, slot: int, adapter: LoRAAdapter | None) -> None:
    """Load an adapter's weights into a slot of every projection (None: clear it)."""
    for i, layer in enumerate(model.layers):
        for path in FUSED:
            parent_name, attr = path.split(".")
            module = getattr(getattr(layer, parent_name), attr)
            module.set_slot(slot, i, adapter)
