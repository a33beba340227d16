"""One intra-op thread for the loops of small tensor ops (GPTQ's columns, AWQ's clipping
groups): each op is too small to split, and the threads' synchronisation is what it then
costs. Measured on a shared 2-core machine, one GPTQ of a [960, 576] weight took 0.6 s with
one thread and 24 s with two. The previous setting comes back when the loop ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
