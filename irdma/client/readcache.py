"""Reads through a client's local read cache: validation at open, hits, misses that fill it.

:class:`irdma.Client` holds one :class:`CachedReads` when it was given a
:class:`~irdma.client.cache.ChunkCache`. A file is served from the cache only between an open
that validated it (:meth:`CachedReads.open_file`, called by :meth:`irdma.Client.cache_open`:
the mount at every ``open``, the native client at every ``read``) and the next one; the
consistency rule is in :mod:`irdma.client.cache`. This client's own writes and truncates drop
the chunks they touch from the validated set (:meth:`CachedReads.invalidate`), so it reads its
writes.

A read of a validated file is cut at chunk boundaries; each chunk is served from the cache when
its validated version is kept (a *hit*, in memory or on disk), else the chunk is read whole (up
to the file's size as the open saw it) from the shards (a *miss*), its part copied out, and it
is kept when every piece of it answered one version (no update landed between pieces) and no
write of this client to the file started meanwhile. Concurrent misses of one chunk make one read.
Misses and version queries go through the client's data path, view and shard connections
(:class:`~irdma.client.datapath.DataPath`: ``read_shards_into``, ``view``, ``pool``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._concurrency import open_nursery
from .._errors import IrdmaError, NoAttribute
from ..meta import Inode
from ..meta.base import CACHE_MODES, OUT_OF_SYNC, XATTR_CACHE
from ..placement import Layout
from ..transport.base import ShardConnection
from ..wire.protocol import extents as P_extents
from .cache import READONLY_REVALIDATE_S, ChunkCache, Entry
from .view import layout_of

if TYPE_CHECKING:
    from .datapath import ChunkMap, DataPath

log = logging.getLogger("irdma.cache")

#: Files whose validation a client remembers (the oldest forgotten first: its next open checks again).
MAX_FILES = 1 << 16
#: Chunks per version query (one GATHER of empty extents).
VERSIONS_PER_QUERY = 4096


@dataclass
class _File:
    """A file validated at its last open: the chunks that may be served, and at which version."""

    layout: Layout
    size: int  # bytes, as the open saw it (and this client's writes since)
    ctime_ns: int
    readonly: bool
    checked: float  # trio time of the last version check
    valid: dict[int, int] = field(default_factory=dict)  # chunk index -> version on the shards
    gen: int = 0  # bumped by every write and truncate of this client: older misses are not kept


class CachedReads:
    """The cached read path of one client (see the module docstring)."""

    def __init__(self, data: DataPath, cache: ChunkCache) -> None:
        self.data = data
        self.cache = cache
        self.files: dict[int, _File] = {}
        self._fetching: dict[tuple[int, int], trio.Event] = {}
        self._modes: dict[int, tuple[int, bytes]] = {}  # inode -> (ctime_ns, its user.irdma.cache)
        self.version_queries = 0  # round trips of open_file (shards asked), for tests and benchmarks

    def serves(self, file_id: int) -> bool:
        return file_id in self.files

    def invalidate(self, file_id: int, start: int = 0, end: int | None = None, size: int | None = None) -> None:
        """This client writes bytes ``[start, end)`` of a file (``end`` None: to its end) or
        truncates it to ``size``: those chunks are read from the shards again."""
        st = self.files.get(file_id)
        if st is None:
            return
        st.gen += 1
        cs = st.layout.chunk_size
        if size is not None:
            start, end, st.size = size, None, size
        first = start // cs
        last = None if end is None else (max(end, start + 1) - 1) // cs
        for idx in [i for i in st.valid if i >= first and (last is None or i <= last)]:
            del st.valid[idx]
        if end is not None and end > st.size:
            st.size = end

    async def _mode(self, ino: int) -> bytes:
        try:
            value = (await self.data.meta.getxattr(ino, XATTR_CACHE)).strip()
        except NoAttribute:
            return b"default"
        return value if value in CACHE_MODES else b"default"

    async def open_file(self, inode: Inode, chunks: ChunkMap | None, mode: bytes | None) -> None:
        """Validate the kept chunks of ``inode`` (see :meth:`irdma.Client.cache_open`). A shard
        that does not answer leaves its chunks unvalidated (read from the shards), never served."""
        if mode is None:  # the xattr changes the ctime: read it again only when the ctime moved
            known = self._modes.get(inode.ino)
            mode = known[1] if known is not None and known[0] == inode.ctime_ns else await self._mode(inode.ino)
            self._modes[inode.ino] = (inode.ctime_ns, mode)
            while len(self._modes) > MAX_FILES:
                del self._modes[next(iter(self._modes))]
        old = self.files.pop(inode.ino, None)
        if mode == b"off":
            return
        now = trio.current_time()
        readonly = mode == b"readonly"
        if (readonly and old is not None and old.readonly and old.ctime_ns == inode.ctime_ns
                and old.size == inode.size and now - old.checked < READONLY_REVALIDATE_S):
            self.files[inode.ino] = old  # no round trip: the staleness a readonly file accepts
            return
        layout = layout_of(inode)
        st = _File(layout, inode.size, inode.ctime_ns, readonly, now, gen=old.gen + 1 if old else 0)
        while len(self.files) >= MAX_FILES:
            del self.files[next(iter(self.files))]
        self.files[inode.ino] = st
        kept = self.cache.entries(inode.ino)
        for idx in [i for i in kept if i * layout.chunk_size >= inode.size]:  # past the end now
            self.cache.drop(inode.ino, idx)
            del kept[idx]
        if not kept:
            return
        versions, asked = await self._versions(layout, sorted(kept), chunks)
        valid: dict[int, int] = {}
        stale: list[int] = []
        to_check: list[tuple[int, Entry]] = []  # same version, the file's ctime moved: CRC-32 decides
        for idx, e in kept.items():
            v = versions.get(idx)
            if v is None:
                continue  # not checked (its shards did not answer): not served, kept for later
            if v != e.version:
                stale.append(idx)
            elif e.ctime_ns == inode.ctime_ns:
                valid[idx] = v
            else:
                to_check.append((idx, e))
        m = self.cache.metrics
        checked: list[int] = []
        if to_check:
            limit = trio.Semaphore(16)

            async def check(idx: int, e: Entry) -> None:
                async with limit:
                    same = await self._same_crc(layout, idx, asked[idx], e)
                (checked if same else stale).append(idx)

            async with open_nursery() as nursery:
                for idx, e in to_check:
                    nursery.start_soon(check, idx, e)
            await trio.to_thread.run_sync(self._restamp, inode.ino, checked, inode.ctime_ns)
            valid.update((idx, kept[idx].version) for idx in checked)
        for idx in stale:
            self.cache.drop(inode.ino, idx)
        for result, n in (("valid", len(valid) - len(checked)), ("checksum", len(checked)), ("stale", len(stale))):
            if n:
                m.validations.labels(result).inc(n)
        if self.files.get(inode.ino) is st:
            for idx, v in valid.items():
                st.valid.setdefault(idx, v)  # a miss meanwhile set the same version, or a newer one

    def _restamp(self, ino: int, indices: list[int], ctime_ns: int) -> None:
        for idx in indices:
            self.cache.restamp(ino, idx, ctime_ns)

    def _asked(self, layout: Layout, index: int, chunks: ChunkMap | None) -> int | None:
        """The replica a chunk's version is asked of: the tail of its up-to-date replicas (CRAQ:
        what it has is acknowledged), never one out of the chunk's in-sync set; None if none."""
        v = self.data.view
        if layout.replicas == 1 and not v.moves:  # its one copy, where the stripe put it
            sid = layout.shard_of(index)
            return sid if v.current(sid) else None
        placed, joining = v.placed(layout, index)
        rec = chunks.get(index) if chunks else None
        cands = [s for s in placed if s != joining and v.current(s) and (rec is None or rec.get(s) != OUT_OF_SYNC)]
        return cands[-1] if cands else None

    async def _versions(self, layout: Layout, indices: list[int],
                        chunks: ChunkMap | None) -> tuple[dict[int, int], dict[int, int]]:
        """``({chunk index: version}, {chunk index: shard asked})`` of ``indices``: one GATHER of
        empty extents per shard (and per :data:`VERSIONS_PER_QUERY` chunks), all shards at once.
        Chunks whose shard did not answer are left out."""
        by_shard: dict[int, list[int]] = {}
        asked: dict[int, int] = {}
        for idx in indices:
            sid = self._asked(layout, idx, chunks)
            if sid is not None:
                by_shard.setdefault(sid, []).append(idx)
                asked[idx] = sid
        out: dict[int, int] = {}

        async def one(sid: int, idxs: list[int]) -> None:
            c = np.array(idxs, dtype=np.int64)
            ext = P_extents(c, np.zeros_like(c), np.zeros_like(c))

            async def fn(conn: object) -> tuple[np.ndarray, memoryview]:
                return await conn.gather(layout.file_id, ext)  # type: ignore[attr-defined, no-any-return]

            try:
                got, _ = await self.data.pool.run(sid, fn, pull=True)
            except IrdmaError as exc:
                log.warning("cache: versions of %d chunks of file %d from shard %d: %s; read from the shards",
                            len(idxs), layout.file_id, sid, exc)
                return
            out.update(zip(idxs, (int(v) for v in got), strict=True))

        self.version_queries += sum(-(-len(v) // VERSIONS_PER_QUERY) for v in by_shard.values())
        async with open_nursery() as nursery:
            for sid, idxs in by_shard.items():
                for k in range(0, len(idxs), VERSIONS_PER_QUERY):
                    nursery.start_soon(one, sid, idxs[k : k + VERSIONS_PER_QUERY])
        return out, asked

    async def _same_crc(self, layout: Layout, index: int, sid: int, e: Entry) -> bool:
        """Whether the shard's chunk is still the kept one by version and CRC-32 (one CHECKSUM)."""
        try:
            got = await self.data.pool.call(sid, ShardConnection.checksum, layout.file_id, index, self.data.view.epoch)
        except IrdmaError as exc:
            log.warning("cache: checksum of chunk %d of file %d on shard %d: %s", index, layout.file_id, sid, exc)
            return False
        crc = await trio.to_thread.run_sync(self.cache.crc_of, e)
        return crc is not None and got == (e.version, crc)

    # ------------------------------------------------------------ reads
    async def read_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None) -> None:
        """:meth:`irdma.Client.read_into` of a validated file: chunk by chunk, from the cache
        or from the shards (then kept). Raises as it."""
        cs, n = layout.chunk_size, len(into)
        if n == 0:
            return
        first, last = offset // cs, (offset + n - 1) // cs
        if first == last:
            await self._chunk(layout, first, offset - first * cs, offset - first * cs + n, into, chunks)
            return
        async with open_nursery() as nursery:
            for idx in range(first, last + 1):
                lo, hi = max(offset, idx * cs), min(offset + n, (idx + 1) * cs)
                nursery.start_soon(self._chunk, layout, idx, lo - idx * cs, hi - idx * cs,
                                   into[lo - offset : hi - offset], chunks)

    async def _chunk(self, layout: Layout, idx: int, lo: int, hi: int, dst: memoryview,
                     chunks: ChunkMap | None) -> None:
        """Fill ``dst`` with bytes ``[lo, hi)`` of chunk ``idx``."""
        fid = layout.file_id
        for _ in range(2):
            st = self.files.get(fid)
            v = st.valid.get(idx) if st is not None else None
            if v:
                data = await self.cache.load(fid, idx, v, lo, hi)
                if data is not None:
                    dst[:] = data
                    return
            key = (fid, idx)
            busy = self._fetching.get(key)
            if busy is None:
                break
            await busy.wait()  # another read of this chunk is filling it: served from it next
        self.cache.metrics.misses.inc()
        st = self.files.get(fid)
        if st is None or key in self._fetching:
            await self.data.read_shards_into(layout, idx * layout.chunk_size + lo, dst, chunks)
            return
        done = self._fetching[key] = trio.Event()
        try:
            await self._fill(st, layout, idx, lo, hi, dst, chunks)
        finally:
            del self._fetching[key]
            done.set()

    async def _fill(self, st: _File, layout: Layout, idx: int, lo: int, hi: int, dst: memoryview,
                    chunks: ChunkMap | None) -> None:
        """A miss: read chunk ``idx`` whole (up to the file's size) from the shards, copy out
        ``[lo, hi)``, and keep it when it was read at one version and the file not written meanwhile."""
        cs = layout.chunk_size
        length = min(cs, max(hi, st.size - idx * cs))
        gen = st.gen
        # not zeroed first: read_shards_into fills every byte or raises; once read the buffer is
        # never written again (it is what the cache keeps, no copy)
        data = memoryview(np.empty(length, dtype=np.uint8))  # type: ignore[arg-type]
        versions: list[int] = []
        await self.data.read_shards_into(layout, idx * cs, data, chunks, versions)
        dst[:] = data[lo:hi]
        if not versions or len(set(versions)) != 1 or not versions[0]:
            return  # a hole (nothing to keep), or an update landed between its pieces
        if st.gen != gen or self.files.get(layout.file_id) is not st:
            return  # this client wrote the file meanwhile, or it was opened again
        await self.cache.store(Entry(layout.file_id, idx, versions[0], st.ctime_ns, length, None, cs), data)
        if st.gen == gen:
            st.valid[idx] = versions[0]

    async def warm(self, inode: Inode, chunks: ChunkMap | None, progress: object = None) -> int:
        """Fill the cache with every chunk of a file (validating what is kept first); returns
        the bytes read from the shards. ``progress``: called with each chunk's bytes."""
        await self.open_file(inode, chunks, None)
        st = self.files.get(inode.ino)
        if st is None:  # user.irdma.cache=off
            return 0
        cs, fetched = st.layout.chunk_size, 0
        for idx in range(st.layout.chunk_count(inode.size)):
            n = min(cs, inode.size - idx * cs)
            if idx not in st.valid or self.cache.entry(inode.ino, idx) is None:
                await self._chunk(st.layout, idx, 0, n, memoryview(bytearray(n)), chunks)
                fetched += n
            if callable(progress):
                progress(n)
        return fetched
