"""The native client: striping, placement and update ops over a namespace of files.

A file's bytes are striped in chunks over its stripe of shards (see :mod:`irdma.placement`);
requests to different shards run concurrently, several in flight per shard. Parameters are
little-endian float32 in C order unless the caller says otherwise: a tensor of shape ``S`` is
the bytes ``[0, 4*prod(S))`` of its file.

Use it from trio::

    async with irdma.Client.open("sqlite:///tmp/c/meta.db") as client:
        await client.write("/w/dense/kernel", weights)          # assign
        await client.set_update_op("/w/dense/kernel", "add")
        await client.push("/w/dense/kernel", -lr * grad)         # add on the shards
        w = await client.pull("/w/dense/kernel", shape=(64, 10))

or synchronously with :func:`irdma.connect`.

Never lies, never hangs: every request to a shard has a deadline (``timeout``, 10 s by
default; a shard that misses it gets its connection closed and the caller ShardUnavailable);
a chunk the metadata records as written (the file's *chunk map*) that its shard no longer has,
or that was written to an earlier incarnation of the shard's memory, raises DataLost instead
of reading as zeros, and a write to it is refused rather than recreating it from zeros.
Metadata calls run in worker threads (:class:`irdma.meta.aio.AsyncMeta`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

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
    IsADirectory,
    NoAttribute,
    NotFound,
    ReadOnly,
    ReplicaError,
    ReplicaFailed,
    ShardUnavailable,
)
from ..meta import Inode, MetaStore, ShardRecord, open_meta
from ..meta.aio import AsyncMeta
from ..meta.base import OUT_OF_SYNC, XATTR_SHAPE, XATTR_UPDATE, parse_shape
from ..placement import Layout, Move, Piece, substitute
from ..train import comm, coord
from ..train.optimizers import HEADER, MAGIC, SLOT_NAMES, SLOTS, parse_update, state_index, state_size
from ..transport import ShardConnection, Transport, make_transport
from ..wire import auth
from ..wire.compress import Compression, parse_compress
from ..wire.compress import encode as compress_encode
from ..wire.compress import max_elements as compress_max_elements
from ..wire.extents import move, positions
from ..wire.protocol import DEFAULT_MAX_PAYLOAD, Chain, ChunkEntry, Part, StatReply, Update, UpdateOp, as_update
from ..wire.protocol import extents as P_extents
from . import snapshots as _snaps
from .cache import ChunkCache
from .pool import ShardPool
from .readcache import CachedReads
from .snapshots import SnapshotInfo

#: Requests in flight per shard connection.
DEFAULT_WINDOW = 16
#: Seconds a request to a shard may take (queueing, connecting and the transfer together).
DEFAULT_TIMEOUT = 10.0
#: What to do about a shard that failed a request.

#: Attempts of one update (a failed replica or a new view each cost one).
MAX_ATTEMPTS = 6
#: Most extents one GATHER or SCATTER carries (a verbs SCATTER of them stays under 256 batches).
MAX_EXTENTS = 1 << 16
#: Float32 elements of a piece from which it is compressed in a worker thread.
ENCODE_IN_THREAD = 1 << 16
#: Seconds between mtime refreshes by sparse pushes that neither grow a file nor make chunks.
MTIME_LAZY_S = 1.0

#: A file's chunk map: chunk index -> {shard id: incarnation of the shard's memory when the
#: chunk was written there}, one entry per replica.
ChunkMap = dict[int, dict[int, int]]
#: Chunk replicas a write created: (chunk index, shard id, incarnation), for the chunk map.
NewChunk = tuple[int, int, int]

log = logging.getLogger("irdma.client")
_T = TypeVar("_T")


def _writable(inode: Inode, path: str) -> None:
    """Raise ReadOnly (EROFS) for a file of a snapshot, before anything is sent."""
    if inode.snap:
        raise ReadOnly(f"{path} is in a snapshot, which is read-only", "write to the live file instead")


def layout_of(inode: Inode) -> Layout:
    """The placement of a file's chunks."""
    if inode.is_dir:
        raise IsADirectory(f"inode {inode.ino} is a directory")
    assert inode.chunk_size is not None
    return Layout(inode.ino, inode.chunk_size, inode.stripe, inode.replicas, inode.place)


