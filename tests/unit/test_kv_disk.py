"""The prefix cache's disk tier on its own: files by block hash under a namespace, kept over
restarts, bounded, and a miss (never a wrong block) for anything torn, corrupt or foreign."""

from __future__ import annotations

import hashlib
import threading

from tokenmill.engine.core.kv_disk import HEADER, DiskTier, files_fingerprint, namespace_of

NS = namespace_of({"model": "a", "dtype": "float32"})


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


def test_blocks_come_back_after_a_restart_and_only_in_their_namespace(tmp_path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    for i in range(3):
        tier.put(h(i), payload(i))
    tier.close()
    assert tier.stats.stored == 3 and tier.stats.bytes == 3 * (HEADER + 1000)
    again = DiskTier(tmp_path, NS, 1 << 20)  # a restarted engine
    assert again.stats.bytes == 3 * (HEADER + 1000)
    assert [again.get(h(i)) for i in range(3)] == [payload(i) for i in range(3)]
    assert again.get(h(9)) is None and again.stats.hits == 3
    other = DiskTier(tmp_path, namespace_of({"model": "a", "dtype": "bfloat16"}), 1 << 20)
    assert other.get(h(0)) is None and other.stats.bytes == 0
    for t in (again, other):
        t.close()


def test_a_torn_corrupt_or_foreign_file_is_a_miss_and_is_removed(tmp_path):
    tier = DiskTier(tmp_path, NS, 1 << 20)
    for i in range(4):
        tier.put(h(i), payload(i))
    tier.flush()
    path = tier._path
    flipped = bytearray(path(h(0)).read_bytes())
    flipped[HEADER + 10] ^= 1
    path(h(0)).write_bytes(bytes(flipped))  # one bit of the payload
    path(h(1)).write_bytes(path(h(1)).read_bytes()[: HEADER + 500])  # cut short
    path(h(2)).write_bytes(path(h(3)).read_bytes())  # another block's file under this name
    (path(h(3)).parent / f"{h(3).hex()}.123.tmp").write_bytes(b"half a write")  # a crash mid-write
    for i in range(3):
        assert tier.get(h(i)) is None and not path(h(i)).exists()
    assert tier.stats.corrupt == 3 and tier.get(h(3)) == payload(3)
    tier.close()
    restarted = DiskTier(tmp_path, NS, 1 << 20)
    assert not list(tmp_path.rglob("*.tmp"))  # the half write removed at start
    assert restarted.stats.bytes == HEADER + 1000 and restarted.get(h(3)) == payload(3)
    restarted.close()


def test_past_its_size_the_least_recently_used_blocks_go(tmp_path):
    tier = DiskTier(tmp_path, NS, 3 * (HEADER + 1000))
    for i in range(3):
        tier.put(h(i), payload(i))
    tier.flush()
    assert tier.get(h(0)) == payload(0)  # used: now the most recent
    tier.put(h(3), payload(3))
    tier.put(h(4), payload(4))
    tier.flush()
    assert tier.stats.evicted == 2 and tier.stats.bytes == 3 * (HEADER + 1000)
    assert [h(i) in tier for i in range(5)] == [True, False, False, True, True]
    assert len(list(tmp_path.rglob("*.kv"))) == 3
    tier.close()


def test_files_fingerprint_changes_with_a_file(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 10)
    before = files_fingerprint(tmp_path)
    assert files_fingerprint(tmp_path) == before
    (tmp_path / "adapter_model.safetensors").write_bytes(b"y" * 11)
    assert files_fingerprint(tmp_path) != before


def test_engines_on_one_directory_read_each_others_blocks(tmp_path):
    """Replicas on one machine share the tier: what one writes after the other started, the
    other reads (found on disk, checked as its own)."""
    a, b = DiskTier(tmp_path, NS, 1 << 20), DiskTier(tmp_path, NS, 1 << 20)
    a.put(h(0), payload(0))
    a.flush()
    assert h(0) not in b and b.get(h(0)) == payload(0) and h(0) in b
    assert b.stats.bytes == HEADER + 1000 and b.get(h(1)) is None
    for t in (a, b):
        t.close()


def test_blocks_past_the_write_queue_are_dropped_not_held(tmp_path, monkeypatch):
    """What waits for the writer is bounded in bytes: a block past it is not written (a miss
    later), never held in memory without bound."""
    from tokenmill.engine.core import kv_disk

    monkeypatch.setattr(kv_disk, "WRITE_QUEUE_BYTES", 2500)
    tier = DiskTier(tmp_path, NS, 1 << 20)
    go, write = threading.Event(), tier._write
    tier._write = lambda *a: (go.wait(), write(*a))  # a slow disk: the first write waits
    for i in range(4):
        tier.put(h(i), payload(i))
    assert tier.stats.dropped == 2  # 1000 + 1000 bytes queued; the third would pass 2500
    go.set()
    tier.close()
    assert tier.stats.stored == 2 and [h(i) in tier for i in range(4)] == [True, True, False, False]
