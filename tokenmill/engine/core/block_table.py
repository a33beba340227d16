"""A request's KV block table, which knows how much of itself the model runner holds.

The runner keeps its own copy of every running request's table and is sent deltas only
(``ModelInput.cached_requests``). The table is the one owner of that fact: ``synced`` counts
the leading entries the runner has, and every change at or before that point (copy-on-write,
trim, free, fork) lowers it by itself, so no caller can forget to. Appending never does:
the delta from ``synced`` covers new entries anyway.

The one change the runner is never told about is a sliding window letting go of its oldest
blocks (``release``): attention masks those positions out, so the stale ids it holds are
never read.
"""

from __future__ import annotations

from collections.abc import Iterable


class BlockTable(list):
    """Block ids in order, plus ``synced``: how many leading entries the runner holds."""

    __slots__ = ("synced",)

    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(ids)
        self.synced = 0

    def _changed_from(self, index: int | slice) -> None:
        start = index.indices(len(self))[0] if isinstance(index, slice) else index % max(len(self), 1)
        self.synced = min(self.synced, start)

    def __setitem__(self, index, value) -> None:
        self._changed_from(index)
        super().__setitem__(index, value)

    def __delitem__(self, index) -> None:
        self._changed_from(index)
        super().__delitem__(index)

    def clear(self) -> None:
        super().clear()
        self.synced = 0

    def _refuse(self, *args, **kwargs):
        raise TypeError("a block table changes by index, slice, append, extend or clear only")

    insert = pop = remove = reverse = sort = __iadd__ = __imul__ = _refuse

    def release(self, start: int, stop: int, marker: int) -> None:
        """Entries [start, stop) become ``marker`` without the runner being told (see above)."""
        super().__setitem__(slice(start, stop), [marker] * (stop - start))

    def unsynced(self) -> tuple[int, list[int]] | None:
        """(first index, the entries from there) the runner lacks, or None."""
        return (self.synced, self[self.synced :]) if self.synced < len(self) else None

    def mark_synced(self) -> None:
        self.synced = len(self)