def _pack(src: np.ndarray, at: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The bytes ``src[at[k] : at[k] + length[k]]`` one after the other."""
    pos = positions(length)
    out = np.empty(int(pos[-1]), dtype=np.uint8)
    move(out, pos[:-1], src, at, length)
    return out


def _as_bytes_view(data: object) -> memoryview:
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        view = memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]
    return view.cast("B")


def _compression(value: Compression | str | bytes | None) -> Compression | None:
    """A compression given as an object or an xattr value (None and ``none``: None).

    Raises:
        ValueError: a bad value.
    """
    if value is None or isinstance(value, Compression):
        return value or None
    return parse_compress(value) or None


class Client:
    """A connection to one irdma namespace: its metadata engine and its shards.

    Create with :meth:`open`. Every method is a trio coroutine and may run concurrently.

    Args:
        meta: the metadata engine (its calls run in worker threads: ``client.meta`` is the
            awaitable :class:`AsyncMeta`, ``client.store`` the engine itself).
        transport: how to reach shards.
        nursery: where connection tasks live.
        keys: the cluster key to prove to shards (:mod:`irdma.wire.auth`), read again when its file
            changes; None to connect without one (shards with a key refuse it).
        window: requests in flight per shard, for pulls and for the rest each; waiting ones are admitted by priority
            (:func:`irdma.train.comm.priority`: P3, lower levels first), FIFO among equal levels.
        timeout: seconds each request to a shard may take, queueing and connecting included.
        cache: the local read cache (:class:`irdma.client.cache.ChunkCache`: memory and disk
            tiers of whole chunks, validated by chunk version at each open; see
            :meth:`cache_open`), or None for none.
    """

    def __init__(
        self,
        meta: MetaStore,
        transport: Transport,
        nursery: trio.Nursery,
        *,
        keys: auth.KeySource | None = None,
        window: int = DEFAULT_WINDOW,
        client_name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        cache: ChunkCache | None = None,
    ) -> None:
        self.store = meta
        self.meta = AsyncMeta(meta)
        self.timeout = timeout
        self._health: dict[int, str] = {}
        self._unsynced: set[int] = set()  # shards written since the last flush
        self._unsynced_single: set[int] = set()  # those of them written the only copy of a chunk
        self._flush_lock = trio.Lock()  # a flush returns only after the one in flight covered it
        self.transport = transport
        #: the connections to the shards, their windows and deadlines (:mod:`irdma.client.pool`)
        self.pool = ShardPool(self, transport, nursery, keys, client_name or f"irdma-client pid {os.getpid()}",
                              window)
        self._shard_map: dict[int, ShardRecord] = {}
        self._view = 0  # the shard map's epoch this client acts on (sent with every update)
        self._moves: list[Move] = []  # the view's moves of chunks between shards, oldest first
        self._writing: collections.Counter[tuple[int, int]] = collections.Counter()  # updates in flight per chunk
        self._request_base = int.from_bytes(os.urandom(8), "big")
        self._mtime_at: dict[int, float] = {}  # when push_rows last refreshed a file's mtime (monotonic s)
        self._request_seq = 0
        # replicas this client took out of their chunks' in-sync sets in this view:
        # (file id, chunk index, shard id); forgotten when the view changes
        self._withdrawn: set[tuple[int, int, int]] = set()
        self._withdrawn_view = -1
        from .moves import ShardMoves  # here, not at the top: irdma.client.moves imports this module

        self._admin = ShardMoves(self)  # resync, drain, rebalance, removal
        #: the local read cache and the files validated at their open (:mod:`irdma.client.readcache`)
        self.cached = CachedReads(self, cache) if cache is not None and cache.enabled else None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        meta_url: str,
        *,
        transport: str | Transport = "auto",
        key_file: str | None = None,
        window: int = DEFAULT_WINDOW,
        client_name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        cache: ChunkCache | None = None,
    ) -> AsyncIterator[Client]:
        """Open the namespace at ``meta_url`` (see :func:`irdma.meta.open_meta`).

        ``key_file``: the cluster's key file; default ``$IRDMA_KEY_FILE``, else ``cluster.key``
        beside a SQLite namespace (where ``irdma up`` puts it), else none. ``cache``: a local
        read cache (:class:`irdma.client.cache.ChunkCache`); its disk tier is opened here.

        Raises:
            NotFound: no metadata database there.
            InvalidArgument: the key file cannot be read, or others may read it.
            TransportUnavailable: ``transport="verbs"`` where verbs cannot run.
            InvalidArgument: the cache directory cannot be written.
        """
        if cache is not None:
            await trio.to_thread.run_sync(cache.attach, meta_url)
        keys = auth.KeySource(key_file or auth.default_key_file(meta_url))
        tr = make_transport(transport) if isinstance(transport, str) else transport
        meta = await trio.to_thread.run_sync(open_meta, meta_url)
        if hasattr(meta, "busy_timeout"):  # a wait for the database's write lock has the same deadline
            meta.busy_timeout = timeout
        try:
            async with open_nursery() as nursery:
                client = cls(meta, tr, nursery, keys=keys, window=window, client_name=client_name,
                             timeout=timeout, cache=cache)
                await client.refresh_view()
                try:
                    yield client
                finally:
                    await client.aclose()
                    nursery.cancel_scope.cancel()
        finally:
            meta.close()
            if cache is not None:  # its disk writes behind the reads land before the client is gone
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(cache.close)

    async def aclose(self) -> None:
        """Close every shard connection. Safe to call twice."""
        await self.pool.aclose()

    # ------------------------------------------------------------ shard connections
    async def connection(self, shard_id: int) -> ShardConnection:
        """The connection to shard ``shard_id`` (:meth:`ShardPool.connection`)."""
        return await self.pool.connection(shard_id)

    async def _note_health(self, shard_id: int, health: str) -> None:
        """Record a shard's health in the shard map when it changes (best effort)."""
        if self._health.get(shard_id) == health:
            return
        # the health the chains are built from changes only with the view it belongs to: a shard
        # back after being down is ``syncing`` (the tail of its chains), never up before resynced
        try:
            recorded, epoch = await self.meta.set_shard_health(shard_id, health)
        except IrdmaError as exc:
            log.warning("cannot record shard %d as %s: %s", shard_id, health, exc)
            return
        if epoch != self._view:  # chains changed (here or elsewhere): act on the new view
            await self.refresh_view()
        else:
            self._health[shard_id] = recorded

    async def _drop(self, shard_id: int, conn: ShardConnection) -> None:
        await self.pool.drop(shard_id, conn)

    async def _on_shard(self, shard_id: int, fn: Callable[[ShardConnection], Awaitable[_T]], probe: bool = False,
                        pull: bool = False) -> _T:
        """Run ``fn(connection)`` against a shard within the client's deadline (:meth:`ShardPool.run`)."""
        return await self.pool.run(shard_id, fn, probe, pull)

    def _where(self, shard_id: int) -> str:
        rec = self._shard_map.get(shard_id)
        return f"shard {shard_id}" + (f" at {rec.address}" if rec else "")

    async def _conn_call(self, shard_id: int, fn_name: str, *args: object, probe: bool = False) -> object:
        async def fn(conn: ShardConnection) -> object:
            return await getattr(conn, fn_name)(*args)

        return await self._on_shard(shard_id, fn, probe)

    def forget_file(self, file_id: int) -> None:
        """Drop what the connections cache of a file (called when a mount opens it: close-to-open)."""
        self.pool.forget_file(file_id)

    # ------------------------------------------------------------ replication chains
    async def refresh_view(self) -> None:
        """Read the shard map and its epoch again (the view requests carry)."""
        self._view, records, self._moves = await self.meta.shard_view()
        self._shard_map = {r.shard_id: r for r in records}
        for r in records:
            if r.health == "up" and self._health.get(r.shard_id) in ("down", "syncing"):
                # back and resynced since this client saw it fail (a restart that `irdma up`
                # or another mount resynced): its old deadline no longer holds it out
                self.pool.down_until.pop(r.shard_id, None)
            self._health[r.shard_id] = r.health

    def placed(self, layout: Layout, index: int) -> tuple[tuple[int, ...], int | None]:
        """A chunk's replicas in this client's view, head first, and the one joining them
        (the target of a move in progress: the tail, never read) or None
        (:func:`irdma.placement.substitute`)."""
        return substitute(layout.replicas_of(index), self._moves, layout.placed_as + index, file_id=layout.placed_as)

    def shards_of(self, layout: Layout) -> set[int]:
        """Every shard that may hold a chunk of the file: its stripe and where moves took them,
        less the shards drained or removed since (a finished drain freed their copies; one that
        a rebalance once fed and was then drained holds nothing either)."""
        out = set(layout.stripe)
        for m in self._moves:
            if m.shard_id in out:
                out.update(m.targets)
        gone = {s for s in out if (rec := self._shard_map.get(s)) is not None and rec.state in ("drained", "removed")}
        return out - gone

    def _feeding(self, shard_id: int) -> list[int]:
        """``shard_id`` and every shard whose chunks moves may have taken to it (so files
        striped over any of them may have a chunk there)."""
        out = {shard_id}
        while True:
            more = {m.shard_id for m in self._moves if out & set(m.targets)} - out
            if not more:
                return sorted(out)
            out |= more

    def _in_view(self, shard_id: int) -> bool:
        """Whether the view this client acts on has the shard up to date (neither down nor
        catching up): what a chain is built from, so every client of one view builds the same."""
        rec = self._shard_map.get(shard_id)
        return self._health.get(shard_id, rec.health if rec else "unknown") not in ("down", "syncing")

    def _current(self, shard_id: int) -> bool:
        """Whether a shard may serve a read: up to date in the view, and it has not failed this
        client in the last deadline."""
        return self._in_view(shard_id) and trio.current_time() >= self.pool.down_until.get(shard_id, 0.0)

    def chain_of(self, layout: Layout, index: int) -> tuple[int, ...]:
        """The replicas a chunk's updates go through now, head first: its replicas that are up,
        in placement order, then those catching up (syncing) as the tail. A file with one
        replica always uses it.

        Raises:
            ShardUnavailable: no replica of the chunk is up to date.
        """
        reps, joining = self.placed(layout, index)
        if len(reps) == 1:
            return reps
        up = [s for s in reps if s != joining and self._in_view(s)]
        if not up:
            raise ShardUnavailable(
                f"no up-to-date replica of chunk {index} of file {layout.file_id}: shards"
                f" {', '.join(map(str, reps))} are down or catching up",
                "restart the shards (`irdma up`); `irdma status` shows them",
            )
        syncing = [s for s in reps if s not in up and s != joining and self._health.get(s) == "syncing"]
        tail = [joining] if joining is not None and self._health.get(joining) not in ("down",) else []
        return tuple(up + syncing + tail)

    def _request_id(self) -> int:
        """A fresh request id (never 0); ids step by 256 so a transport may number sub-requests."""
        self._request_seq += 1
        return ((self._request_base + (self._request_seq << 8)) & 0xFFFFFFFFFFFFFFFF) or 1 << 8

    def _chain(self, request_id: int, successors: Sequence[int], view: int | None = None) -> Chain:
        """The chain message of an update: ``view`` is the epoch its chain was built in (default
        this client's now); an update must carry the view of its chain, never a newer one, or a
        shard fenced at the newer view would take an update that skipped a replica resynced
        meanwhile."""
        return Chain(request_id, self._view if view is None else view, 0, max(1, int(self.timeout * 500)),
                     tuple((s, self._shard_map[s].address) for s in successors))

    async def _incarnation(self, shard_id: int) -> int:
        """The incarnation of a shard's memory (connecting to it if this client has not yet; 0
        when it cannot be reached)."""
        conn = self.pool.conns.get(shard_id)
        if conn is None:
            with contextlib.suppress(ShardUnavailable), trio.move_on_after(self.timeout):
                conn = await self.connection(shard_id)
        return conn.info.incarnation if conn is not None else self._shard_map[shard_id].incarnation

    async def _mark_down(self, shard_id: int) -> None:
        """A replica failed: out of the chains (the shard map's epoch moves on)."""
        self.pool.down_until[shard_id] = trio.current_time() + self.timeout
        await self._note_health(shard_id, "down")

    async def _withdraw(self, layout: Layout, indices: Sequence[int], chain: Sequence[int], view: int) -> None:
        """Before an update of chunks ``indices`` is sent down ``chain``: take the chunks'
        replicas that the chain skips (their shards are down) out of the chunks' in-sync sets
        in the chunk map (:meth:`MetaStore.withdraw_replicas`), durably, so that recovery never
        counts a copy that missed an acknowledged update as current. Once per replica and view;
        nothing to do when the chain has every replica.

        Raises:
            Fenced: the shard map moved on since this view (read it again, then build the chain
                again: the shard may be back); nothing recorded.
            IrdmaError: the metadata engine failed (the update must not be sent).
        """
        if layout.replicas == 1:
            return
        if self._withdrawn_view != view:
            self._withdrawn.clear()
            self._withdrawn_view = view
        todo: list[tuple[int, int]] = []
        for index in indices:
            reps, _ = self.placed(layout, index)
            if len(chain) >= len(reps):
                continue
            todo += [(index, s) for s in reps
                     if s not in chain and (layout.file_id, index, s) not in self._withdrawn]
        if todo:
            if not await self.meta.withdraw_replicas(layout.file_id, todo, view):
                raise Fenced(f"the shard map moved on from view {view} before an update that skips shards"
                             f" {sorted({s for _, s in todo})}", "read the shard map again")
            self._withdrawn.update((layout.file_id, index, s) for index, s in todo)

    # ------------------------------------------------------------ data plane by layout
    @staticmethod
    def _lost(layout: Layout, index: int, shard_id: int, why: str) -> DataLost:
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
        if 0 < n <= cs - within and offset >= 0 and n <= (self._max_piece(layout) or n):
            pieces = [Piece(layout.shard_of(index), index, within, n, 0)]  # a small read: no generator
        else:
            pieces = list(layout.pieces(offset, n, self._max_piece(layout)))
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
                view = self._view
                await self.refresh_view()
                if attempt or self._view == view:
                    raise

    async def _read_piece(self, layout: Layout, p: Piece, view: memoryview, chunks: ChunkMap | None,
                          versions: list[int] | None = None) -> None:
        rec = chunks.get(p.chunk_index) if chunks else None
        if rec is not None and all(i == OUT_OF_SYNC for i in rec.values()):
            rec = None  # only withdrawals of a write never acknowledged: not a written chunk
        if layout.replicas == 1 and not self._moves:  # its one copy, where the stripe put it
            await self._read_replica(layout, p, p.shard_id, view, rec, False, versions)
            return
        placed, joining = self.placed(layout, p.chunk_index)
        reps = tuple(s for s in placed if s != joining)
        if len(reps) == 1:
            await self._read_replica(layout, p, reps[0], view, rec, False, versions)
            return
        if self._writing[(layout.file_id, p.chunk_index)]:
            # read your writes: this client's updates in flight reach the head first, and a read
            # sent after them on the same connection is applied after them (as with one replica)
            with contextlib.suppress(ReplicaFailed):
                await self._read_replica(layout, p, self.chain_of(layout, p.chunk_index)[0], view, rec, False,
                                         versions)
                return
        tried: set[int] = set()
        lost: DataLost | None = None
        refreshed = fresh = False
        for _ in range(2 * len(reps) + 1):
            cands = [s for s in reps if self._current(s) and s not in tried]  # in chain order
            if not cands:
                if lost is not None:
                    raise lost
                if not refreshed:  # the view may be older than the shard map: read it again once
                    refreshed = True
                    await self.refresh_view()
                    continue
                if rec is not None and any(i != OUT_OF_SYNC for i in rec.values()):
                    raise await self._unreadable(layout, p.chunk_index, rec)
                self.chain_of(layout, p.chunk_index)  # raises the error that says why
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
        incs = {sid: r.incarnation for sid, r in self._shard_map.items()}
        insync = sorted(s for s, i in rec.items() if i != OUT_OF_SYNC and (not incs.get(s) or i == incs[s]))
        where = f"chunk {index} of file {layout.file_id}"
        if not insync:
            return self._lost(layout, index, min(rec), "and every replica holding all its acknowledged updates lost it")
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
                raise self._lost(layout, p.chunk_index, shard_id, "restarted with empty memory since")
            version = await conn.read(layout.file_id, p.chunk_index, p.chunk_offset, view,
                                      clean and not conn.one_sided_reads)
            if version == 0 and rec is not None:
                raise self._lost(layout, p.chunk_index, shard_id, "no longer has it (freed outside the namespace)")
            if versions is not None:
                versions.append(version)

        try:
            await self._on_shard(shard_id, fn, pull=True)
        except (Dirty, Fenced, ReplicaError):
            raise
        except ShardUnavailable as exc:
            if layout.replicas > 1:
                await self._mark_down(shard_id)
                raise ReplicaFailed(str(exc), shard_id) from None
            raise

    async def write_from(
        self, layout: Layout, offset: int, data: memoryview | bytes | np.ndarray, op: UpdateOp | Update, chunks: ChunkMap | None = None,
        *, compress: Compression | None = None, feedback: np.ndarray | None = None,
    ) -> list[NewChunk]:
        """Push ``data`` at ``offset`` with update op ``op`` (each chunk's part atomically).

        Each chunk's part goes to the head of the chunk's replication chain with a fresh request
        id and returns once every replica in the chain applied it (:meth:`chain_of`). A replica
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
        view = _as_bytes_view(data)
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
            limit = self._max_piece(layout) or DEFAULT_MAX_PAYLOAD
            max_piece: int | None = 4 * max(1, compress_max_elements(limit, coded))
        else:
            op = update.dense if update.encoding else op
            max_piece = self._max_piece(layout)
        pieces = list(layout.pieces(offset, len(view), max_piece))
        created: list[NewChunk] = []
        fb = None if coded is None or feedback is None else feedback.reshape(-1)
        if len(pieces) == 1:
            await self._write_piece(layout, pieces[0], view, op, chunks, created, coded, fb)
        else:
            push_id = self._request_id()  # each piece is tagged a part of it: a snapshot takes all or none
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

        await self._chained_update(layout, (p.chunk_index,), send, chunks, created, self._request_id(), "write")
        if coded is not None and feedback is not None:
            np.subtract(dense, decoded, out=feedback)

    async def _chained_update(self, layout: Layout, indices: Sequence[int],
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
                view = self._view  # the chain's view: the update carries it, however long it waits
                chain = self.chain_of(layout, c0)
            except ShardUnavailable as exc:
                # this client's view may be older than the shard map (a replica that caught
                # up since its last heartbeat): read it again once before failing the update
                if refreshed:
                    raise
                last, refreshed = exc, True
                await self.refresh_view()
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
                        raise self._lost(layout, c0, head, "restarted with empty memory since")
                    raise ReplicaFailed(f"shard {head} restarted with empty memory", head)
                await send(conn, existing, self._chain(rid, chain[1:], view))

            try:
                await self._withdraw(layout, indices, chain, view)
                await self._on_shard(head, fn)
            except IrdmaError as exc:
                await self._before_resend(exc, head, single, what)
                last = exc
                continue
            if single:
                self._unsynced_single.add(head)
            for sid in chain:
                self._unsynced.add(sid)
            for c, rc in recs.items():
                for sid in chain:
                    if rc is None or sid not in rc:
                        created.append((c, sid, await self._incarnation(sid)))
            return
        assert last is not None
        raise last

    @staticmethod
    def row_extents(layout: Layout, ids: np.ndarray, row_bytes: int) -> tuple[np.ndarray, ...]:
        """The extents of rows ``ids`` (distinct, int64) of ``row_bytes`` bytes each: a row
        that crosses a chunk boundary is two (or more) extents.

        Returns:
            ``(chunk, offset, length, at)``, int64 arrays sorted by chunk and offset: each extent's chunk
            index, byte offset in the chunk, bytes, and byte position in the packed rows
            (row ``ids[k]`` at ``k * row_bytes``).
        """
        cs = layout.chunk_size
        cur = ids.astype(np.int64) * row_bytes
        end = cur + row_bytes
        at = np.arange(len(ids), dtype=np.int64) * row_bytes
        parts: list[tuple[np.ndarray, ...]] = []
        while len(cur):
            c = cur // cs
            n = np.minimum(end, (c + 1) * cs) - cur
            parts.append((c, cur - c * cs, n, at))
            more = cur + n < end
            cur, at, end = (cur + n)[more], (at + n)[more], end[more]
        chunk, offset, length, at = (np.concatenate([q[k] for q in parts]) for k in range(4))
        order = np.lexsort((offset, chunk))  # ascending within each chunk: the shard walks its memory in order
        return chunk[order], offset[order], length[order], at[order]

    def _batches(self, chunk: np.ndarray, length: np.ndarray, sel: np.ndarray, limit: int) -> list[np.ndarray]:
        """``sel`` (extent positions) cut into requests whose bytes plus 24 per extent fit
        ``limit``, of at most MAX_EXTENTS extents each.

        Raises:
            InvalidArgument: one extent alone does not fit a request (a row larger than the
                shards' payload limit: pull or push it with ``read``/``write``).
        """
        if len(sel) and int(length[sel].max()) + 24 > limit:
            raise InvalidArgument(f"a row piece of {int(length[sel].max())} bytes exceeds the shards' payload limit"
                                  f" of {limit} bytes: use read/write (or pull/push) for rows this large")
        cost = np.cumsum(length[sel] + 24)
        out, start, base = [], 0, 0
        while start < len(sel):
            stop = int(np.searchsorted(cost, base + limit, side="right"))
            stop = min(max(stop, start + 1), start + MAX_EXTENTS)
            out.append(sel[start:stop])
            base, start = int(cost[stop - 1]), stop
        return out

    async def read_rows_into(self, layout: Layout, ids: np.ndarray, row_bytes: int, into: memoryview,
                             chunks: ChunkMap | None = None) -> None:
        """Pull rows ``ids`` (distinct, in-range, int64) of ``row_bytes`` bytes each into ``into``
        (row ``ids[k]`` at byte ``k * row_bytes``): one GATHER per shard (more when the rows'
        bytes exceed a request's payload limit), all shards at once. ps-lite's sparse pull (Li
        et al., OSDI 2014). A replicated chunk is read from its chain's tail (always clean,
        CRAQ); a replica that fails or lost the chunk is left for the next one, read clean (one
        with an update still in flight is asked again shortly).

        Raises:
            DataLost: a recorded chunk is gone from every replica. ShardUnavailable: no replica
                answered. BadRequest. ``into`` is then partly filled.
        """
        if not len(ids):
            return
        out = np.frombuffer(into, dtype=np.uint8)
        chunk, offset, length, at = self.row_extents(layout, ids, row_bytes)
        cuts = np.flatnonzero(np.diff(chunk)) + 1
        groups = {int(chunk[g[0]]): g for g in np.split(np.arange(len(chunk)), cuts) if len(g)}

        def candidates(c: int) -> list[int]:
            placed, joining = self.placed(layout, c)
            reps = [x for x in placed if x != joining]
            return reps if len(reps) == 1 else [x for x in reversed(reps) if self._current(x)]  # the tail first

        cands = {c: candidates(c) for c in groups}
        tails = {c: (v[0] if v else None) for c, v in cands.items()}
        tried: dict[int, set[int]] = collections.defaultdict(set)  # replicas that failed or lost a chunk
        errors: dict[int, IrdmaError] = {}
        pending = set(groups)
        limit = self._max_piece(layout) or DEFAULT_MAX_PAYLOAD
        refreshed, dirty_rounds = False, 0
        while pending:
            if any(not cands[c] for c in pending) and not refreshed:
                refreshed = True  # the view may be older than the shard map: read it once more
                await self.refresh_view()
                for c in pending:
                    if not cands[c]:
                        cands[c] = [x for x in candidates(c) if x not in tried[c]]
            by_shard: dict[int, list[int]] = collections.defaultdict(list)
            for c in sorted(pending):
                if not cands[c]:
                    raise errors.get(c) or ShardUnavailable(
                        f"no up-to-date replica of chunk {c} of file {layout.file_id} answered",
                        "`irdma status` shows the shards; restart them with `irdma up`")
                by_shard[cands[c][0]].append(c)
            failed: list[tuple[int, int]] = []
            again: list[int] = []

            async def from_shard(sid: int, cs: list[int], failed: list[tuple[int, int]] = failed,
                                 again: list[int] = again) -> None:
                sel = np.concatenate([groups[c] for c in cs])
                clean = layout.replicas > 1 and any(tails[c] != sid for c in cs)
                for part in self._batches(chunk, length, sel, limit):
                    lost, outcome = await self._gather_part(layout, sid, chunk[part], offset[part], length[part],
                                                            at[part], out, chunks, errors, clean)
                    if outcome == "down":  # the replica failed: every chunk asked of it goes to the next one
                        failed.extend((c, sid) for c in cs)
                        return
                    if outcome == "dirty":  # an update in flight there: ask again shortly
                        again.extend(sorted(set(chunk[part].tolist())))
                        continue
                    failed.extend((c, sid) for c in lost)

            async with open_nursery() as nursery:
                for sid, cs in by_shard.items():
                    nursery.start_soon(from_shard, sid, cs)
            pending = set(again)
            for c, sid in failed:
                tried[c].add(sid)
                if sid in cands[c]:
                    cands[c].remove(sid)
                pending.add(c)
            if again:
                dirty_rounds += 1
                if dirty_rounds > 50:
                    raise ShardUnavailable(f"chunks of file {layout.file_id} kept an update in flight on their"
                                           " replicas while the tail was down", "`irdma status` shows the shards")
                await trio.sleep(0.002 * dirty_rounds)  # the chain acknowledges it within its deadline

    async def _gather_part(self, layout: Layout, shard_id: int, chunk: np.ndarray, offset: np.ndarray,
                           length: np.ndarray, at: np.ndarray, out: np.ndarray, chunks: ChunkMap | None,
                           errors: dict[int, IrdmaError], clean: bool = False) -> tuple[list[int], str]:
        """One GATHER of these extents from one shard into ``out``; returns the chunks it lost
        (another replica may have them) and ``ok``, ``down`` (the replica failed: nothing read)
        or ``dirty`` (a clean read met an update in flight: nothing read)."""
        ext = P_extents(chunk, offset, length)
        names = sorted(set(chunk.tolist()))

        async def fn(conn: ShardConnection) -> tuple[np.ndarray, memoryview]:
            return await conn.gather(layout.file_id, ext, clean and not conn.one_sided_reads)

        try:
            versions, got = await self._on_shard(shard_id, fn, pull=True)
            buf = np.frombuffer(got, dtype=np.uint8)
        except Dirty:
            return [], "dirty"
        except ShardUnavailable as exc:
            if layout.replicas == 1:
                raise
            await self._mark_down(shard_id)
            for c in names:
                errors[c] = exc
            return names, "down"
        conn = self.pool.conns.get(shard_id)
        inc = conn.info.incarnation if conn is not None else None
        lost: list[int] = []
        if chunks:
            holes = set(np.unique(chunk[versions == 0]).tolist())
            for c in names:
                rec = chunks.get(c)
                if rec is None:
                    continue
                # written to an earlier incarnation of this shard's memory, or not here at all
                was = rec.get(shard_id)
                if c in holes or (was and inc is not None and was != inc):
                    lost.append(c)
                    errors[c] = self._lost(layout, c, shard_id, "restarted with empty memory since, or no longer has it")
        keep = ~np.isin(chunk, lost) if lost else np.ones(len(chunk), dtype=bool)
        pos = positions(length)
        move(out, at[keep], buf, pos[:-1][keep], length[keep])
        return lost, "ok"

    async def write_rows_from(self, layout: Layout, ids: np.ndarray, row_bytes: int, data: memoryview | bytes,
                              op: UpdateOp | Update, chunks: ChunkMap | None = None) -> list[NewChunk]:
        """Push rows ``ids`` (distinct, in-range, int64; row ``ids[k]`` at byte ``k * row_bytes``
        of ``data``) with update op ``op`` applied per row on the shards: one SCATTER per chunk
        chain (one per shard for files of one replica; more when the bytes exceed a request's
        payload limit). Each chunk's rows are applied atomically with one version bump, exactly
        once (request ids, as :meth:`write_from`).

        Returns:
            The chunk replicas created, for the chunk map (see :meth:`write_from`).

        Raises:
            As :meth:`write_from`. Other chunks' rows may have been applied.
        """
        if not len(ids):
            return []
        if self.cached is not None:
            self.cached.invalidate(layout.file_id)
        src = np.frombuffer(_as_bytes_view(data), dtype=np.uint8)
        chunk, offset, length, at = self.row_extents(layout, ids, row_bytes)
        created: list[NewChunk] = []
        limit = self._max_piece(layout) or DEFAULT_MAX_PAYLOAD
        units = self._scatter_units(layout, chunk, chunks)
        batches = [b for sel in units for b in self._batches(chunk, length, sel, limit)]
        push_id = self._request_id() if len(batches) > 1 else 0  # a snapshot takes all the requests or none
        async with open_nursery() as nursery:
            for k, b in enumerate(batches):
                nursery.start_soon(self._scatter_chain, layout, chunk[b], offset[b], length[b], src, at[b], op, chunks,
                                   created, self._request_id(), Part(push_id, k, len(batches)) if push_id else None)
        return list(dict.fromkeys(created))  # a chunk in two requests is created once

    def _scatter_units(self, layout: Layout, chunk: np.ndarray, chunks: ChunkMap | None,
                       sel: np.ndarray | None = None) -> list[np.ndarray]:
        """Extent positions grouped so that each group's chunks share one chain, one head
        incarnation and whether they exist (so one request with one FLAG_EXISTING serves it)."""
        if sel is None:
            sel = np.arange(len(chunk))
        keys: dict[tuple[object, ...], list[np.ndarray]] = collections.defaultdict(list)
        sub = chunk[sel]
        cuts = np.flatnonzero(np.diff(sub)) + 1
        single = layout.replicas == 1
        for g in np.split(np.arange(len(sub)), cuts):
            if not len(g):
                continue
            c = int(sub[g[0]])
            try:
                chain: tuple[int, ...] | None = self.chain_of(layout, c)
            except ShardUnavailable:
                chain = None  # _scatter_chain raises the error that says why
            rec = chunks.get(c) if chunks else None
            head = chain[0] if chain else None
            existing = rec is not None and (head in rec or single)
            keys[(chain, existing, rec.get(head) if rec is not None and head is not None else None)].append(sel[g])
        return [np.concatenate(v) for v in keys.values()]

    async def _scatter_chain(self, layout: Layout, chunk: np.ndarray, offset: np.ndarray, length: np.ndarray,
                             src: np.ndarray, at: np.ndarray, op: UpdateOp | Update, chunks: ChunkMap | None,
                             created: list[NewChunk], rid: int, part: Part | None = None) -> None:
        """One SCATTER along its chunks' chain (:meth:`_chained_update`); a group whose chunks'
        chains parted since it was formed is split, one request per chain, same request id."""
        ext = P_extents(chunk, offset, length)
        payload = _pack(src, at, length)

        async def parted() -> bool:
            units = self._scatter_units(layout, chunk, chunks)
            if len(units) == 1:
                return False
            async with open_nursery() as nursery:
                for u in units:
                    nursery.start_soon(self._scatter_chain, layout, chunk[u], offset[u], length[u], src, at[u], op,
                                       chunks, created, rid, part)
            return True

        async def send(conn: ShardConnection, existing: bool, chain: Chain) -> None:
            await conn.scatter(layout.file_id, layout.chunk_size, ext, op, memoryview(payload),  # type: ignore[arg-type]
                               existing, chain if part is None else dataclasses.replace(chain, part=part))

        await self._chained_update(layout, sorted(set(chunk.tolist())), send, chunks, created, rid, "scatter", parted)

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
            if self._current(exc.shard_id):  # once per failure, not once per request in flight
                log.warning("replica %d failed during a %s: %s; going on without it", exc.shard_id, what,
                            exc.args[0])
            await self._mark_down(exc.shard_id)
        elif isinstance(exc, Fenced):
            await self.refresh_view()
        elif isinstance(exc, DataLost):
            view = self._view
            await self.refresh_view()
            if self._view == view:
                raise exc
        elif isinstance(exc, ShardUnavailable):
            if single:
                if trio.current_time() < self.pool.down_until.get(head, 0.0):
                    raise exc  # missed its deadline: not tried again now
                return
            if self._current(head):
                log.warning("head replica %d failed during a %s: %s; going on without it", head, what, exc.args[0])
            await self._mark_down(head)
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
            await self._conn_call(shard_id, "sync")
        except ShardUnavailable:
            if only_copy:
                raise
            await self._mark_down(shard_id)
            # a replica that went down since: it is out of the chains and resynced (from a
            # durable copy on the others) when it comes back
            log.warning("shard %d is down: its replicas were not synced; the others were", shard_id)

    def _max_piece(self, layout: Layout) -> int | None:
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

        async def one(shard_id: int, fn: str, *args: object) -> None:
            if layout.replicas > 1 and self._health.get(shard_id) == "down":
                skipped.add(shard_id)
                return  # its resync drops what the others no longer have
            try:
                await self._conn_call(shard_id, fn, *args)
            except ShardUnavailable as exc:
                if layout.replicas == 1:
                    raise
                log.warning("shard %d failed to %s file %d: %s; marked down", shard_id, fn, layout.file_id, exc)
                skipped.add(shard_id)
                await self._mark_down(shard_id)

        async with open_nursery() as nursery:
            for shard_id in self.shards_of(layout):
                if self._shard_map.get(shard_id) is not None and self._shard_map[shard_id].state in ("drained", "removed"):
                    continue
                nursery.start_soon(one, shard_id, "free", layout.file_id, first_free)
            if new_size % layout.chunk_size:
                index = new_size // layout.chunk_size
                for shard_id in self.placed(layout, index)[0]:
                    nursery.start_soon(one, shard_id, "punch", layout.file_id, index, new_size % layout.chunk_size)
        if layout.replicas > 1 and not any(self._current(s) for s in self.shards_of(layout)):
            raise ShardUnavailable(f"no shard of file {layout.file_id} is up", "restart the shards (`irdma up`)")
        if skipped and new_size % layout.chunk_size:  # the cut chunk's copy there kept its old tail
            index = new_size // layout.chunk_size
            for _ in range(MAX_ATTEMPTS):
                # only while it is still out of the view: once back, its resync compares the chunk
                out = [(index, s) for s in self.placed(layout, index)[0] if s in skipped and not self._in_view(s)
                       and self._health.get(s) != "syncing"]
                if not out or await self.meta.withdraw_replicas(layout.file_id, out, self._view):
                    break
                await self.refresh_view()
            else:
                raise ShardUnavailable(f"the shard map kept changing while file {layout.file_id} was truncated",
                                       "truncate it again")

    # ------------------------------------------------------------ admin moves (irdma.client.moves)
    async def resync_shard(self, shard_id: int, progress: Callable[[int, int, int, int], None] | None = None,
                           force: bool = False) -> int:
        """Bring a shard that is catching up level with its chains, then mark it up
        (:meth:`irdma.client.moves.ShardMoves.resync_shard`). Returns bytes copied; ``progress``:
        :data:`irdma.client.moves.MoveProgress` ``(done_bytes, total_bytes, done_chunks, total_chunks)``."""
        return await self._admin.resync_shard(shard_id, progress, force)

    async def drain_shard(self, shard_id: int, progress: Callable[[int, int, int, int], None] | None = None) -> int:
        """Move every chunk off a shard while updates go on, then take it out of every chain
        (:meth:`irdma.client.moves.ShardMoves.drain_shard`). Returns bytes copied."""
        return await self._admin.drain_shard(shard_id, progress)

    async def rebalance(self, progress: Callable[[int, int, int, int], None] | None = None,
                        tolerance: float = 0.1) -> list[tuple[int, int, int]]:
        """Even out the bytes the shards in service hold (:meth:`irdma.client.moves.ShardMoves.rebalance`).
        Returns ``(shard moved from, bytes copied, chunks moved)`` of each move made."""
        return await self._admin.rebalance(progress, tolerance)

    async def run_move(self, progress: Callable[[int, int, int, int], None] | None = None) -> int:
        """Carry out the move of chunks in progress in the shard map
        (:meth:`irdma.client.moves.ShardMoves.run_move`). Returns bytes copied."""
        return await self._admin.run_move(progress)

    async def remove_shard(self, shard_id: int, force: bool = False) -> list[tuple[int, int]]:
        """Take a drained shard (with ``force``, any shard) out of the cluster
        (:meth:`irdma.client.moves.ShardMoves.remove_shard`). Returns ``(ino, chunk index)`` of the
        chunks lost with it."""
        return await self._admin.remove_shard(shard_id, force)

    async def resync_all(self, log_progress: Callable[[str], None] = log.info) -> None:
        """Resync every reachable shard that is catching up, as a mount's heartbeat does
        (:meth:`irdma.client.moves.ShardMoves.resync_all`)."""
        await self._admin.resync_all(log_progress)

    async def shard_stats(self) -> list[tuple[ShardRecord, StatReply | None, str]]:
        """Every registered shard with its STAT reply, or None and the reason it failed
        (:meth:`irdma.client.moves.ShardMoves.shard_stats`)."""
        return await self._admin.shard_stats()

    def list_chunks(self, shard_id: int) -> AsyncIterator[list[ChunkEntry]]:
        """Every chunk a shard holds, page by page, for gc and fsck
        (:meth:`irdma.client.moves.ShardMoves.list_chunks`)."""
        return self._admin.list_chunks(shard_id)

    # ------------------------------------------------------------ files by path
    async def _split(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rstrip("/").rpartition("/")
        return (await self.meta.resolve(head or "/")).ino, name.encode()

    async def makedirs(self, path: str, mode: int = 0o755) -> Inode:
        """Create a directory and its missing parents (like ``mkdir -p``)."""
        inode = await self.meta.getattr(1)
        for part in path.strip("/").split("/"):
            if not part:
                continue
            try:
                inode = await self.meta.lookup(inode.ino, part.encode())
            except NotFound:
                inode = await self.meta.create(inode.ino, part.encode(), stat.S_IFDIR | mode, os.getuid(), os.getgid())
        return inode

    async def create(self, path: str, *, chunk_size: int | None = None, mode: int = 0o644) -> Inode:
        """Create an empty file, or return the existing one.

        Raises:
            NotFound: the parent directory does not exist. InvalidArgument: bad chunk size.
        """
        parent, name = await self._split(path)
        try:
            return await self.meta.lookup(parent, name)
        except NotFound:
            return await self.meta.create(parent, name, stat.S_IFREG | mode, os.getuid(), os.getgid(),
                                          chunk_size=chunk_size)

    async def write(self, path: str, data: object, offset: int = 0, *, op: UpdateOp | Update | str | None = None,
                    chunk_size: int | None = None, compress: Compression | str | None = None,
                    feedback: np.ndarray | None = None) -> int:
        """Write a buffer (bytes, numpy array, memoryview) at ``offset``, creating the file.

        ``op`` defaults to the file's ``user.irdma.update`` (``assign`` unless set); a string is
        parsed as that xattr is (:func:`irdma.train.optimizers.parse_update`). The size
        grows, and the chunks written join the file's chunk map, only once every shard has
        acknowledged its part: a failed write leaves the size of what is stored.
        ``compress`` (a :class:`irdma.wire.compress.Compression` or a ``user.irdma.compress``
        value) and ``feedback``: see :meth:`write_from` (ignored with ``assign``).

        Returns:
            Bytes written.

        Raises:
            DataLost, NoSpace, ShardUnavailable, BadRequest, InvalidArgument: see :meth:`write_from`.
        """
        coded = _compression(compress)
        inode = await self.create(path, chunk_size=chunk_size)
        _writable(inode, path)
        uop = parse_update(op) if isinstance(op, str) else (op if op is not None else parse_update(inode.update_op or "assign"))
        return await self._write_inode(inode, data, offset, uop, coded, feedback)

    async def _write_inode(self, inode: Inode, data: object, offset: int, uop: UpdateOp | Update,
                           coded: Compression | None, feedback: np.ndarray | None) -> int:
        """:meth:`write` of a file already looked up (and checked writable), with its op."""
        view = _as_bytes_view(data)
        layout = layout_of(inode)
        chunks = await self.meta.chunk_map(inode.ino)
        if offset > inode.size:
            # the gap must read as zeros: clear what an earlier, failed writer may have left there
            await self.truncate_data(layout, inode.size)
        created = await self.write_from(layout, offset, view, uop, chunks, compress=coded, feedback=feedback)
        await self.meta.extend(inode.ino, offset + len(view), time.time_ns(), tuple(created))
        return len(view)

    async def read(self, path: str, offset: int = 0, length: int | None = None) -> bytearray:
        """Read up to ``length`` bytes from ``offset`` (to the end of file by default).

        Raises:
            DataLost: part of the range was lost with a shard's memory; ShardUnavailable.
        """
        inode = await self.meta.resolve(path)
        n = max(0, min(inode.size - offset, inode.size if length is None else length))
        buf = bytearray(n)
        if n:
            chunks = await self.meta.chunk_map(inode.ino)
            if self.cached is not None:  # close-to-open: each read is an open
                await self.cache_open(inode, chunks)
            await self.read_into(layout_of(inode), offset, memoryview(buf), chunks)
        return buf

    async def cache_open(self, inode: Inode, chunks: ChunkMap | None = None, mode: bytes | None = None) -> None:
        """Validate what the local read cache keeps of a file, at an open of it (close-to-open;
        the rule is in :mod:`irdma.client.cache`): from now on :meth:`read_into` serves its
        chunks whose version is still the shards'. One version query per shard of the file's
        stripe holding kept chunks (a GATHER of empty extents; none when nothing is kept, and
        none for a ``readonly`` file validated in the last
        :data:`~irdma.client.cache.READONLY_REVALIDATE_S` s at the same ctime), and a CHECKSUM
        per kept chunk whose version matches but whose file changed ctime since.
        ``mode``: the file's ``user.irdma.cache`` (None: read it). Without a cache: nothing.

        Raises:
            ShardUnavailable: a shard did not answer the version query (nothing is served from
                the cache for the file then; reads go to the shards).
        """
        if self.cached is not None and not inode.is_dir:
            await self.cached.open_file(inode, chunks, mode)

    async def push(self, path: str, delta: np.ndarray, offset: int = 0, *, compress: Compression | str | None = None,
                   residual: np.ndarray | None = None) -> None:
        """Push gradient ``delta`` (cast to little-endian float32) into the file, as a write
        through the mount does: the file's ``user.irdma.update`` is applied on the shards (an
        optimizer takes one step, its state included: ``adam``, ``sgd momentum=0.9``, ...;
        ``add`` adds), and a file under ``assign`` (or a new one) has ``delta`` added
        element-wise.

        ``compress`` (a :class:`irdma.wire.compress.Compression` or a ``user.irdma.compress`` value
        such as ``"topk:0.01"`` or ``"sign"``; None: dense) sends it compressed, decoded and
        applied on the shards. ``residual`` (float32, C-contiguous, as many elements as
        ``delta``; zeros at first, then kept by the caller between pushes) is error feedback:
        ``delta + residual`` is pushed and ``residual`` becomes, in place, what the compression
        dropped (zeros for a dense push); its elements in a piece that failed are left as they
        were. Over pushes, what the shards received plus ``residual`` is the sum of the deltas
        (Karimireddy et al., ICML 2019).

        Raises:
            ValueError: a bad ``compress`` value, ``residual`` of the wrong size or dtype, or a
                file's ``user.irdma.update`` that does not parse (nothing changed).
            And what :meth:`write` raises.
        """
        coded = _compression(compress)
        g = np.ascontiguousarray(delta, dtype="<f4").reshape(-1)
        if residual is not None and (residual.dtype != np.float32 or residual.size != g.size
                                     or not residual.flags.c_contiguous):
            raise ValueError(f"residual must be C-contiguous float32 of {g.size} elements, not {residual.dtype} of"
                             f" {residual.size}")
        inode = await self.create(path)
        _writable(inode, path)
        uop: UpdateOp | Update = parse_update(inode.update_op or "assign")
        if as_update(uop).op == UpdateOp.ASSIGN:  # a push never overwrites: the gradient is added
            uop = UpdateOp.ADD
        if residual is None:
            await self._write_inode(inode, g, offset, uop, coded, None)
            return
        flat = residual.reshape(-1)
        corrected = g + flat
        if not coded:
            await self._write_inode(inode, corrected, offset, uop, None, None)
            flat[:] = 0
            return
        await self._write_inode(inode, corrected, offset, uop, coded, flat)

    async def pull(self, path: str, shape: Sequence[int] | None = None, dtype: str = "<f4") -> np.ndarray:
        """Read a whole tensor: the file's bytes as ``dtype`` (little-endian float32 by default).

        Raises:
            DataLost: part of the tensor was lost with a shard's memory; ShardUnavailable.
        """
        inode = await self.meta.resolve(path)
        arr = np.empty(inode.size // np.dtype(dtype).itemsize, dtype=dtype)
        if arr.nbytes:
            await self.read_into(layout_of(inode), 0, memoryview(arr).cast("B"),  # type: ignore[arg-type]
                                 await self.meta.chunk_map(inode.ino))
        return arr.reshape(shape) if shape is not None else arr

    async def set_shape(self, path: str, shape: Sequence[int]) -> None:
        """Record a file's tensor shape in its ``user.irdma.shape`` xattr (what
        :meth:`pull_rows` and :meth:`push_rows` take rows from), creating the file if needed
        and growing it to the shape's size (the new rows read as zeros), so that sparse pushes
        from many workers never change its size.

        Raises:
            InvalidArgument: not one or more positive integer dimensions (nothing changed).
        """
        dims = [int(d) for d in shape if isinstance(d, (int, np.integer)) and not isinstance(d, bool)]
        if not dims or len(dims) != len(shape) or min(dims) <= 0:
            raise InvalidArgument(f"bad shape {tuple(shape)!r}: use positive integer dimensions such as (1000000, 256)")
        inode = await self.create(path)
        await self.meta.setxattr(inode.ino, XATTR_SHAPE, ",".join(map(str, dims)).encode())
        need = 4 * int(np.prod(dims))
        if inode.size < need:
            await self.truncate(path, need)

    async def _rows_of(self, inode: Inode, row_len: int | None) -> tuple[int, int | None]:
        """``(row bytes, row count or None)`` of a file read as float32 rows: ``row_len`` if
        given, else from its ``user.irdma.shape`` xattr.

        Raises:
            InvalidArgument: neither says, or ``row_len`` disagrees with the shape.
        """
        try:
            raw = await self.meta.getxattr(inode.ino, XATTR_SHAPE)
        except NoAttribute:
            raw = None
        shape = parse_shape(raw) if raw else None
        per_row = int(np.prod(shape[1:])) if shape else None
        if row_len is None:
            if per_row is None:
                raise InvalidArgument(f"inode {inode.ino} has no {XATTR_SHAPE.decode()} xattr: pass row_len, or set"
                                      " it (setfattr -n user.irdma.shape -v ROWS,COLS FILE)")
            row_len = per_row
        if row_len <= 0 or (per_row is not None and row_len != per_row):
            raise InvalidArgument(f"row length {row_len} disagrees with {XATTR_SHAPE.decode()} {shape}"
                                  if per_row is not None else f"row length {row_len} must be positive")
        return 4 * row_len, (shape[0] if shape else None)

    @staticmethod
    def _row_ids(ids: object) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise InvalidArgument(f"row ids must be a 1-D array of integers, got {arr.dtype} of shape {arr.shape}")
        arr = arr.astype(np.int64)
        if arr.size and int(arr.min()) < 0:
            raise InvalidArgument(f"row id {int(arr.min())} is negative")
        return arr

    async def pull_rows(self, path: str, ids: Sequence[int] | np.ndarray, *, row_len: int | None = None,
                        out: np.ndarray | None = None) -> np.ndarray:
        """Sparse pull: rows ``ids`` of a 2-D little-endian float32 file, in the order given
        (duplicates allowed), as a ``(len(ids), row_len)`` float32 array (``out`` if given: a
        C-contiguous float32 array of that shape, reused across calls to spare page faults).
        The row length comes from ``row_len`` or the file's ``user.irdma.shape`` xattr (e.g.
        ``1000000,256``). One GATHER per shard carries every row it holds (ps-lite's sparse pull).

        Raises:
            InvalidArgument: bad ids, a row past the end of the file, no row length, a bad ``out``.
            DataLost, ShardUnavailable: as :meth:`pull`.
        """
        inode = await self.meta.resolve(path)
        rb, _ = await self._rows_of(inode, row_len)
        ids_arr = self._row_ids(ids)
        if out is None:
            out = np.empty((len(ids_arr), rb // 4), dtype="<f4")
        elif out.dtype != np.dtype("<f4") or out.shape != (len(ids_arr), rb // 4) or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a C-contiguous float32 array of shape {(len(ids_arr), rb // 4)},"
                                  f" got {out.dtype} {out.shape}")
        if not len(ids_arr):
            return out
        if (int(ids_arr.max()) + 1) * rb > inode.size:
            raise InvalidArgument(f"row {int(ids_arr.max())} of {rb} bytes is past the end of {path}"
                                  f" ({inode.size} bytes, {inode.size // rb} rows)")
        uniq, inv = np.unique(ids_arr, return_inverse=True)
        dups = len(uniq) < len(ids_arr)  # without duplicates each row lands in place, in the order asked
        got = np.empty((len(uniq), rb // 4), dtype="<f4") if dups else out
        await self.read_rows_into(layout_of(inode), uniq if dups else ids_arr, rb,
                                  memoryview(got).cast("B"),  # type: ignore[arg-type]
                                  await self.meta.chunk_map(inode.ino))
        if dups:
            out[:] = got[inv.reshape(-1)]
        return out

    async def push_rows(self, path: str, ids: Sequence[int] | np.ndarray, rows: np.ndarray, *,
                        op: UpdateOp | Update | str | None = None, row_len: int | None = None) -> None:
        """Sparse push: apply ``rows`` (``(len(ids), row_len)``, cast to little-endian float32)
        to rows ``ids`` of a file with update op ``op`` (default: the file's
        ``user.irdma.update``; assign, add and the optimizers, applied per row on the shards).
        Duplicate ids are summed first (their sum is what is assigned or added; ps-lite's
        sparse push). One SCATTER per shard (per chain when replicated) carries every row it
        holds; each chunk's rows are applied atomically. Rows must lie inside the file (and its
        shape's row count): :meth:`set_shape` sizes a table.

        Raises:
            InvalidArgument: bad ids or rows (nothing changed). DataLost, NoSpace,
                ShardUnavailable, BadRequest: as :meth:`write` (other chunks' rows may have
                been applied).
        """
        inode = await self.meta.resolve(path)
        _writable(inode, path)
        rb, nrows = await self._rows_of(inode, row_len)
        ids_arr = self._row_ids(ids)
        data = np.asarray(rows, dtype="<f4")
        if data.size != len(ids_arr) * (rb // 4):
            raise InvalidArgument(f"{len(ids_arr)} row ids need {len(ids_arr)} x {rb // 4} values, got an array of"
                                  f" shape {data.shape}")
        if not len(ids_arr):
            return
        limit = inode.size // rb if nrows is None else min(nrows, inode.size // rb)
        if int(ids_arr.max()) >= limit:
            raise InvalidArgument(f"row {int(ids_arr.max())} is past the last row of {path} ({limit} rows;"
                                  f" set_shape sizes a table)")
        data = data.reshape(len(ids_arr), rb // 4)
        order = np.argsort(ids_arr, kind="stable")
        sorted_ids = ids_arr[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        if len(starts) < len(ids_arr):  # duplicates: summed (in the order given) into one row each
            uniq, summed = sorted_ids[starts], np.add.reduceat(data[order], starts, axis=0)
        else:
            uniq, summed = ids_arr, data
        uop = parse_update(op) if isinstance(op, str) else (op if op is not None else parse_update(inode.update_op or "assign"))
        layout = layout_of(inode)
        end = (int(sorted_ids[-1]) + 1) * rb  # inside the file: a sparse push never changes its size
        created = await self.write_rows_from(layout, uniq, rb,
                                             memoryview(np.ascontiguousarray(summed, dtype="<f4")),  # type: ignore[arg-type]
                                             uop,
                                             await self.meta.chunk_map(inode.ino))
        # mtime is refreshed at most once a second by pushes that neither grow the file nor make
        # chunks (as a mount's direct-I/O pushes, and lazytime): no metadata transaction per push
        now = time.monotonic()
        if created or now - self._mtime_at.get(inode.ino, -MTIME_LAZY_S) >= MTIME_LAZY_S:
            await self.meta.extend(inode.ino, end, time.time_ns(), tuple(created))
            self._mtime_at[inode.ino] = now

    async def set_update_op(self, path: str, op: str) -> None:
        """Set what writes to ``path`` do: ``assign``, ``add`` or an optimizer with its
        arguments, e.g. ``"adam learning_rate=0.001"`` (:mod:`irdma.train.optimizers`); on a
        directory, the default for files created in it.

        Raises:
            InvalidArgument: not a valid update op (nothing changed).
        """
        await self.meta.setxattr((await self.meta.resolve(path)).ino, XATTR_UPDATE, op.encode())

    # ------------------------------------------------------------ optimizer state
    async def state_of(self, inode: Inode) -> tuple[Layout, UpdateOp | None, int, int]:
        """Where a file's optimizer state lives: ``(layout, op, state chunk bytes, total bytes)``.

        The *state image* of a file whose update op is an optimizer is the concatenation, chunk
        by chunk, of each chunk's state chunk (:mod:`irdma.server.optim`: a 4096-byte header,
        then one slot of ``chunk_size`` bytes per state variable, little-endian float32, Adam's
        step as u32), ``ceil(size / chunk_size)`` state chunks in all. ``op`` is None (and the
        image empty) for ``assign`` and ``add``.
        """
        layout = layout_of(inode)
        op = parse_update(inode.update_op or "assign").op
        if op not in SLOTS:
            return layout, None, 0, 0
        per = state_size(op, layout.chunk_size)
        return layout, op, per, -(-inode.size // layout.chunk_size) * per

    @staticmethod
    def _state_pieces(per: int, offset: int, length: int, most: int | None) -> list[tuple[int, int, int, int]]:
        """``(chunk index, offset in its state chunk, offset in the buffer, length)`` of each
        piece of ``[offset, offset+length)`` of a state image, none longer than ``most``."""
        out, pos = [], offset
        while pos < offset + length:
            index, within = divmod(pos, per)
            n = min(per - within, offset + length - pos, most or per)
            out.append((index, within, pos - offset, n))
            pos += n
        return out

    async def read_state_into(self, layout: Layout, per: int, offset: int, into: memoryview,
                              chunks: ChunkMap | None = None) -> None:
        """Read bytes ``[offset, offset+len(into))`` of a file's state image (:meth:`state_of`;
        ``per`` its state chunk size) from an up-to-date replica of each chunk (the last one up
        in chain order: never one catching up, nor a move's target). A chunk that has no state
        chunk on that replica (never stepped) reads as zeros, as does the part of a smaller state
        chunk made by another optimizer (its header names that one; the next step starts this
        optimizer's afresh). ``chunks``, the file's chunk map: a replica restarted on empty memory
        since it got the chunk raises DataLost instead of answering zeros.

        Raises:
            DataLost; ShardUnavailable: no up-to-date replica of a chunk answered in time.
        """
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into

        async def one(index: int, within: int, at: int, n: int) -> None:
            view = into[at : at + n]
            rec = chunks.get(index) if chunks else None
            for _ in range(len(layout.replicas_of(index)) + 1):
                _, joining = self.placed(layout, index)
                chain = self.chain_of(layout, index)  # raises when no replica is up to date
                cands = [s for s in chain if s != joining and (len(chain) == 1 or self._current(s))]
                if not cands:
                    break
                pick = cands[-1]
                inc = rec.get(pick) if rec is not None else None

                async def fn(conn: ShardConnection, pick: int = pick, inc: int | None = inc) -> int:
                    if inc and inc != conn.info.incarnation:
                        raise self._lost(layout, index, pick, "restarted with empty memory since")
                    return await conn.read(layout.file_id, state_index(index), within, view)

                try:
                    if await self._on_shard(pick, fn) == 0:
                        view[:] = bytes(n)
                    return
                except BadRequest:  # past the end of a smaller state chunk (another optimizer's)
                    view[:] = bytes(n)
                    return
                except ShardUnavailable:
                    if len(chain) == 1:
                        raise
                    await self._mark_down(pick)
            raise ShardUnavailable(f"no up-to-date replica of chunk {index} of file {layout.file_id} answered",
                                   "`irdma status` shows the shards; restart them with `irdma up`")

        async with open_nursery() as nursery:
            for piece in self._state_pieces(per, offset, len(into), self._max_piece(layout)):
                nursery.start_soon(one, *piece)

    async def write_state_from(self, layout: Layout, per: int, offset: int, data: memoryview | bytes) -> None:
        """Restore bytes ``[offset, offset+len(data))`` of a file's state image (as
        :meth:`read_state_into` gave them) on every replica of each chunk, in chain order with
        one request id (``assign`` of the state chunk: exactly once on every replica).

        Write the whole image, and the weights with the file's op set to ``assign``, before the
        next gradient: a restore applies to the chunks as they are. A state chunk is copied to a
        replica that catches up only with its data chunk (when that one's version differs).

        Raises:
            BadRequest: a range past the image; NoSpace; ShardUnavailable.
        """
        view = _as_bytes_view(data)

        async def one(index: int, within: int, at: int, n: int) -> None:
            part = view[at : at + n]
            rid = self._request_id()
            last: IrdmaError | None = None
            for _ in range(MAX_ATTEMPTS):
                epoch = self._view
                chain = self.chain_of(layout, index)

                async def fn(conn: ShardConnection, chain: tuple[int, ...] = chain, epoch: int = epoch) -> None:
                    await conn.write(layout.file_id, state_index(index), per, within, UpdateOp.ASSIGN, part, False,
                                     self._chain(rid, chain[1:], epoch))

                try:
                    await self._withdraw(layout, (index,), chain, epoch)
                    await self._on_shard(chain[0], fn)
                    if len(chain) == 1:
                        self._unsynced_single.add(chain[0])
                    for sid in chain:
                        self._unsynced.add(sid)
                    return
                except ReplicaFailed as exc:
                    last = exc
                    await self._mark_down(exc.shard_id)
                except Fenced as exc:
                    last = exc
                    await self.refresh_view()
                except ShardUnavailable as exc:
                    if len(chain) == 1:
                        raise
                    last = exc
                    await self._mark_down(chain[0])
            assert last is not None
            raise last

        async with open_nursery() as nursery:
            for piece in self._state_pieces(per, offset, len(view), self._max_piece(layout)):
                nursery.start_soon(one, *piece)

    async def read_state(self, path: str) -> bytes:
        """A file's whole optimizer state image (:meth:`state_of`), for a checkpoint; empty when
        its update op is not an optimizer. Raises ShardUnavailable."""
        inode = await self.meta.resolve(path)
        layout, _, per, total = await self.state_of(inode)
        buf = bytearray(total)
        if total:
            await self.read_state_into(layout, per, 0, memoryview(buf), await self.meta.chunk_map(inode.ino))
        return bytes(buf)

    async def write_state(self, path: str, image: bytes | memoryview) -> None:
        """Restore a file's optimizer state from a :meth:`read_state` image taken under the same
        optimizer and chunk size (see :meth:`write_state_from` for the order of a restore).

        Raises:
            InvalidArgument: the file's op is not an optimizer, or the image's size is not this
                file's (nothing written). NoSpace, ShardUnavailable.
        """
        inode = await self.meta.resolve(path)
        _writable(inode, path)
        layout, op, per, total = await self.state_of(inode)
        if op is None or len(image) != total:
            raise InvalidArgument(f"{path}: a state image of {total} bytes restores it"
                                  f" ({'its update op is not an optimizer' if op is None else f'not {len(image)}'});"
                                  " set the optimizer it was taken under first")
        await self.write_state_from(layout, per, 0, image)

    async def optimizer_state(self, path: str) -> dict[str, np.ndarray]:
        """A file's optimizer state as arrays, one per slot, each of the file's ``size // 4``
        elements: little-endian float32, Adam's ``step`` u32 (names:
        :data:`irdma.train.optimizers.SLOT_NAMES`, e.g. ``m``, ``v``, ``step`` for Adam, as Keras names
        its variables). Empty for ``assign`` and ``add``; zeros for a chunk never stepped or
        holding another optimizer's state. Raises ShardUnavailable, DataLost."""
        inode = await self.meta.resolve(path)
        layout, op, per, total = await self.state_of(inode)
        if op is None:
            return {}
        image = np.frombuffer(await self.read_state(path), dtype=np.uint8).reshape(-1, per).copy()
        mine = (image[:, :4] == np.frombuffer(MAGIC, np.uint8)).all(axis=1) & (image[:, 4] == int(op))
        image[~mine] = 0  # chunks never stepped, or with another optimizer's state: none of this one's yet
        cs, n = layout.chunk_size, inode.size // 4
        out = {}
        for k, name in enumerate(SLOT_NAMES[op]):
            raw = np.ascontiguousarray(image[:, HEADER + k * cs : HEADER + (k + 1) * cs]).reshape(-1)
            out[name] = raw.view("<u4" if name == "step" else "<f4")[:n].copy()
        return out

    # ------------------------------------------------------------ training semantics
    async def clock_at(self, job: int, worker: int | bytes | str) -> int:
        """Advance worker ``worker``'s clock in the job directory with inode ``job`` and wait
        as its consistency model says (:func:`irdma.train.coord.tick`; ASP when the directory has no
        ``user.irdma.consistency``).

        Raises:
            InvalidArgument: not a job directory's worker (the message says why);
            SyncTimeout: the slowest worker stayed too far behind until the deadline.
        """
        try:
            w = int(worker)
        except ValueError:
            raise InvalidArgument(f"the clock takes a worker id, not {worker!r}") from None

        async def xattr(name: bytes) -> bytes | None:
            try:
                return await self.meta.getxattr(job, name)
            except NoAttribute:
                return None

        raw_c, raw_n, raw_t, raw_e = (await xattr(coord.XATTR_CONSISTENCY), await xattr(coord.XATTR_WORKERS),
                                      await xattr(coord.XATTR_SYNC_TIMEOUT), await xattr(coord.XATTR_ELASTIC))
        if raw_n is None:
            raise InvalidArgument(f"inode {job} is not a job directory: set {coord.XATTR_WORKERS.decode()} on it first")
        consistency = coord.parse_consistency(raw_c or b"asp")
        timeout = coord.parse_timeout(raw_t) if raw_t else coord.DEFAULT_SYNC_TIMEOUT
        elastic = coord.parse_elastic(raw_e) if raw_e else None
        return await coord.tick(self.meta, job, w, coord.parse_workers(raw_n), consistency, timeout, elastic)

    async def clock(self, job_dir: str, worker: int) -> int:
        """The end of worker ``worker``'s push round in ``job_dir``: see :meth:`clock_at`."""
        return await self.clock_at((await self.meta.resolve(job_dir)).ino, worker)

    async def barrier(self, name: str, n: int, timeout: float = coord.DEFAULT_SYNC_TIMEOUT) -> None:
        """Return once ``n`` callers (any client or mount of the namespace) arrived at barrier
        ``name`` (:func:`irdma.train.coord.barrier`). Raises SyncTimeout, InvalidArgument."""
        await coord.barrier(self.meta, name, n, timeout)

    async def lock(self, name: str, lease: float, timeout: float = coord.DEFAULT_SYNC_TIMEOUT) -> int:
        """Take lock ``name`` for this client with a lease of ``lease`` seconds (again: renew
        it); the expiry (ns since the epoch). Raises SyncTimeout."""
        return await coord.lock(self.meta, name, self._holder, lease, timeout)

    async def unlock(self, name: str) -> bool:
        """Release lock ``name``; False when this client did not hold it (or its lease ran out)."""
        return bool(await self.meta.lock_release(name, self._holder))

    async def fetch_add(self, name: str, delta: int = 1) -> int:
        """Add ``delta`` to counter ``name`` atomically; the value before."""
        return int(await self.meta.counter_add(name, delta))

    @property
    def _holder(self) -> str:
        return f"{socket.gethostname()}/client/{os.getpid()}/{id(self):x}"

    async def truncate(self, path: str, size: int) -> None:
        """Set a file's size; bytes past the old end read as zeros."""
        inode = await self.meta.resolve(path)
        _writable(inode, path)
        if size < inode.size:
            await self.meta.setattr(inode.ino, size=size)  # first: the chunk map forgets them
            await self.truncate_data(layout_of(inode), size)
        else:
            await self.truncate_data(layout_of(inode), inode.size)
            await self.meta.setattr(inode.ino, size=size)

    async def unlink(self, path: str) -> None:
        """Remove a file's name; its chunks are freed now unless a live session (a mount) holds
        it open, in which case that session's last close frees them."""
        parent, name = await self._split(path)
        inode = await self.meta.unlink(parent, name)
        if inode.nlink <= 0:
            # no grace here: this client holds no kernel name cache (a mount that cached the
            # name gets ESTALE and looks it up again)
            await self.destroy_if_unused(inode.ino, grace=False)

    async def destroy_later(self, ino: int) -> None:
        """Wait out the unlink grace period, then free the file if nothing holds it open."""
        try:
            await trio.sleep(await self.meta.unlink_grace() + 0.1)
            await self.destroy_if_unused(ino)
        except IrdmaError as exc:
            log.warning("freeing removed file %d failed (`irdma gc` will): %s", ino, exc)

    async def destroy_if_unused(self, ino: int, grace: bool = True) -> bool:
        """Free the chunks and the inode of a file with no name that no live session holds
        open (and, with ``grace``, whose unlink grace period is over). Returns whether it did."""
        inode = await self.meta.reclaimable(ino, grace)
        if inode is None:
            return False
        if not inode.is_dir and inode.stripe:
            await self.truncate_data(layout_of(inode), 0)
        await self.meta.delete_inode(ino)
        return True

    # ------------------------------------------------------------ snapshots (irdma.client.snapshots)
    async def snapshot(self, path: str, name: str, *, keep: int | None = None) -> SnapshotInfo:
        """Take a consistent, copy-on-write snapshot of file or directory ``path``, readable
        at ``DIR/.snapshots/NAME`` (:func:`irdma.client.snapshots.create`: errors there)."""
        return await _snaps.create(self, path, name, keep=keep)

    async def snapshots(self, path: str) -> list[SnapshotInfo]:
        """The snapshots of ``path`` (a directory, or a file: its directory's), oldest first."""
        return await _snaps.list_snapshots(self, path)

    async def restore_snapshot(self, path: str, name: str) -> None:
        """Make ``path`` what its snapshot ``name`` holds again, atomically for readers
        (:func:`irdma.client.snapshots.restore`: errors there)."""
        await _snaps.restore(self, path, name)

    async def clone_snapshot(self, path: str, name: str, new_path: str) -> Inode:
        """A writable copy of snapshot ``name`` of ``path`` at ``new_path``, sharing its chunks
        until written (:func:`irdma.client.snapshots.clone`)."""
        return await _snaps.clone(self, path, name, new_path)

    async def delete_snapshot(self, path: str, name: str) -> int:
        """Delete snapshot ``name`` of ``path``; returns how many files it had (NotFound: none)."""
        return await _snaps.delete(self, path, name)

    async def listdir(self, path: str = "/") -> list[str]:
        return [n.decode() for n, _ in await self.meta.readdir((await self.meta.resolve(path)).ino)]

    async def stat(self, path: str) -> Inode:
        return await self.meta.resolve(path)
