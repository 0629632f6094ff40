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
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np
import trio

from ._concurrency import open_nursery
from ._errors import IsADirectory, NotFound, ShardUnavailable
from .meta import Inode, MetaStore, ShardRecord, open_meta
from .meta.base import XATTR_UPDATE
from .placement import Layout
from .protocol import DEFAULT_MAX_PAYLOAD, StatReply, UpdateOp
from .transport import ShardConnection, Transport, make_transport

#: Requests in flight per shard connection.
DEFAULT_WINDOW = 16


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
        meta: the metadata engine.
        transport: how to reach shards.
        nursery: where connection tasks live.
        credentials: bytes shards may require in the handshake.
        window: requests in flight per shard.
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
    ) -> None:
        self.meta = meta
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
    ) -> AsyncIterator[Client]:
        """Open the namespace at ``meta_url`` (see :func:`irdma.meta.open_meta`).

        Raises:
            NotFound: no metadata database there.
            TransportUnavailable: ``transport="verbs"`` where verbs cannot run.
        """
        tr = make_transport(transport) if isinstance(transport, str) else transport
        meta = open_meta(meta_url)
        try:
            async with open_nursery() as nursery:
                client = cls(meta, tr, nursery, credentials=credentials, window=window, client_name=client_name)
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
        """The connection to shard ``shard_id``, opened on first use.

        Raises:
            ShardUnavailable: the shard is not in the shard map or does not answer.
        """
        conn = self._conns.get(shard_id)
        if conn is not None:
            return conn
        lock = self._connect_locks.setdefault(shard_id, trio.Lock())
        async with lock:
            conn = self._conns.get(shard_id)
            if conn is None:
                if shard_id not in self._shard_map:
                    self._shard_map = {r.shard_id: r for r in self.meta.shards()}
                rec = self._shard_map.get(shard_id)
                if rec is None:
                    raise ShardUnavailable(f"shard {shard_id} is not in the shard map of {self.meta.url}")
                conn = await self.transport.connect(
                    rec.address, self._nursery, client_name=self._name, credentials=self._credentials
                )
                self._conns[shard_id] = conn
                self._limits[shard_id] = trio.Semaphore(self._window)
        return conn

    async def _conn_call(self, shard_id: int, fn_name: str, *args: object) -> object:
        conn = await self.connection(shard_id)
        async with self._limits[shard_id]:
            try:
                return await getattr(conn, fn_name)(*args)
            except ShardUnavailable:
                # drop a broken connection so that the next call reconnects
                if self._conns.get(shard_id) is conn:
                    del self._conns[shard_id]
                    await conn.aclose()
                raise

    def forget_file(self, file_id: int) -> None:
        """Drop what the connections cache of a file (called when a mount opens it: close-to-open)."""
        for conn in self._conns.values():
            conn.forget_file(file_id)

    # ------------------------------------------------------------ data plane by layout
    async def read_into(self, layout: Layout, offset: int, into: memoryview) -> None:
        """Pull bytes ``[offset, offset+len(into))`` of a file into ``into`` (holes read as 0).

        Raises:
            ShardUnavailable: a shard failed; ``into`` is partly filled.
        """
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into
        pieces = list(layout.pieces(offset, len(into), self._max_piece(layout)))
        if len(pieces) == 1:
            p = pieces[0]
            await self._conn_call(p.shard_id, "read", layout.file_id, p.chunk_index, p.chunk_offset, into)
            return
        async with open_nursery() as nursery:
            for p in pieces:
                nursery.start_soon(
                    self._conn_call,
                    p.shard_id,
                    "read",
                    layout.file_id,
                    p.chunk_index,
                    p.chunk_offset,
                    into[p.buf_offset : p.buf_offset + p.length],
                )

    async def write_from(self, layout: Layout, offset: int, data: memoryview | bytes, op: UpdateOp) -> None:
        """Push ``data`` at ``offset`` with update op ``op`` (each chunk's part atomically).

        Raises:
            BadRequest: e.g. an ``add`` not aligned to float32; NoSpace: a shard is full;
            ShardUnavailable: a shard failed. Other chunks' parts may have been applied.
        """
        view = _as_bytes_view(data)
        pieces = list(layout.pieces(offset, len(view), self._max_piece(layout)))
        args = [
            (p.shard_id, "write", layout.file_id, p.chunk_index, layout.chunk_size, p.chunk_offset, op,
             view[p.buf_offset : p.buf_offset + p.length])
            for p in pieces
        ]
        if len(args) == 1:
            await self._conn_call(*args[0])
            return
        async with open_nursery() as nursery:
            for a in args:
                nursery.start_soon(self._conn_call, *a)

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
        """Every registered shard with its STAT reply, or None and the reason it failed."""
        self._shard_map = {r.shard_id: r for r in self.meta.shards()}
        out: dict[int, tuple[ShardRecord, StatReply | None, str]] = {}

        async def one(rec: ShardRecord) -> None:
            try:
                with trio.fail_after(5):
                    st = await self._conn_call(rec.shard_id, "stat")
                out[rec.shard_id] = (rec, st, "")  # type: ignore[assignment]
            except (ShardUnavailable, trio.TooSlowError) as exc:
                out[rec.shard_id] = (rec, None, str(exc) or "no answer within 5 s")

        async with open_nursery() as nursery:
            for rec in self._shard_map.values():
                nursery.start_soon(one, rec)
        return [out[k] for k in sorted(out)]

    # ------------------------------------------------------------ files by path
    def _split(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rstrip("/").rpartition("/")
        return self.meta.resolve(head or "/").ino, name.encode()

    async def makedirs(self, path: str, mode: int = 0o755) -> Inode:
        """Create a directory and its missing parents (like ``mkdir -p``)."""
        inode = self.meta.getattr(1)
        for part in path.strip("/").split("/"):
            if not part:
                continue
            try:
                inode = self.meta.lookup(inode.ino, part.encode())
            except NotFound:
                inode = self.meta.create(inode.ino, part.encode(), stat.S_IFDIR | mode, os.getuid(), os.getgid())
        return inode

    async def create(self, path: str, *, chunk_size: int | None = None, mode: int = 0o644) -> Inode:
        """Create an empty file, or return the existing one.

        Raises:
            NotFound: the parent directory does not exist. InvalidArgument: bad chunk size.
        """
        parent, name = self._split(path)
        try:
            return self.meta.lookup(parent, name)
        except NotFound:
            return self.meta.create(parent, name, stat.S_IFREG | mode, os.getuid(), os.getgid(), chunk_size=chunk_size)

    async def write(self, path: str, data: object, offset: int = 0, *, op: UpdateOp | str | None = None,
                    chunk_size: int | None = None) -> int:
        """Write a buffer (bytes, numpy array, memoryview) at ``offset``, creating the file.

        ``op`` defaults to the file's ``user.irdma.update`` (``assign`` unless set).

        Returns:
            Bytes written.
        """
        inode = await self.create(path, chunk_size=chunk_size)
        uop = UpdateOp.parse(op) if isinstance(op, str) else (op if op is not None else UpdateOp.parse(inode.update_op or "assign"))
        view = _as_bytes_view(data)
        await self.write_from(layout_of(inode), offset, view, uop)
        self.meta.extend(inode.ino, offset + len(view), time.time_ns())
        return len(view)

    async def read(self, path: str, offset: int = 0, length: int | None = None) -> bytearray:
        """Read up to ``length`` bytes from ``offset`` (to the end of file by default)."""
        inode = self.meta.resolve(path)
        n = max(0, min(inode.size - offset, inode.size if length is None else length))
        buf = bytearray(n)
        if n:
            await self.read_into(layout_of(inode), offset, memoryview(buf))
        return buf

    async def push(self, path: str, delta: np.ndarray, offset: int = 0) -> None:
        """Add ``delta`` (cast to little-endian float32) element-wise into the file's bytes."""
        await self.write(path, np.ascontiguousarray(delta, dtype="<f4"), offset, op=UpdateOp.ADD)

    async def pull(self, path: str, shape: Sequence[int] | None = None, dtype: str = "<f4") -> np.ndarray:
        """Read a whole tensor: the file's bytes as ``dtype`` (little-endian float32 by default)."""
        inode = self.meta.resolve(path)
        arr = np.empty(inode.size // np.dtype(dtype).itemsize, dtype=dtype)
        if arr.nbytes:
            await self.read_into(layout_of(inode), 0, memoryview(arr).cast("B"))  # type: ignore[arg-type]
        return arr.reshape(shape) if shape is not None else arr

    async def set_update_op(self, path: str, op: str) -> None:
        """Set what writes to ``path`` do (``assign`` or ``add``); on a directory, the default
        for files created in it."""
        self.meta.setxattr(self.meta.resolve(path).ino, XATTR_UPDATE, op.encode())

    async def truncate(self, path: str, size: int) -> None:
        inode = self.meta.resolve(path)
        if size < inode.size:
            await self.truncate_data(layout_of(inode), size)
        self.meta.setattr(inode.ino, size=size)

    async def unlink(self, path: str) -> None:
        """Remove a file and free its chunks."""
        parent, name = self._split(path)
        inode = self.meta.unlink(parent, name)
        if inode.nlink <= 0:
            await self.truncate_data(layout_of(inode), 0)
            self.meta.delete_inode(inode.ino)

    async def listdir(self, path: str = "/") -> list[str]:
        return [n.decode() for n, _ in self.meta.readdir(self.meta.resolve(path).ino)]

    async def stat(self, path: str) -> Inode:
        return self.meta.resolve(path)
