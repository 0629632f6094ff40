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

import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np
import trio

from ._concurrency import open_nursery
from ._errors import DataLost, IrdmaError, IsADirectory, NotFound, ShardUnavailable
from .meta import Inode, MetaStore, ShardRecord, open_meta
from .meta.aio import AsyncMeta
from .meta.base import XATTR_UPDATE
from .placement import Layout, Piece
from .protocol import DEFAULT_MAX_PAYLOAD, ChunkEntry, StatReply, UpdateOp
from .transport import ShardConnection, Transport, make_transport

#: Requests in flight per shard connection.
DEFAULT_WINDOW = 16
#: Seconds a request to a shard may take (queueing, connecting and the transfer together).
DEFAULT_TIMEOUT = 10.0

#: A file's chunk map: chunk index -> (shard id, shard incarnation when first written).
ChunkMap = dict[int, tuple[int, int]]
#: Chunks a write created: (chunk index, shard id, incarnation), for the chunk map.
NewChunk = tuple[int, int, int]

log = logging.getLogger("irdma.client")
_T = TypeVar("_T")


def layout_of(inode: Inode) -> Layout:
    """The placement of a file's chunks."""
    if inode.is_dir:
        raise IsADirectory(f"inode {inode.ino} is a directory")
    assert inode.chunk_size is not None
    return Layout(inode.ino, inode.chunk_size, inode.stripe)


def _as_bytes_view(data: object) -> memoryview:
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        view = memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]
    return view.cast("B")


