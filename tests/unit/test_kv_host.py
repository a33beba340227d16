"""The prefix cache's host-memory tier's bookkeeping: which block holds which slot, bounded,
the least recently used (a lookup counts as a use) giving up its slot to a new block."""

from __future__ import annotations

import hashlib

import pytest

from tokenmill.engine.core.kv_host import HostTier

ROW = 96


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_each_block_keeps_its_slot_until_it_is_the_least_recently_used():
    tier = HostTier(3, ROW)
    slots = [tier.reserve(h(i)) for i in range(3)]
    assert sorted(slots) == [0, 1, 2] and [tier.lookup(h(i)) for i in range(3)] == slots
    assert tier.lookup(h(9)) is None
    assert (tier.stats.stored, tier.stats.bytes, tier.stats.evicted) == (3, 3 * ROW, 0)
    tier.lookup(h(0))  # a use: block 1 is now the least recent
    assert tier.reserve(h(3)) == slots[1]  # its slot, for the caller to fill
    assert h(1) not in tier and all(h(i) in tier for i in (0, 2, 3)) and len(tier) == 3
    assert (tier.stats.stored, tier.stats.bytes, tier.stats.evicted) == (4, 3 * ROW, 1)


def test_a_tier_of_no_slot_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(0, ROW)
