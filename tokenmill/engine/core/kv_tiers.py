"""The prefix cache's tiers below the pool, fastest first: host memory (``kv_host``), then
disk (``kv_disk``); either may be absent.

    pool (device)  --cached blocks, as computed-->  host tier  -->  disk tier
                   <--a prefix-cache miss: host first, then disk (promoted to host)--

Blocks are copied down as they are cached in the pool (one export of their rows a step,
shared by both tiers), so the pool never waits for a copy when it evicts, and a block the
pool evicts is already below. A miss in the pool reads the leading blocks a tier holds into
free pool blocks and caches them there (``kv_transfer.cache_rows``), as the pool's own hits.
"""

from __future__ import annotations

import torch

from tokenmill.engine.core.block_pool import BlockPool
from tokenmill.engine.core.kv_disk import DiskTier
from tokenmill.engine.core.kv_host import HostTier
from tokenmill.engine.core.kv_transfer import BlockRows, cache_rows


class KVTiers:
    def __init__(self, pool: BlockPool, runner: BlockRows, host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None, "no tier"
        self.host, self.disk = host, disk
        self._pool, self._runner = pool, runner

    def store(self, blocks: list[tuple[int, bytes]]) -> None:
        """Blocks just cached in the pool (id, hash): their rows copied out now (the next step
        may reuse a block) into the host tier, and handed to the disk tier's writer."""
        host, disk = self.host, self.disk
        new = [
            (b, h) for b, h in blocks if (host is not None and h not in host) or (disk is not None and h not in disk)
        ]
        if not new:
            return
        rows = self._runner.export_blocks([b for b, _ in new])
        for (_, h), row in zip(new, rows, strict=True):
            if host is not None:
                host.put(h, row)
            if disk is not None and h not in disk:
                disk.put(h, row.numpy().tobytes())

    def load(self, hashes: list[bytes], held: list[int]) -> int:
        """The leading ``hashes`` the tiers hold, read into free pool blocks and cached there
        (never evicting ``held``, the prefix found in the pool already), no more read than the
        pool has free blocks (a miss costs one lookup a tier). A block read from disk is kept
        in host memory too. Returns how many."""
        rows: list[torch.Tensor] = []
        for h in hashes[: self._pool.num_free]:
            row = self.host.get(h) if self.host is not None else None
            if row is not None:
                rows.append(row.clone())  # the slot may be reused by a promotion below
                continue
            data = self.disk.get(h) if self.disk is not None else None
            if data is None:
                break
            row = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.host is not None:
                self.host.put(h, row)
            rows.append(row)
        if not rows:
            return 0
        return cache_rows(self._pool, self._runner, held, hashes[: len(rows)], torch.stack(rows))

    def close(self) -> None:
        """Write what the disk tier has queued (the next engine on its directory starts with it)."""
        if self.disk is not None:
            self.disk.close()
