"""The chunks a shard refuses after a damaged moves journal, and the free extents it holds.

A damaged record of the moves journal (:meth:`irdma.server.store.ShardStore.lost`) may have
moved some chunks: the shard refuses them to every request (DataLost) until each is freed or
rewritten whole, and keeps out of use the free extents the record may name, so that neither a
zeroing nor a new chunk wipes what the kept journal points at. :class:`RefusedChunks` is the
part of :class:`irdma.server.shard.Shard` that does it; the attributes are the shard's.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

from irdma._errors import DataLost

from .region import Allocator, Chunk, ChunkKey

if TYPE_CHECKING:
    from .store import ShardStore

log = logging.getLogger("irdma.server")


class RefusedChunks:
    """:attr:`lost` and :attr:`held` of a :class:`~irdma.server.shard.Shard` (a mixin: the
    shard's ``__init__`` sets every attribute named here)."""

    shard_id: int
    used: int
    _alloc: Allocator
    _chunks: dict[ChunkKey, Chunk]
    _freed: collections.deque[tuple[float, int, int]]
    lost: dict[ChunkKey, str]
    held: list[tuple[int, int]]

    def _report_lost(self) -> None:
        """Log, at open, the chunks refused and the bytes held (see :meth:`hold`)."""
        shard_id = self.shard_id
        log.error("shard %d refuses %d chunks (file id, chunk index) that a damaged record of its moves"
                  " journal may have moved: %s. `irdma fsck` names their files (exit status 2); a replicated"
                  " file's chunks come back with `irdma shard resync %d`; otherwise rewrite or delete those"
                  " files (a chunk rewritten whole or freed is served again; a snapshot restore or clone of"
                  " them is refused too: their snapshots share the refused extents). Until then %d bytes of"
                  " free extents that the damaged record may name are kept, neither zeroed nor reused",
                  shard_id, len(self.lost),
                  ", ".join(map(str, sorted(self.lost)[:20])) + (" ..." if len(self.lost) > 20 else ""),
                  shard_id, sum(n for _, n in self.held))

    def hold(self, store: ShardStore) -> None:
        """Keep out of use the free extents a damaged moves-journal record may name (at open,
        while :attr:`lost` is not empty): a lost move's copy, acknowledged bytes the index does
        not know, lies in an extent that is free in the index. Zeroing it would wipe what the
        kept journal points at, and allocating it would hand it to another chunk. Such a copy
        holds the chunk's bytes, so it is in a free extent with written (non-zero) pages: each
        free page run of that kind is held, widened by the largest refused chunk's size on both
        sides (the copy may hold zero pages too), within its free extent. They count as used
        and are freed (then trimmed) once no chunk is refused (:meth:`_release_held`)."""
        span = max(self._chunks[k].size for k in self.lost)
        held: list[tuple[int, int]] = []
        for lo, size in self._alloc.free_extents():
            hi = lo + size
            for start, n in store.written(lo, size):
                a, b = max(lo, start - span), min(hi, start + n + span)
                if held and held[-1][0] + held[-1][1] >= a:
                    a = held.pop()[0]
                held.append((a, b - a))
        for start, n in held:
            self._alloc.reserve(start, n)
            self.used += n
        self.held = held

    def _release_held(self) -> None:
        """Free the extents :meth:`hold` kept once no chunk is refused any more (rewritten whole
        or freed: the kept journal has nothing left to recover); :meth:`trim` zeroes them."""
        if self.lost or not self.held:
            return
        held, self.held = self.held, []
        now = time.monotonic()
        for start, n in held:
            self._alloc.free(start, n)
            self.used -= n
            self._freed.append((now, start, n))
        log.info("shard %d serves every chunk again: %d bytes of free extents kept for the damaged moves journal"
                 " are free again", self.shard_id, sum(n for _, n in held))

    def _refuse_lost(self, file_id: int, chunk_index: int) -> None:
        """Raise DataLost if the chunk is one of :attr:`lost`."""
        if self.lost and (file_id, chunk_index) in self.lost:
            raise DataLost(f"shard {self.shard_id}: chunk ({file_id}, {chunk_index}) cannot be trusted:"
                           f" {self.lost[(file_id, chunk_index)]}",
                           "`irdma fsck` names the file; `irdma shard resync` copies a replicated chunk back,"
                           " else rewrite or delete the file")