class Client:
    """A connection to one irdma namespace: its metadata engine and its shards.

    Create with :meth:`open`. Every method is a trio coroutine and may run concurrently.

    Args:
        meta: the metadata engine (its calls run in worker threads: ``client.meta`` is the
            awaitable :class:`AsyncMeta`, ``client.store`` the engine itself).
        transport: how to reach shards.
        nursery: where connection tasks live.
        credentials: bytes shards may require in the handshake.
        window: requests in flight per shard.
        timeout: seconds each request to a shard may take, queueing and connecting included.
    """

    def __init__(
        self,
        meta: MetaStore,
        transport: Transport,
        nursery: trio.Nursery,
        *,
        credentials: bytes = b"",
        window: int = DEFAULT_WINDOW,
        client_name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.store = meta
        self.meta = AsyncMeta(meta)
        self.timeout = timeout
        self._health: dict[int, str] = {}
        # shards that missed a deadline: data calls fail at once until then (trio time), so a
        # stopped shard costs each caller one deadline, not one per request; probes still try
        self._down_until: dict[int, float] = {}
        self._unsynced: set[int] = set()  # shards written since the last flush
        self._flush_lock = trio.Lock()  # a flush returns only after the one in flight covered it
        self.transport = transport
        self._nursery = nursery
        self._credentials = credentials
        self._name = client_name or f"irdma-client pid {os.getpid()}"
        self._window = window
        self._conns: dict[int, ShardConnection] = {}
        self._limits: dict[int, trio.Semaphore] = {}
        self._connect_locks: dict[int, trio.Lock] = {}
        self._shard_map: dict[int, ShardRecord] = {}

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        meta_url: str,
        *,
        transport: str | Transport = "auto",
        credentials: bytes = b"",
        window: int = DEFAULT_WINDOW,
        client_name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> AsyncIterator[Client]:
        """Open the namespace at ``meta_url`` (see :func:`irdma.meta.open_meta`).

        Raises:
            NotFound: no metadata database there.
            TransportUnavailable: ``transport="verbs"`` where verbs cannot run.
        """
        tr = make_transport(transport) if isinstance(transport, str) else transport
        meta = await trio.to_thread.run_sync(open_meta, meta_url)
        if hasattr(meta, "busy_timeout"):  # a wait for the database's write lock has the same deadline
            meta.busy_timeout = timeout
        try:
            async with open_nursery() as nursery:
                client = cls(meta, tr, nursery, credentials=credentials, window=window, client_name=client_name,
                             timeout=timeout)
                try:
                    yield client
                finally:
                    await client.aclose()
                    nursery.cancel_scope.cancel()
        finally:
            meta.close()

    async def aclose(self) -> None:
        """Close every shard connection. Safe to call twice."""
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            with trio.CancelScope(shield=True):
                await conn.aclose()

    # ------------------------------------------------------------ shard connections
    async def connection(self, shard_id: int) -> ShardConnection:
        """The connection to shard ``shard_id``, opened on first use and again once broken.

        A new connection's incarnation is checked against the shard map: a shard that restarted
        on fresh memory is logged as having lost its chunks (reads of them raise DataLost).

        Raises:
            ShardUnavailable: the shard is not in the shard map or does not answer in time.
        """
        conn = self._conns.get(shard_id)
        if conn is not None and not conn.broken:
            return conn
        lock = self._connect_locks.setdefault(shard_id, trio.Lock())
        async with lock:
            conn = self._conns.get(shard_id)
            if conn is not None and conn.broken:
                await self._drop(shard_id, conn)
                conn = None
            if conn is None:
                if shard_id not in self._shard_map:
                    self._shard_map = {r.shard_id: r for r in await self.meta.shards()}
                rec = self._shard_map.get(shard_id)
                if rec is None:
                    raise ShardUnavailable(f"shard {shard_id} is not in the shard map of {self.meta.url}")
                try:
                    conn = await self.transport.connect(
                        rec.address, self._nursery, client_name=self._name, credentials=self._credentials,
                        timeout=self.timeout,
                    )
                except ShardUnavailable:
                    await self._note_health(shard_id, "down")
                    raise
                try:
                    await self._check_incarnation(rec, conn)
                except BaseException:
                    await conn.aclose()
                    raise
                self._conns[shard_id] = conn
                self._limits[shard_id] = trio.Semaphore(self._window)
                await self._note_health(shard_id, "up")
        return conn

    async def _check_incarnation(self, rec: ShardRecord, conn: ShardConnection) -> None:
        new = conn.info.incarnation
        if not new:
            return
        old = await self.meta.note_incarnation(rec.shard_id, new)
        if old and old != new:
            log.error(
                "shard %d at %s lost its memory (incarnation %016x -> %016x): every chunk it held is gone;"
                " reads of them fail with EIO, `irdma status` lists the damaged files",
                rec.shard_id, rec.address, old, new,
            )

    async def _note_health(self, shard_id: int, health: str) -> None:
        """Record a shard's health in the shard map when it changes (best effort)."""
        if self._health.get(shard_id) == health:
            return
        self._health[shard_id] = health
        try:
            await self.meta.set_shard_health(shard_id, health)
        except IrdmaError as exc:
            log.warning("cannot record shard %d as %s: %s", shard_id, health, exc)

    async def _drop(self, shard_id: int, conn: ShardConnection) -> None:
        if self._conns.get(shard_id) is conn:
            del self._conns[shard_id]
        with trio.CancelScope(shield=True):  # closing only releases local resources
            await conn.aclose()

    async def _on_shard(self, shard_id: int, fn: Callable[[ShardConnection], Awaitable[_T]], probe: bool = False) -> _T:
        """Run ``fn(connection)`` against a shard within the client's deadline.

        A shard that missed a deadline fails data calls at once for the next ``timeout``
        seconds (``probe`` calls, such as the heartbeat's STAT, still try it).

        Raises:
            ShardUnavailable: the shard failed or missed the deadline (its connection is then
                closed: a late reply can never land in a buffer whose call has returned).
        """
        rec = self._shard_map.get(shard_id)
        where = f"shard {shard_id}" + (f" at {rec.address}" if rec else "")
        hint = "is the shard process stopped or overloaded? `irdma shard list` shows its state"
        if not probe and trio.current_time() < self._down_until.get(shard_id, 0.0):
            raise ShardUnavailable(f"{where} missed its last deadline of {self.timeout:g} s; not retried yet", hint)
        conn: ShardConnection | None = None
        sent = False
        with trio.move_on_after(self.timeout):
            try:
                conn = await self.connection(shard_id)
            except ShardUnavailable:
                self._down_until[shard_id] = trio.current_time() + self.timeout
                raise
            async with self._limits[shard_id]:
                sent = True
                try:
                    result = await fn(conn)
                except ShardUnavailable:
                    await self._drop(shard_id, conn)
                    raise
                self._down_until.pop(shard_id, None)
                return result
        self._down_until[shard_id] = trio.current_time() + self.timeout
        if sent and conn is not None:
            await self._drop(shard_id, conn)
        await self._note_health(shard_id, "down")
        raise ShardUnavailable(f"{where} did not answer within {self.timeout:g} s", hint)

    async def _conn_call(self, shard_id: int, fn_name: str, *args: object, probe: bool = False) -> object:
        async def fn(conn: ShardConnection) -> object:
            return await getattr(conn, fn_name)(*args)

        return await self._on_shard(shard_id, fn, probe)

    def forget_file(self, file_id: int) -> None:
        """Drop what the connections cache of a file (called when a mount opens it: close-to-open)."""
        for conn in self._conns.values():
            conn.forget_file(file_id)

    # ------------------------------------------------------------ data plane by layout
    @staticmethod
    def _lost(layout: Layout, index: int, shard_id: int, why: str) -> DataLost:
        start = index * layout.chunk_size
        return DataLost(f"bytes [{start}, {start + layout.chunk_size}) of file {layout.file_id} (chunk {index}) are lost:"
                        f" shard {shard_id} {why}")

    async def read_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None = None) -> None:
        """Pull bytes ``[offset, offset+len(into))`` of a file into ``into``.

        A chunk that does not exist reads as zeros (a hole) unless ``chunks``, the file's chunk
        map, records it as written: then it was lost and DataLost is raised.

        Raises:
            DataLost: a recorded chunk is gone (its shard restarted on fresh memory, or it was
                freed behind the namespace's back).
            ShardUnavailable: a shard failed or missed the deadline. In both cases ``into`` is
                partly filled.
        """
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into
        pieces = list(layout.pieces(offset, len(into), self._max_piece(layout)))

        async def one(p: Piece, view: memoryview) -> None:
            rec = chunks.get(p.chunk_index) if chunks else None

            async def fn(conn: ShardConnection) -> None:
                if rec is not None and rec[1] and rec[1] != conn.info.incarnation:
                    raise self._lost(layout, p.chunk_index, p.shard_id, "restarted with empty memory since")
                version = await conn.read(layout.file_id, p.chunk_index, p.chunk_offset, view)
                if version == 0 and rec is not None:
                    raise self._lost(layout, p.chunk_index, p.shard_id, "no longer has it (freed outside the namespace)")

            await self._on_shard(p.shard_id, fn)

        if len(pieces) == 1:
            await one(pieces[0], into)
            return
        async with open_nursery() as nursery:
            for p in pieces:
                nursery.start_soon(one, p, into[p.buf_offset : p.buf_offset + p.length])

    async def write_from(
        self, layout: Layout, offset: int, data: memoryview | bytes, op: UpdateOp, chunks: ChunkMap | None = None
    ) -> list[NewChunk]:
        """Push ``data`` at ``offset`` with update op ``op`` (each chunk's part atomically).

        A chunk recorded in ``chunks`` (the file's chunk map) must still exist on its shard:
        the write is then sent with FLAG_EXISTING, so a lost chunk is never recreated from zeros.

        Returns:
            ``(chunk index, shard id, incarnation)`` of every chunk written that ``chunks`` did
            not record: the caller records them (:meth:`MetaStore.extend`) before it reports the
            write durable.

        Raises:
            BadRequest: e.g. an ``add`` not aligned to float32; NoSpace: a shard is full;
            DataLost: a recorded chunk is gone; ShardUnavailable: a shard failed or missed the
            deadline. Other chunks' parts may have been applied.
        """
        view = _as_bytes_view(data)
        pieces = list(layout.pieces(offset, len(view), self._max_piece(layout)))
        created: list[NewChunk] = []

        async def one(p: Piece, part: memoryview) -> None:
            rec = chunks.get(p.chunk_index) if chunks else None

            async def fn(conn: ShardConnection) -> None:
                if rec is not None and rec[1] and rec[1] != conn.info.incarnation:
                    raise self._lost(layout, p.chunk_index, p.shard_id, "restarted with empty memory since")
                await conn.write(layout.file_id, p.chunk_index, layout.chunk_size, p.chunk_offset, op, part,
                                 rec is not None)
                self._unsynced.add(p.shard_id)
                if rec is None:
                    created.append((p.chunk_index, p.shard_id, conn.info.incarnation))

            await self._on_shard(p.shard_id, fn)

        if len(pieces) == 1:
            await one(pieces[0], view)
        else:
            async with open_nursery() as nursery:
                for p in pieces:
                    nursery.start_soon(one, p, view[p.buf_offset : p.buf_offset + p.length])
        return created

    async def flush(self) -> None:
        """Return once every write this client made so far is durable on its shards (SYNC to
        each shard written since the last flush: ``msync``/``fsync`` on shards with a data
        directory and durability ``fsync``). What ``fsync(2)`` and ``close(2)`` on a mount wait for.

        Raises:
            ShardUnavailable: a shard failed or missed the deadline; its writes are flushed again
                by the next call.
        """
        async with self._flush_lock:
            shards, self._unsynced = self._unsynced, set()
            if not shards:
                return
            try:
                async with open_nursery() as nursery:
                    for sid in shards:
                        nursery.start_soon(self._conn_call, sid, "sync")
            except BaseException:
                self._unsynced |= shards
                raise

    def _max_piece(self, layout: Layout) -> int | None:
        sizes = [c.info.max_payload for c in self._conns.values()]
        return min(sizes) if sizes else DEFAULT_MAX_PAYLOAD

    async def truncate_data(self, layout: Layout, new_size: int) -> None:
        """Drop the bytes of a file from ``new_size`` on, on every shard of its stripe."""
        first_free = layout.chunk_count(new_size)
        async with open_nursery() as nursery:
            for shard_id in set(layout.stripe):
                nursery.start_soon(self._conn_call, shard_id, "free", layout.file_id, first_free)
            if new_size % layout.chunk_size:
                index = new_size // layout.chunk_size
                nursery.start_soon(
                    self._conn_call, layout.shard_of(index), "punch", layout.file_id, index, new_size % layout.chunk_size
                )

    async def shard_stats(self) -> list[tuple[ShardRecord, StatReply | None, str]]:
        """Every registered shard with its STAT reply, or None and the reason it failed.

        Connecting checks each shard's incarnation (see :meth:`connection`); the records
        returned are read after that, so they carry what was found.
        """
        self._shard_map = {r.shard_id: r for r in await self.meta.shards()}
        out: dict[int, tuple[ShardRecord, StatReply | None, str]] = {}

        async def one(rec: ShardRecord) -> None:
            try:
                st = await self._conn_call(rec.shard_id, "stat", probe=True)
                out[rec.shard_id] = (rec, st, "")  # type: ignore[assignment]
            except ShardUnavailable as exc:
                out[rec.shard_id] = (rec, None, str(exc))

        async with open_nursery() as nursery:
            for rec in self._shard_map.values():
                nursery.start_soon(one, rec)
        fresh = {r.shard_id: r for r in await self.meta.shards()}
        return [(fresh.get(k, out[k][0]), out[k][1], out[k][2]) for k in sorted(out)]

    async def list_chunks(self, shard_id: int) -> AsyncIterator[list[ChunkEntry]]:
        """Every chunk a shard holds, page by page (for gc and fsck)."""
        after = (0, 0)
        while True:
            page: list[ChunkEntry] = await self._conn_call(shard_id, "list_chunks", *after)  # type: ignore[assignment]
            if not page:
                return
            yield page
            after = (page[-1].file_id, page[-1].chunk_index)

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

    async def write(self, path: str, data: object, offset: int = 0, *, op: UpdateOp | str | None = None,
                    chunk_size: int | None = None) -> int:
        """Write a buffer (bytes, numpy array, memoryview) at ``offset``, creating the file.

        ``op`` defaults to the file's ``user.irdma.update`` (``assign`` unless set). The size
        grows, and the chunks written join the file's chunk map, only once every shard has
        acknowledged its part: a failed write leaves the size of what is stored.

        Returns:
            Bytes written.

        Raises:
            DataLost, NoSpace, ShardUnavailable, BadRequest: see :meth:`write_from`.
        """
        inode = await self.create(path, chunk_size=chunk_size)
        uop = UpdateOp.parse(op) if isinstance(op, str) else (op if op is not None else UpdateOp.parse(inode.update_op or "assign"))
        view = _as_bytes_view(data)
        layout = layout_of(inode)
        chunks = await self.meta.chunk_map(inode.ino)
        if offset > inode.size:
            # the gap must read as zeros: clear what an earlier, failed writer may have left there
            await self.truncate_data(layout, inode.size)
        created = await self.write_from(layout, offset, view, uop, chunks)
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
            await self.read_into(layout_of(inode), offset, memoryview(buf), await self.meta.chunk_map(inode.ino))
        return buf

    async def push(self, path: str, delta: np.ndarray, offset: int = 0) -> None:
        """Add ``delta`` (cast to little-endian float32) element-wise into the file's bytes."""
        await self.write(path, np.ascontiguousarray(delta, dtype="<f4"), offset, op=UpdateOp.ADD)

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

    async def set_update_op(self, path: str, op: str) -> None:
        """Set what writes to ``path`` do (``assign`` or ``add``); on a directory, the default
        for files created in it."""
        await self.meta.setxattr((await self.meta.resolve(path)).ino, XATTR_UPDATE, op.encode())

    async def truncate(self, path: str, size: int) -> None:
        """Set a file's size; bytes past the old end read as zeros."""
        inode = await self.meta.resolve(path)
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
        from .meta.base import UNLINK_GRACE_S

        await trio.sleep(UNLINK_GRACE_S + 0.1)
        try:
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

    async def listdir(self, path: str = "/") -> list[str]:
        return [n.decode() for n, _ in await self.meta.readdir((await self.meta.resolve(path)).ino)]

    async def stat(self, path: str) -> Inode:
        return await self.meta.resolve(path)
