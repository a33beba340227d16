"""Where this process stands under torchrun (read from its environment; no torch import,
so that the CLI can ask before it loads anything)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_rank() -> int:
    """This process's rank under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0
