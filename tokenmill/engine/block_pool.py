"""The pool of KV-cache block ids (no tensors): which blocks are free, which in use.

A block holds ``block_size`` tokens of K and V in every layer; the worker owns the
tensors, this pool only hands out their indices.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when a caller asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert i in self._used, f"block {i} freed twice or never allocated"
            self._used.remove(i)
            self._free.append(i)
