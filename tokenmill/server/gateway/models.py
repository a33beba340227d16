"""The models a server serves: each its own engine (KV pool, scheduler, adapters),
named as clients send them in a request's ``model``.

A request names a served model, one of its LoRA adapters, or a router (a virtual
model, model_router.py) that picks one of two served models per request. ``Target``
is what a request runs on once that is resolved: a model and perhaps an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine.api.streams import StreamingFront


@dataclass
class ServedModel:
    name: str  # the id clients send
    engine: StreamingFront
    tokenizer: Any
    max_model_len: int
    # Bumped whenever the model's adapters change, so that an adapter reloaded under the
    # same name never answers from what the old one said (the response cache's keys hold it).
    generation: int = 0
    reasoning_parser: str | None = None  # --reasoning-parser, where its vocabulary has the markers (reasoning.py)


@dataclass(frozen=True)
class Target:
    """A served model, with one of its LoRA adapters or none."""

    model: ServedModel
    lora: str | None = None

    @property
    def name(self) -> str:
        """The id the answer carries: the adapter's, else the model's."""
        return self.lora or self.model.name

    @property
    def engine(self) -> StreamingFront:
        return self.model.engine

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def identity(self) -> str:
        """What the answers depend on, for cache keys: the model, its adapter (by path)
        and the generation of its adapters."""
        path = self.model.engine.snapshot().loras.get(self.lora) if self.lora else None
        return f"{self.model.name}|{self.lora}|{path}|{self.model.generation}"


def model_id(path: Path) -> str:
    """The model id clients send by default: a file's stem, a folder's name."""
    return path.stem if path.is_file() else path.name
