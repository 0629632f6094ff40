"""The data path of the native client: pulls and pushes of a file's bytes by layout, the one
retry engine of every chained update, flush and truncate.

:class:`DataPath` sits over the client's :class:`~irdma.client.view.ShardView` (where each chunk
is, its chain, which replicas may serve a read) and :class:`~irdma.client.pool.ShardPool` (the
connections, their windows and deadlines). It reads chunk maps from the metadata engine but
records nothing there but withdrawn replicas: a write returns the chunk replicas it created and
the caller records them (:meth:`irdma.Client.write` does). Sparse rows
(:mod:`irdma.client.sparse`) and optimizer state images (:mod:`irdma.client.optstate`) send their
updates through :meth:`DataPath.chained_update` too.

Never lies, never hangs: a chunk the chunk map records as written that its shard no longer has,
or that was written to an earlier incarnation of the shard's memory, raises DataLost instead of
reading as zeros, and a write to it is refused rather than recreating it from zeros; a replica
that fails is marked down and the update sent again with the same request id along the shorter
chain (applied exactly once on every replica).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._concurrency import open_nursery
from .._errors import (
    BadRequest,
    DataLost,
    Dirty,
    Fenced,
    InvalidArgument,
    IrdmaError,
    ReplicaError,
    ReplicaFailed,
    ShardUnavailable,
)
from ..meta.aio import AsyncMeta
from ..meta.base import OUT_OF_SYNC
from ..placement import Layout, Piece
from ..transport import ShardConnection
from ..wire.compress import Compression
from ..wire.compress import encode as compress_encode
from ..wire.compress import max_elements as compress_max_elements
from ..wire.extents import move, positions
from ..wire.protocol import DEFAULT_MAX_PAYLOAD, Chain, Part, Update, UpdateOp, as_update
from . import comm
from .buffers import BufferPool
from .pool import ShardPool
from .view import ShardView

if TYPE_CHECKING:
    from .readcache import CachedReads

#: Attempts of one update (a failed replica or a new view each cost one).
MAX_ATTEMPTS = 6
#: Float32 elements of a piece from which it is compressed in a worker thread.
ENCODE_IN_THREAD = 1 << 16

#: A file's chunk map: chunk index -> {shard id: incarnation of the shard's memory when the
#: chunk was written there}, one entry per replica.
ChunkMap = dict[int, dict[int, int]]
#: Chunk replicas a write created: (chunk index, shard id, incarnation), for the chunk map.
NewChunk = tuple[int, int, int]

log = logging.getLogger("irdma.client")


def as_bytes_view(data: object) -> memoryview:
    """``data`` (bytes, a numpy array, a memoryview) as a flat, C-contiguous view of bytes."""
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        view = memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]
    return view.cast("B")


def pack(src: np.ndarray, at: np.ndarray, length: np.ndarray, pool: BufferPool | None = None) -> np.ndarray:
    """The bytes ``src[at[k] : at[k] + length[k]]`` one after the other (in a buffer of
    ``pool``'s when given: give it back when its request has completed)."""
    pos = positions(length)
    out = pool.take(int(pos[-1])) if pool is not None else np.empty(int(pos[-1]), dtype=np.uint8)
    move(out, pos[:-1], src, at, length)
    return out


class DataPath:
    """The data path of one client (see the module docstring).

    Args:
        view: the client's view of the shard map (placement, chains, health).
        pool: the client's shard connections.
        meta: the metadata engine (chunk maps, withdrawn replicas).

    Attributes:
        cached: the local read cache's read path (:mod:`irdma.client.readcache`), or None: reads
            of the files it serves go there; writes and truncates drop what it keeps of them.
        buffers: reused payload buffers (:mod:`irdma.client.buffers`) of sparse pushes.
    """

    def __init__(self, view: ShardView, pool: ShardPool, meta: AsyncMeta) -> None:
        self.view = view
        self.pool = pool
        self.meta = meta
        self.cached: CachedReads | None = None
        self.buffers = BufferPool()  # packed payloads of sparse pushes, reused once their request completed
        self._unsynced: set[int] = set()  # shards written since the last flush
        self._unsynced_single: set[int] = set()  # those of them written the only copy of a chunk
        self._flush_lock = trio.Lock()  # a flush returns only after the one in flight covered it
        self._writing: collections.Counter[tuple[int, int]] = collections.Counter()  # updates in flight per chunk
        self._request_base = int.from_bytes(os.urandom(8), "big")
        self._request_seq = 0

    def request_id(self) -> int:
        """A fresh request id (never 0); ids step by 256 so a transport may number sub-requests."""
        self._request_seq += 1
        return ((self._request_base + (self._request_seq << 8)) & 0xFFFFFFFFFFFFFFFF) or 1 << 8

    def note_unsynced(self, chain: Sequence[int], only_copy: bool) -> None:
        """An update went down ``chain``: its shards are synced by the next :meth:`flush`
        (``only_copy``: the head held the chunk's one copy, so a failed sync fails the flush)."""
        if only_copy:
            self._unsynced_single.add(chain[0])
        self._unsynced.update(chain)

    @staticmethod
    def lost(layout: Layout, index: int, shard_id: int, why: str) -> DataLost:
        start = index * layout.chunk_size
        return DataLost(f"bytes [{start}, {start + layout.chunk_size}) of file {layout.file_id} (chunk {index}) are lost:"
                        f" shard {shard_id} {why}")

    async def read_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None = None) -> None:
        """Pull bytes ``[offset, offset+len(into))`` of a file into ``into``.

        A chunk that does not exist reads as zeros (a hole) unless ``chunks``, the file's chunk
        map, records it as written: then it was lost and DataLost is raised. A replicated chunk
        is read from one of its up-to-date replicas (spread over them by chunk; CRAQ's clean
        reads: one with an update still in flight down its chain sends the reader to the tail);
        a replica that fails is marked down and the next one read.

        Raises:
            DataLost: a recorded chunk is gone from every replica (its shards restarted on fresh
                memory, or it was freed behind the namespace's back).
            ShardUnavailable: no replica answered in time. In both cases ``into`` is partly filled.
        """
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into
        if self.cached is not None and self.cached.serves(layout.file_id):
            await self.cached.read_into(layout, offset, into, chunks)
            return
        await self.read_shards_into(layout, offset, into, chunks)

    async def read_shards_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None = None,
                               versions: list[int] | None = None) -> None:
        """:meth:`read_into` from the shards, never the cache. ``versions``: the version each
        piece read answered is appended to it (0 for a hole)."""
        n, cs = len(into), layout.chunk_size
        index, within = divmod(offset, cs)
        if 0 < n <= cs - within and offset >= 0 and n <= (self.max_piece(layout) or n):
            pieces = [Piece(layout.shard_of(index), index, within, n, 0)]  # a small read: no generator
        else:
            pieces = list(layout.pieces(offset, n, self.max_piece(layout)))
        for attempt in range(2):
            if versions is not None:
                versions.clear()  # those of this attempt only
            try:
                if len(pieces) == 1:
                    await self._read_piece(layout, pieces[0], into, chunks, versions)
                    return
                async with open_nursery() as nursery:
                    for p in pieces:
                        nursery.start_soon(self._read_piece, layout, p, into[p.buf_offset : p.buf_offset + p.length],
                                           chunks, versions)
                return
            except DataLost:
                # a replica this view names may have given its chunk to a drain's target since:
                # read the shard map again, and read once more if it changed
                view = self.view.epoch
                await self.view.refresh()
                if attempt or self.view.epoch == view:
                    raise

    async def _read_piece(self, layout: Layout, p: Piece, view: memoryview, chunks: ChunkMap | None,
                          versions: list[int] | None = None) -> None:
        rec = chunks.get(p.chunk_index) if chunks else None
        if rec is not None and all(i == OUT_OF_SYNC for i in rec.values()):
            rec = None  # only withdrawals of a write never acknowledged: not a written chunk
        if layout.replicas == 1 and not self.view.moves:  # its one copy, where the stripe put it
            await self._read_replica(layout, p, p.shard_id, view, rec, False, versions)
            return
        placed, joining = self.view.placed(layout, p.chunk_index)
        reps = tuple(s for s in placed if s != joining)
        if len(reps) == 1:
            await self._read_replica(layout, p, reps[0], view, rec, False, versions)
            return
        if self._writing[(layout.file_id, p.chunk_index)]:
            # read your writes: this client's updates in flight reach the head first, and a read
            # sent after them on the same connection is applied after them (as with one replica)
            with contextlib.suppress(ReplicaFailed):
                await self._read_replica(layout, p, self.view.chain_of(layout, p.chunk_index)[0], view, rec, False,
                                         versions)
                return
        tried: set[int] = set()
        lost: DataLost | None = None
        refreshed = fresh = False
        for _ in range(2 * len(reps) + 1):
            cands = [s for s in reps if self.view.current(s) and s not in tried]  # in chain order
            if not cands:
                if lost is not None:
                    raise lost
                if not refreshed:  # the view may be older than the shard map: read it again once
                    refreshed = True
                    await self.view.refresh()
                    continue
                if rec is not None and any(i != OUT_OF_SYNC for i in rec.values()):
                    raise await self._unreadable(layout, p.chunk_index, rec)
                self.view.chain_of(layout, p.chunk_index)  # raises the error that says why
                break
            if rec is not None:  # never a replica out of the chunk's in-sync set (it missed updates)
                cands = [s for s in cands if rec.get(s) != OUT_OF_SYNC]
                if not cands:
                    if not fresh:  # the map may predate a resync that brought one back: read it again
                        fresh = True
                        rec = (await self.meta.chunk_map(layout.file_id)).get(p.chunk_index)
                        continue
                    raise await self._unreadable(layout, p.chunk_index, rec)
            known = [s for s in cands if rec is None or s in rec] or cands  # replicas written to
            tail = known[-1]
            pick = known[layout.read_turn(p.chunk_index) % len(known)]  # spread over the replicas
            try:
                try:
                    await self._read_replica(layout, p, pick, view, rec, pick != tail, versions)
                except Dirty:
                    pick = tail
                    await self._read_replica(layout, p, tail, view, rec, False, versions)
                return
            except DataLost as exc:
                lost = exc  # this replica lost it: another one may have it
                tried.add(pick)
            except ReplicaFailed as exc:
                log.warning("read of chunk %d of file %d: %s; reading another replica", p.chunk_index,
                            layout.file_id, exc)
        raise lost or ShardUnavailable(f"no replica of chunk {p.chunk_index} of file {layout.file_id} answered",
                                       "`irdma status` shows the shards; restart them with `irdma up`")

    async def _head_in_sync(self, layout: Layout, index: int, head: int) -> dict[int, int]:
        """A chunk's record read again when the caller's copy says ``head`` missed updates: the
        fresh record if the head is back in the chunk's in-sync set (a resync since), else
        the error a read of the chunk gives (an update applied to a copy that missed updates
        would be acknowledged and then never readable).

        Raises:
            DataLost, ShardUnavailable: see :meth:`_unreadable`.
        """
        rec = (await self.meta.chunk_map(layout.file_id)).get(index, {})
        if rec.get(head) == OUT_OF_SYNC:
            raise await self._unreadable(layout, index, rec)
        return rec

    async def _unreadable(self, layout: Layout, index: int, rec: dict[int, int]) -> IrdmaError:
        """Why no replica of a chunk can serve a read: its in-sync replicas (from the chunk map
        ``rec``) are down or catching up (ShardUnavailable naming them), or they lost their
        memory (DataLost)."""
        incs = {sid: r.incarnation for sid, r in self.view.shard_map.items()}
        insync = sorted(s for s, i in rec.items() if i != OUT_OF_SYNC and (not incs.get(s) or i == incs[s]))
        where = f"chunk {index} of file {layout.file_id}"
        if not insync:
            return self.lost(layout, index, min(rec), "and every replica holding all its acknowledged updates lost it")
        who = ", ".join(map(str, insync))
        return ShardUnavailable(f"{where}: its up-to-date copies are on shards {who}, which are down or catching up"
                                " (the other replicas missed updates)",
                                f"restart shards {who} (`irdma up`); `irdma status` shows them")

    async def _read_replica(self, layout: Layout, p: Piece, shard_id: int, view: memoryview,
                            rec: dict[int, int] | None, clean: bool, versions: list[int] | None = None) -> None:
        """Read one piece from one replica; a replica that failed is marked down (R > 1)."""
        inc = rec.get(shard_id) if rec is not None else None

        async def fn(conn: ShardConnection) -> None:
            if inc and inc != conn.info.incarnation:
                raise self.lost(layout, p.chunk_index, shard_id, "restarted with empty memory since")
            version = await conn.read(layout.file_id, p.chunk_index, p.chunk_offset, view,
                                      clean and not conn.one_sided_reads)
            if version == 0 and rec is not None:
                raise self.lost(layout, p.chunk_index, shard_id, "no longer has it (freed outside the namespace)")
            if versions is not None:
                versions.append(version)

        try:
            await self.pool.run(shard_id, fn, pull=True)
        except (Dirty, Fenced, ReplicaError):
            raise
        except ShardUnavailable as exc:
            if layout.replicas > 1:
                await self.view.mark_down(shard_id)
                raise ReplicaFailed(str(exc), shard_id) from None
            raise

    async def write_from(
        self, layout: Layout, offset: int, data: memoryview | bytes | np.ndarray, op: UpdateOp | Update, chunks: ChunkMap | None = None,
        *, compress: Compression | None = None, feedback: np.ndarray | None = None,
    ) -> list[NewChunk]:
        """Push ``data`` at ``offset`` with update op ``op`` (each chunk's part atomically).

        Each chunk's part goes to the head of the chunk's replication chain with a fresh request
        id and returns once every replica in the chain applied it (:meth:`ShardView.chain_of`). A replica
        that fails is marked down and the part is sent again with the same request id along the
        shorter chain, so it is applied exactly once on every replica; a file with one replica
        is retried once on a new connection after a lost reply. A chunk recorded in ``chunks``
        (the file's chunk map) is sent with FLAG_EXISTING, so a lost chunk is never recreated
        from zeros.

        Compressed gradients (``compress`` of kind topk or sign, with ``add`` or an optimizer;
        ignored with ``assign``): ``data`` is little-endian float32 and each piece (a chunk's
        part, cut so that its payload fits the shard's largest) is encoded once
        (:func:`irdma.wire.compress.encode`) and the payload sent, the same payload on a resend; the
        shards apply the op to the decoded gradient. ``feedback`` (float32, C-contiguous,
        ``len(data) // 4`` elements) receives, for each piece acknowledged, what its compression
        dropped: ``piece - decoded`` (error feedback: add it to the next gradient); the elements
        of a piece that failed are left as they were.

        Returns:
            ``(chunk index, shard id, incarnation)`` of every chunk replica written that
            ``chunks`` did not record: the caller records them (:meth:`MetaStore.extend`) before
            it reports the write durable.

        Raises:
            BadRequest: e.g. an ``add`` not aligned to float32; NoSpace: a shard is full;
            DataLost: a recorded chunk is gone; ShardUnavailable: no replica took it in time.
            InvalidArgument: a gradient to compress that is not finite, ``feedback`` of the
            wrong size or dtype, or an ``op`` that says it is encoded without ``compress``.
            Other chunks' parts may have been applied.
        """
        view = as_bytes_view(data)
        if self.cached is not None:  # read your writes: the chunks written are read from the shards again
            self.cached.invalidate(layout.file_id, offset, offset + len(view))
        update = as_update(op)
        if update.encoding and not compress:
            raise InvalidArgument("an encoded write needs its compression: pass compress=")
        coded = compress if compress and update.op.is_float32 else None
        if coded is not None:
            if offset % 4 or len(view) % 4:
                raise BadRequest(f"a compressed {update.op.name.lower()} must be float32 aligned: offset {offset},"
                                 f" {len(view)} bytes")
            if feedback is not None and (feedback.dtype != np.float32 or feedback.size != len(view) // 4
                                         or not feedback.flags.c_contiguous):
                raise InvalidArgument(f"feedback must be C-contiguous float32 of {len(view) // 4} elements,"
                                      f" not {feedback.dtype} of {feedback.size}")
            op = dataclasses.replace(update, encoding=coded.kind)
            limit = self.max_piece(layout) or DEFAULT_MAX_PAYLOAD
            max_piece: int | None = 4 * max(1, compress_max_elements(limit, coded))
        else:
            op = update.dense if update.encoding else op
            max_piece = self.max_piece(layout)
        pieces = list(layout.pieces(offset, len(view), max_piece))
        created: list[NewChunk] = []
        fb = None if coded is None or feedback is None else feedback.reshape(-1)
        if len(pieces) == 1:
            await self._write_piece(layout, pieces[0], view, op, chunks, created, coded, fb)
        else:
            push_id = self.request_id()  # each piece is tagged a part of it: a snapshot takes all or none
            async with open_nursery() as nursery:
                for k, p in enumerate(pieces):
                    nursery.start_soon(self._write_piece, layout, p, view[p.buf_offset : p.buf_offset + p.length], op,
                                       chunks, created, coded,
                                       None if fb is None else fb[p.buf_offset // 4 : (p.buf_offset + p.length) // 4],
                                       Part(push_id, k, len(pieces)))
        return created

    async def _write_piece(self, layout: Layout, p: Piece, data: memoryview, op: UpdateOp | Update, chunks: ChunkMap | None,
                           created: list[NewChunk], coded: Compression | None = None,
                           feedback: np.ndarray | None = None, part: Part | None = None) -> None:
        if coded is not None:
            dense = np.frombuffer(data, dtype="<f4")
            try:
                # once: a resend carries the same bytes; a large piece off the event loop (numpy
                # sorts and packs without the GIL, so pieces encode in parallel)
                if len(dense) >= ENCODE_IN_THREAD:
                    payload, decoded = await trio.to_thread.run_sync(compress_encode, dense, coded)
                else:
                    payload, decoded = compress_encode(dense, coded)
            except ValueError as exc:
                raise InvalidArgument(f"cannot compress the gradient at byte {p.buf_offset}: {exc}") from None
            data = memoryview(payload)

        async def send(conn: ShardConnection, existing: bool, chain: Chain) -> None:
            await conn.write(layout.file_id, p.chunk_index, layout.chunk_size, p.chunk_offset, op, data, existing,
                             chain if part is None else dataclasses.replace(chain, part=part))

        await self.chained_update(layout, (p.chunk_index,), send, chunks, created, self.request_id(), "write")
        if coded is not None and feedback is not None:
            np.subtract(dense, decoded, out=feedback)

    async def chained_update(self, layout: Layout, indices: Sequence[int],
                              send: Callable[[ShardConnection, bool, Chain], Awaitable[None]],
                              chunks: ChunkMap | None, created: list[NewChunk], rid: int, what: str,
                              parted: Callable[[], Awaitable[bool]] | None = None) -> None:
        """The one retry engine of every chained update (a write's piece, a SCATTER): ``send``
        the update to the head of the chain of chunks ``indices`` (which share one chain) with
        request id ``rid``, and again with the same id after a failure that allows it
        (:meth:`_before_resend`), along the chain the view gives then; exactly once on every
        replica (the shards keep each request id's result: chain replication, van Renesse and
        Schneider, OSDI 2004).

        ``send(conn, existing, chain)`` sends on the head's connection; ``existing`` says the
        head's copy is recorded (FLAG_EXISTING: a lost chunk is never recreated from zeros).
        ``parted``, called before each attempt, splits the update when the chunks' chains no
        longer agree: it sends the parts itself (same id) and returns True.

        Each chunk replica written that ``chunks`` did not record is appended to ``created``.

        Raises:
            What the last attempt raised (see :meth:`write_from`).
        """
        keys = [(layout.file_id, c) for c in indices]
        for key in keys:
            self._writing[key] += 1  # a read of the chunk meanwhile goes to its head (see _read_piece)
        try:
            await self._chain_attempts(layout, indices, send, chunks, created, rid, what, parted)
        finally:
            for key in keys:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]

    async def _chain_attempts(self, layout: Layout, indices: Sequence[int],
                              send: Callable[[ShardConnection, bool, Chain], Awaitable[None]],
                              chunks: ChunkMap | None, created: list[NewChunk], rid: int, what: str,
                              parted: Callable[[], Awaitable[bool]] | None) -> None:
        single = layout.replicas == 1
        c0 = indices[0]
        last: IrdmaError | None = None
        refreshed = False
        for _ in range(MAX_ATTEMPTS if not single else 2):
            if parted is not None and await parted():
                return
            try:
                view = self.view.epoch  # the chain's view: the update carries it, however long it waits
                chain = self.view.chain_of(layout, c0)
            except ShardUnavailable as exc:
                # this client's view may be older than the shard map (a replica that caught
                # up since its last heartbeat): read it again once before failing the update
                if refreshed:
                    raise
                last, refreshed = exc, True
                await self.view.refresh()
                continue
            head = chain[0]
            recs = {c: chunks.get(c) if chunks else None for c in indices}
            for c, rc in recs.items():
                if rc is not None and rc.get(head) == OUT_OF_SYNC:
                    recs[c] = await self._head_in_sync(layout, c, head)
            rec = recs[c0]
            existing = rec is not None and (head in rec or single)
            inc = rec.get(head) if rec is not None else None

            async def fn(conn: ShardConnection, chain: tuple[int, ...] = chain, head: int = head,
                         existing: bool = existing, inc: int | None = inc, view: int = view) -> None:
                if inc and inc != conn.info.incarnation:
                    if single:
                        raise self.lost(layout, c0, head, "restarted with empty memory since")
                    raise ReplicaFailed(f"shard {head} restarted with empty memory", head)
                await send(conn, existing, self.view.chain(rid, chain[1:], view))

            try:
                await self.view.withdraw(layout, indices, chain, view)
                await self.pool.run(head, fn)
            except IrdmaError as exc:
                await self._before_resend(exc, head, single, what)
                last = exc
                continue
            self.note_unsynced(chain, single)
            for c, rc in recs.items():
                for sid in chain:
                    if rc is None or sid not in rc:
                        created.append((c, sid, await self.pool.incarnation(sid)))
            return
        assert last is not None
        raise last

    async def _before_resend(self, exc: IrdmaError, head: int, single: bool, what: str) -> None:
        """What a chained update (a write's piece or a scatter) that failed with ``exc`` does
        before it is sent again with the same request id; raises ``exc`` when it must not be.

        A failed replica is marked down (applied up to it: the shorter chain takes the resend);
        a fence or a lost chunk reads the shard map again (a move may have taken the chunk from
        this view's head; a lost chunk fails unless the view changed); a file of one replica is
        sent once more after a lost reply or a broken connection, unless its shard missed its
        deadline; a failed head of a replicated chunk is marked down.
        """
        if isinstance(exc, ReplicaFailed):
            if self.view.current(exc.shard_id):  # once per failure, not once per request in flight
                log.warning("replica %d failed during a %s: %s; going on without it", exc.shard_id, what,
                            exc.args[0])
            await self.view.mark_down(exc.shard_id)
        elif isinstance(exc, Fenced):
            await self.view.refresh()
        elif isinstance(exc, DataLost):
            view = self.view.epoch
            await self.view.refresh()
            if self.view.epoch == view:
                raise exc
        elif isinstance(exc, ShardUnavailable):
            if single:
                if trio.current_time() < self.pool.down_until.get(head, 0.0):
                    raise exc  # missed its deadline: not tried again now
                return
            if self.view.current(head):
                log.warning("head replica %d failed during a %s: %s; going on without it", head, what, exc.args[0])
            await self.view.mark_down(head)
        else:
            raise exc  # BadRequest, NoSpace and the rest: the caller hears them

    async def flush(self) -> None:
        """Return once every write this client made so far is durable on its shards (SYNC to
        each shard written since the last flush, every replica of the chains written included:
        ``msync``/``fsync`` on shards with a data directory and durability ``fsync``). What
        ``fsync(2)`` and ``close(2)`` on a mount wait for.

        Raises:
            ShardUnavailable: a shard failed or missed the deadline; its writes are flushed again
                by the next call.
        """
        async with self._flush_lock:
            shards, self._unsynced = self._unsynced, set()
            single, self._unsynced_single = self._unsynced_single, set()
            if not shards:
                return
            try:
                async with open_nursery() as nursery:
                    for sid in shards:
                        nursery.start_soon(self._sync_one, sid, sid in single)
            except BaseException:
                self._unsynced |= shards
                self._unsynced_single |= single
                raise

    async def _sync_one(self, shard_id: int, only_copy: bool) -> None:
        try:
            await self.pool.call(shard_id, ShardConnection.sync)
        except ShardUnavailable:
            if only_copy:
                raise
            await self.view.mark_down(shard_id)
            # a replica that went down since: it is out of the chains and resynced (from a
            # durable copy on the others) when it comes back
            log.warning("shard %d is down: its replicas were not synced; the others were", shard_id)

    def max_piece(self, layout: Layout) -> int | None:
        sizes = [c.info.max_payload for c in self.pool.conns.values()]
        most = min(sizes) if sizes else DEFAULT_MAX_PAYLOAD
        cut = comm.current().slice_bytes  # P3's slices (irdma.train.comm.priority)
        return min(most, cut) if cut else most

    async def truncate_data(self, layout: Layout, new_size: int) -> None:
        """Drop the bytes of a file from ``new_size`` on, on every shard of its stripe (every
        replica). With replicas, a shard that fails is marked down instead: it is resynced when
        it comes back, and what it kept past the end is freed by ``irdma gc``."""
        first_free = layout.chunk_count(new_size)
        skipped: set[int] = set()  # replicas that kept bytes the others dropped
        if self.cached is not None:
            self.cached.invalidate(layout.file_id, size=new_size)

        async def one(shard_id: int, fn: Callable[..., Awaitable[int]], *args: int) -> None:
            if layout.replicas > 1 and self.view.health.get(shard_id) == "down":
                skipped.add(shard_id)
                return  # its resync drops what the others no longer have
            try:
                await self.pool.call(shard_id, fn, *args)
            except ShardUnavailable as exc:
                if layout.replicas == 1:
                    raise
                log.warning("shard %d failed to %s file %d: %s; marked down", shard_id, fn.__name__, layout.file_id, exc)
                skipped.add(shard_id)
                await self.view.mark_down(shard_id)

        async with open_nursery() as nursery:
            for shard_id in self.view.shards_of(layout):
                if self.view.shard_map.get(shard_id) is not None and self.view.shard_map[shard_id].state in ("drained", "removed"):
                    continue
                nursery.start_soon(one, shard_id, ShardConnection.free, layout.file_id, first_free)
            if new_size % layout.chunk_size:
                index = new_size // layout.chunk_size
                for shard_id in self.view.placed(layout, index)[0]:
                    nursery.start_soon(one, shard_id, ShardConnection.punch, layout.file_id, index,
                                       new_size % layout.chunk_size)
        if layout.replicas > 1 and not any(self.view.current(s) for s in self.view.shards_of(layout)):
            raise ShardUnavailable(f"no shard of file {layout.file_id} is up", "restart the shards (`irdma up`)")
        if skipped and new_size % layout.chunk_size:  # the cut chunk's copy there kept its old tail
            index = new_size // layout.chunk_size
            for _ in range(MAX_ATTEMPTS):
                # only while it is still out of the view: once back, its resync compares the chunk
                out = [(index, s) for s in self.view.placed(layout, index)[0] if s in skipped and not self.view.in_view(s)
                       and self.view.health.get(s) != "syncing"]
                if not out or await self.meta.withdraw_replicas(layout.file_id, out, self.view.epoch):
                    break
                await self.view.refresh()
            else:
                raise ShardUnavailable(f"the shard map kept changing while file {layout.file_id} was truncated",
                                       "truncate it again")
