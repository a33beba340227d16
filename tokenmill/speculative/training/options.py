"""``train-draft``'s settings, apart from the training code: ``tokenmill --help`` builds its
flags from these defaults without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainOptions:
    method: str = "eagle"
    epochs: float = 2.0
    batch_size: int = 8
    lr: float = 1e-3
    unroll: int = 3
    draft_vocab_size: int = 8192
    token_loss_weight: float = 0.1  # EAGLE: feature loss + this x token cross-entropy (EAGLE-1: 0.1)
    medusa_heads: int = 3
    eval_every: int = 50
    seed: int = 0
