"""The prefix cache's host-memory tier on its own: one buffer of block slots, bounded, the
least recently used (a hit counts as a use) giving up its slot, rows coming back as put."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tokenmill.engine.core.kv_host import HostTier

ROW = 96


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def row(i: int) -> torch.Tensor:
    return (torch.arange(ROW) * 7 + i).to(torch.uint8)


def test_rows_come_back_as_they_were_put():
    tier = HostTier(4 * ROW, ROW)
    for i in range(3):
        tier.put(h(i), row(i))
    assert all(torch.equal(tier.get(h(i)), row(i)) for i in range(3))
    assert tier.get(h(9)) is None
    assert (tier.stats.stored, tier.stats.hits, tier.stats.bytes, tier.stats.evicted) == (3, 3, 3 * ROW, 0)
    tier.put(h(1), row(5))  # held already: kept as it was (the same hash is the same K/V)
    assert torch.equal(tier.get(h(1)), row(1)) and tier.stats.stored == 3


def test_past_its_slots_the_least_recently_used_block_goes():
    tier = HostTier(3 * ROW + ROW // 2, ROW)  # room for three whole blocks
    assert tier.num_slots == 3
    for i in range(3):
        tier.put(h(i), row(i))
    tier.get(h(0))  # a use: block 1 is now the least recent
    tier.put(h(3), row(3))
    assert h(1) not in tier and all(h(i) in tier for i in (0, 2, 3))
    assert torch.equal(tier.get(h(3)), row(3)) and torch.equal(tier.get(h(0)), row(0))  # its slot reused cleanly
    assert (len(tier), tier.stats.evicted, tier.stats.bytes) == (3, 1, 3 * ROW)


def test_a_row_of_another_size_or_a_tier_smaller_than_a_block_is_refused():
    tier = HostTier(2 * ROW, ROW)
    with pytest.raises(ValueError, match="not 96 bytes"):
        tier.put(h(0), torch.zeros(ROW + 1, dtype=torch.uint8))
    assert len(tier) == 0 and tier.stats.bytes == 0
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(ROW - 1, ROW)
