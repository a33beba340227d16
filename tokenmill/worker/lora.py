"""The runner's adapters: loaded ones (LRU, ``max_cpu_loras``) and the slots of the step.

``add`` reads and checks an adapter (``LoRAError`` names what is wrong); a step's
adapters are put in slots by ``activate`` (at most ``max_loras``: the scheduler
never schedules more distinct adapters in one step), evicting the least recently
used slot; an adapter evicted from memory is read again from its folder when a
request needs it (a cold start, measured in bench/lora.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from tokenmill.configuration.config import LoRAConfig
from tokenmill.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from tokenmill.lora.layers import LoRAMapping, add_lora_slots, set_adapter_slot

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.model = model
        self.config = config
        add_lora_slots(model, config.max_loras, config.max_lora_rank)
        self.paths: dict[str, str] = {}  # every adapter ever added (running requests may outlive an unload)
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # in memory, LRU first
        self.slots: list[str | None] = [None] * config.max_loras
        self._slot_use: list[float] = [0.0] * config.max_loras

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter; changes nothing here (callable from any thread)."""
        t0 = time.perf_counter()
        adapter = load_adapter(name, path, self.model.config, self.config.max_lora_rank, self.config.lora_root)
        logger.info(
            "LoRA adapter %s read from %s: rank %d, %d projections, %.1f MiB, %.0f ms",
            name,
            path,
            adapter.rank,
            len(adapter.weights),
            adapter.num_bytes / 2**20,
            (time.perf_counter() - t0) * 1e3,
        )
        return adapter

    def add(self, name: str, path: str, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        adapter = adapter or self.load(name, path)
        if name in self.slots:  # replaced under the same name: the slot must be rewritten
            self.slots[self.slots.index(name)] = None
        self.paths[name] = path
        self._remember(adapter)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        while len(self.loaded) > self.config.cpu_capacity:
            evicted, _ = self.loaded.popitem(last=False)
            logger.info("LoRA adapter %s evicted from memory (max_cpu_loras=%d)", evicted, self.config.cpu_capacity)

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self.loaded.get(name)
        if adapter is None:
            if name not in self.paths:
                raise LoRAError(f"unknown LoRA adapter {name!r}")
            adapter = load_adapter(
                name, self.paths[name], self.model.config, self.config.max_lora_rank, self.config.lora_root
            )
        self._remember(adapter)
        return adapter

    def activate(self, names: set[str]) -> dict[str, int]:
        """Put the step's adapters in slots; name -> slot."""
        if len(names) > len(self.slots):
            raise RuntimeError(f"{len(names)} adapters in one step but max_loras is {len(self.slots)}")
        now = time.perf_counter()
        for name in names:
            if name in self.slots:
                continue
            free = [i for i, s in enumerate(self.slots) if s is None or s not in names]
            # an empty slot first, then the least recently used; the lowest index among equals
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_use[i], i))
            set_adapter_slot(self.model, slot, self._adapter(name))
            self.slots[slot] = name
        slot_of = {name: self.slots.index(name) for name in names}
        for slot in slot_of.values():
            self._slot_use[slot] = now
        return slot_of

    def mapping(self, row_adapters: list[tuple[str | None, int]], device: torch.device) -> LoRAMapping | None:
        """Rows of the flat batch per slot, from (adapter or None, number of rows) in row order."""
        names = {name for name, _ in row_adapters if name is not None}
        if not names:
            return None
        slot_of = self.activate(names)
        rows: dict[int, list[int]] = {}
        start = 0
        for name, n in row_adapters:
            if name is not None:
                rows.setdefault(slot_of[name], []).extend(range(start, start + n))
            start += n
        dtype = self.model.layers[0].mlp.down_proj.lora_a.dtype
        return LoRAMapping.build(rows, start, dtype, device)
