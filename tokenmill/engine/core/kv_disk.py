"""The prefix cache's disk tier: full KV blocks kept in files, named by their block hash,
under a namespace that says which model, weights, dtypes and kernels computed them, so that
a restarted engine (or a replica beside it) starts with the prefixes it had computed.

    <dir>/<namespace>/<first byte of the hash>/<hash>.kv   a header, then the block's raw rows

The header holds a magic, the namespace, the hash, the payload's length and its CRC-32: a
torn, truncated or corrupt file, or one from another namespace, is a miss (and is removed),
never a wrong answer. Files are written by a thread (to a temporary name, then renamed into
place: a crash leaves no half file under a block's name), so a step never waits on the disk;
when the queue is full a block is simply not written. The directory's share is bounded
(``max_bytes``): past it, the least recently used files go (a hit counts as a use; their
modification times carry the order over a restart).

Engines may share a directory (replicas on one machine): a block one wrote, another reads
(``get`` looks on disk for what it has not seen), and each keeps its own count of the bound.

The tier knows hashes and bytes only; ``kv_tiers.KVTiers`` pairs it with the block pool and
the runner's rows, as ``kv_transfer`` does for KV moving between replicas.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"TMKVBLK2"  # (1: a blake2b checksum, 5x slower to read back than the CRC)
HEADER = len(MAGIC) + 16 + 16 + 8 + 4  # magic, namespace, block hash, payload length, payload CRC-32
# Blocks waiting for the writer thread, at most (then new ones are dropped): a step's worth of a long
# prompt (a 1B bfloat16 model's 4,096-token chunk is 128 MB of K/V; at 64 MB the disk lost the tail of
# every prompt past ~2,000 tokens of the 135M float32 model, bench/kv_tiers.py).
WRITE_QUEUE_BYTES = 256 << 20


def namespace_of(facts: dict[str, Any]) -> bytes:
    """A namespace from everything that decides a block's numbers (model files, dtypes, kernels)."""
    text = "\n".join(f"{k}={facts[k]!r}" for k in sorted(facts))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def files_fingerprint(path: str | Path) -> bytes:
    """What changes when a model's or an adapter's files do: each file's name, size and
    modification time (a file, or every file under a folder), hashed."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.digest()


def _checksum(payload: bytes | memoryview) -> bytes:
    """CRC-32: what finds a torn or corrupt file (a foreign one fails the namespace and hash
    first), at 3.7 GB/s where blake2b's 0.7 took a third of a disk hit's time."""
    return zlib.crc32(payload).to_bytes(4, "little")


@dataclass
class DiskTierStats:
    hits: int = 0  # blocks read back into the pool
    stored: int = 0  # blocks written
    evicted: int = 0  # files removed to stay within max_bytes
    dropped: int = 0  # blocks not written: the writer's queue was full (WRITE_QUEUE_BYTES)
    corrupt: int = 0  # files that failed their checks (removed, a miss)
    bytes: int = 0  # this namespace's files on disk


class DiskTier:
    def __init__(self, directory: str | Path, namespace: bytes, max_bytes: int) -> None:
        self.root = Path(directory) / namespace.hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self._scan()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._queued_bytes = 0  # payloads in the queue (bounded by WRITE_QUEUE_BYTES)
        self._writer = threading.Thread(target=self._write_loop, name="tokenmill-kv-disk", daemon=True)
        self._writer.start()

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}.kv"

    def _scan(self) -> None:
        """The files a previous engine left, oldest use first; its temporary files removed."""
        found = []
        for path in self.root.glob("*/*"):
            if path.suffix != ".kv":
                path.unlink(missing_ok=True)  # a write a crash cut short
                continue
            try:
                st = path.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(found):
            self._files[h] = size
        self.stats.bytes = sum(self._files.values())

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._files

    def get(self, block_hash: bytes) -> memoryview | None:
        """The block's payload (a view of the file's bytes as read), or None (not here, or its file fails a check: then removed). A
        block this process has not seen is looked for on disk too (one stat): another engine on
        the same directory (a replica beside this one) may have written it."""
        with self._lock:
            known = block_hash in self._files
        path = self._path(block_hash)
        if not known and not path.exists():
            return None
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        payload = memoryview(raw)[HEADER:]
        n = int.from_bytes(raw[len(MAGIC) + 32 : len(MAGIC) + 40], "little") if len(raw) >= HEADER else -1
        if (
            len(raw) < HEADER
            or raw[: len(MAGIC)] != MAGIC
            or raw[len(MAGIC) : len(MAGIC) + 16] != self.namespace
            or raw[len(MAGIC) + 16 : len(MAGIC) + 32] != block_hash
            or n != len(payload)
            or raw[len(MAGIC) + 40 : HEADER] != _checksum(payload)
        ):
            logger.warning("KV disk tier: %s fails its checks; removed (a miss)", path)
            self.stats.corrupt += 1
            path.unlink(missing_ok=True)
            self._forget(block_hash)
            return None
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
            else:  # another engine's: this one's now too
                self._files[block_hash] = len(raw)
                self.stats.bytes += len(raw)
        try:
            os.utime(path)  # its use survives a restart
        except OSError:
            pass
        self.stats.hits += 1
        return payload

    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Have the block written (by the writer thread; dropped when its queue is full)."""
        if block_hash in self:
            return
        with self._lock:
            if self._queued_bytes + len(payload) > WRITE_QUEUE_BYTES:
                self.stats.dropped += 1
                return
            self._queued_bytes += len(payload)
        self._queue.put((block_hash, payload))

    def flush(self) -> None:
        """Wait until every block handed to ``put`` so far is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self.stats.bytes -= size

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                try:
                    self._write(*item)
                finally:
                    with self._lock:
                        self._queued_bytes -= len(item[1])
            except OSError as e:  # a full or read-only disk: the block is not kept, the engine goes on
                logger.warning("KV disk tier: a block could not be written (%s)", e)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        header = MAGIC + self.namespace + block_hash + len(payload).to_bytes(8, "little") + _checksum(payload)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        size = HEADER + len(payload)
        with self._lock:
            if block_hash not in self._files:
                self._files[block_hash] = size
                self.stats.bytes += size
                self.stats.stored += 1
            victims = []
            while self.stats.bytes > self.max_bytes and len(self._files) > 1:
                h, n = self._files.popitem(last=False)
                self.stats.bytes -= n
                self.stats.evicted += 1
                victims.append(h)
        for h in victims:
            self._path(h).unlink(missing_ok=True)
