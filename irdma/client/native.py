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

:class:`Client` is a facade: the shard map, placement and chains are its
:class:`~irdma.client.view.ShardView` (``client.view``), the connections its
:class:`~irdma.client.pool.ShardPool` (``client.pool``), pulls and pushes by layout its
:class:`~irdma.client.datapath.DataPath` (``client.data``), sparse rows and optimizer state
images :mod:`irdma.client.sparse` and :mod:`irdma.client.optstate`; here are the path API and
the methods that call them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar, TypeVarTuple

import numpy as np
import trio

from .. import xattrs
from .._concurrency import open_nursery
from .._errors import Exists, InvalidArgument, IrdmaError, NotFound
from ..meta import Inode, MetaStore, ShardRecord, default_key_file, open_meta
from ..meta.aio import AsyncMeta
from ..meta.base import XATTR_SHAPE, XATTR_UPDATE
from ..placement import Layout
from ..transport import ShardConnection, Transport, make_transport
from ..wire import auth
from ..wire.compress import Compression, parse_compress
from ..wire.optimizers import parse_update
from ..wire.protocol import ROUND_CLOSE, ROUND_ELASTIC, ChunkEntry, Round, StatReply, Update, UpdateOp, as_update
from . import coord
from . import snapshots as _snaps
from .cache import ChunkCache
from .datapath import ENCODE_IN_THREAD as ENCODE_IN_THREAD
from .datapath import MAX_ATTEMPTS as MAX_ATTEMPTS
from .datapath import ChunkMap as ChunkMap
from .datapath import DataPath, as_bytes_view
from .datapath import NewChunk as NewChunk
from .moves import ShardMoves
from .optstate import StateImages
from .pool import ShardPool
from .readcache import CachedReads
from .snapshots import SnapshotInfo
from .sparse import MAX_EXTENTS as MAX_EXTENTS
from .sparse import MTIME_LAZY_S as MTIME_LAZY_S
from .sparse import SparseRows
from .view import ShardView, writable
from .view import layout_of as layout_of  # its home is .view; imported from here too

#: Requests in flight per shard connection.
DEFAULT_WINDOW = 16
#: Seconds a request to a shard may take (queueing, connecting and the transfer together).
DEFAULT_TIMEOUT = 10.0

log = logging.getLogger("irdma.client")
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


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
        timeout: seconds each request to a shard may take, connecting included (a wait behind
            this client's own requests for room in a shard's window lasts while the shard answers).
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
        #: the shard map this client acts on, placement and chains (:mod:`irdma.client.view`)
        self.view = ShardView(self.meta, timeout)
        self.transport = transport
        #: the connections to the shards, their windows and deadlines (:mod:`irdma.client.pool`)
        self.pool = ShardPool(self.view, transport, nursery, keys, client_name or f"irdma-client pid {os.getpid()}",
                              window)
        #: reads, writes, chained updates, flush and truncate by layout (:mod:`irdma.client.datapath`)
        self.data = DataPath(self.view, self.pool, self.meta)
        #: the local read cache and the files validated at their open (:mod:`irdma.client.readcache`)
        self.data.cached = CachedReads(self.data, cache) if cache is not None and cache.enabled else None
        #: sparse rows (:mod:`irdma.client.sparse`) and optimizer state images (:mod:`irdma.client.optstate`)
        self.rows = SparseRows(self.data)
        self.states = StateImages(self.data)
        self._admin = ShardMoves(self.pool)  # resync, drain, rebalance, removal
        self._jobs = coord.JobSettings(self.meta)  # what a clock tick reads of its job, cached

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
        keys = auth.KeySource(key_file or default_key_file(meta_url))
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

    # ------------------------------------------------------------ shard connections and the view
    @property
    def cached(self) -> CachedReads | None:
        """The local read cache's front (:mod:`irdma.client.readcache`), or None: the data
        path's, so one object serves reads and takes invalidations."""
        return self.data.cached

    @property
    def timeout(self) -> float:
        """Seconds each request to a shard may take (the view's: chains carry it)."""
        return self.view.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.view.timeout = value

    async def connection(self, shard_id: int) -> ShardConnection:
        """The connection to shard ``shard_id`` (:meth:`ShardPool.connection`)."""
        return await self.pool.connection(shard_id)

    async def shard_call(self, shard_id: int, method: Callable[[ShardConnection, *_Ts], Awaitable[_T]], *args: *_Ts,
                         probe: bool = False) -> _T:
        """``connection.method(*args)`` against one shard within the client's deadline, e.g.
        ``await client.shard_call(sid, ShardConnection.checksum, ino, idx, client.view.epoch)``
        (:meth:`ShardPool.call`: typed; a dead or late shard is marked as the data path does).

        Raises:
            ShardUnavailable: the shard failed or missed the deadline; and what the method raises.
        """
        return await self.pool.call(shard_id, method, *args, probe=probe)

    @property
    def _view(self) -> int:
        """The view's epoch (:attr:`ShardView.epoch`; kept for the callers of this name)."""
        return self.view.epoch

    @property
    def _shard_map(self) -> dict[int, ShardRecord]:
        """The view's shard map (:attr:`ShardView.shard_map`; kept for the callers of this name)."""
        return self.view.shard_map

    def forget_file(self, file_id: int) -> None:
        """Drop what the connections cache of a file (called when a mount opens it: close-to-open)."""
        self.pool.forget_file(file_id)

    async def refresh_view(self) -> None:
        """Read the shard map and its epoch again (:meth:`ShardView.refresh`)."""
        await self.view.refresh()

    def placed(self, layout: Layout, index: int) -> tuple[tuple[int, ...], int | None]:
        """A chunk's replicas, head first, and the one joining them (:meth:`ShardView.placed`)."""
        return self.view.placed(layout, index)

    def shards_of(self, layout: Layout) -> set[int]:
        """Every shard that may hold a chunk of the file (:meth:`ShardView.shards_of`)."""
        return self.view.shards_of(layout)

    def chain_of(self, layout: Layout, index: int) -> tuple[int, ...]:
        """The replicas a chunk's updates go through now, head first (:meth:`ShardView.chain_of`).

        Raises:
            ShardUnavailable: no replica of the chunk is up to date.
        """
        return self.view.chain_of(layout, index)

    # ------------------------------------------------------------ data plane by layout (irdma.client.datapath)
    async def read_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None = None) -> None:
        """Pull bytes ``[offset, offset+len(into))`` of a file into ``into``, from the local read
        cache for a file it serves (:meth:`DataPath.read_into`: holes, DataLost, replicas).

        Raises:
            DataLost, ShardUnavailable: ``into`` is then partly filled.
        """
        await self.data.read_into(layout, offset, into, chunks)

    async def read_shards_into(self, layout: Layout, offset: int, into: memoryview, chunks: ChunkMap | None = None,
                               versions: list[int] | None = None) -> None:
        """:meth:`read_into` from the shards, never the cache (:meth:`DataPath.read_shards_into`)."""
        await self.data.read_shards_into(layout, offset, into, chunks, versions)

    async def write_from(
        self, layout: Layout, offset: int, data: memoryview | bytes | np.ndarray, op: UpdateOp | Update, chunks: ChunkMap | None = None,
        *, compress: Compression | None = None, feedback: np.ndarray | None = None,
    ) -> list[NewChunk]:
        """Push ``data`` at ``offset`` with update op ``op``, each chunk's part down its chain
        exactly once (:meth:`DataPath.write_from`: compression, error feedback, retries).

        Returns:
            ``(chunk index, shard id, incarnation)`` of every chunk replica written that
            ``chunks`` did not record: the caller records them before it reports the write durable.

        Raises:
            BadRequest, NoSpace, DataLost, ShardUnavailable, InvalidArgument: see
            :meth:`DataPath.write_from`. Other chunks' parts may have been applied.
        """
        return await self.data.write_from(layout, offset, data, op, chunks, compress=compress, feedback=feedback)

    async def flush(self) -> None:
        """Return once every write this client made so far is durable on its shards (what
        ``fsync(2)`` and ``close(2)`` on a mount wait for; :meth:`DataPath.flush`).

        Raises:
            ShardUnavailable: a shard failed or missed the deadline; its writes are flushed again
                by the next call.
        """
        await self.data.flush()

    async def truncate_data(self, layout: Layout, new_size: int) -> None:
        """Drop the bytes of a file from ``new_size`` on, on every replica
        (:meth:`DataPath.truncate_data`). Raises ShardUnavailable."""
        await self.data.truncate_data(layout, new_size)

    #: The extents of rows of a file (:meth:`SparseRows.row_extents`).
    row_extents = staticmethod(SparseRows.row_extents)

    async def read_rows_into(self, layout: Layout, ids: np.ndarray, row_bytes: int, into: memoryview,
                             chunks: ChunkMap | None = None) -> None:
        """Pull rows ``ids`` of ``row_bytes`` bytes each into ``into``, one GATHER per shard
        (:meth:`SparseRows.read_rows_into`). Raises DataLost, ShardUnavailable, BadRequest."""
        await self.rows.read_rows_into(layout, ids, row_bytes, into, chunks)

    async def write_rows_from(self, layout: Layout, ids: np.ndarray, row_bytes: int, data: memoryview | bytes,
                              op: UpdateOp | Update, chunks: ChunkMap | None = None) -> list[NewChunk]:
        """Push rows ``ids`` with update op ``op``, one SCATTER per chunk chain
        (:meth:`SparseRows.write_rows_from`). Returns the chunk replicas created; raises as
        :meth:`write_from`."""
        return await self.rows.write_rows_from(layout, ids, row_bytes, data, op, chunks)

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
                try:
                    inode = await self.meta.create(inode.ino, part.encode(), stat.S_IFDIR | mode, os.getuid(),
                                                   os.getgid())
                except Exists:  # another client made it between the lookup and the create
                    inode = await self.meta.lookup(inode.ino, part.encode())
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
            pass
        try:
            return await self.meta.create(parent, name, stat.S_IFREG | mode, os.getuid(), os.getgid(),
                                          chunk_size=chunk_size)
        except Exists:  # another client created it between the lookup and the create
            return await self.meta.lookup(parent, name)

    async def write(self, path: str, data: object, offset: int = 0, *, op: UpdateOp | Update | str | None = None,
                    chunk_size: int | None = None, compress: Compression | str | None = None,
                    feedback: np.ndarray | None = None) -> int:
        """Write a buffer (bytes, numpy array, memoryview) at ``offset``, creating the file.

        ``op`` defaults to the file's ``user.irdma.update`` (``assign`` unless set); a string is
        parsed as that xattr is (:func:`irdma.wire.optimizers.parse_update`). The size
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
        # one metadata call to open (resolve or create, with the chunk map), one to close (extend)
        inode, chunks = await self.meta.resolve_chunks(path, 0o644, os.getuid(), os.getgid(), chunk_size)
        writable(inode, path)
        uop = parse_update(op) if isinstance(op, str) else (op if op is not None else parse_update(inode.update_op or "assign"))
        return await self._write_inode(inode, data, offset, uop, coded, feedback, chunks)

    async def _write_inode(self, inode: Inode, data: object, offset: int, uop: UpdateOp | Update,
                           coded: Compression | None, feedback: np.ndarray | None, chunks: ChunkMap | None = None) -> int:
        """:meth:`write` of a file already looked up (and checked writable), with its op
        (``chunks``: its chunk map, if just read)."""
        view = as_bytes_view(data)
        layout = layout_of(inode)
        if chunks is None:
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
        inode, chunks = await self.meta.resolve_chunks(path)  # one metadata call
        n = max(0, min(inode.size - offset, inode.size if length is None else length))
        buf = bytearray(n)
        if n:
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
                   residual: np.ndarray | None = None, round: Round | None = None) -> None:
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

        ``round`` (:class:`irdma.wire.protocol.Round`: the run, the round, this member and how many
        there are) makes the push one member's contribution to a synchronous round: the shards sum
        the members' pushes of the same bytes and apply the update once, to their mean (Horovod's
        average; the sum with ``ROUND_SUM``), when the last one is in (:mod:`irdma.server.rounds`).
        Every member pushes the same ranges (``delta``'s length and ``offset``) with the same update.

        Raises:
            ValueError: a bad ``compress`` value, ``residual`` of the wrong size or dtype, or a
                file's ``user.irdma.update`` that does not parse (nothing changed).
            BadRequest: a round's push that disagrees with the round's others (nothing changed).
            And what :meth:`write` raises.
        """
        coded = _compression(compress)
        g = np.ascontiguousarray(delta, dtype="<f4").reshape(-1)
        if residual is not None and (residual.dtype != np.float32 or residual.size != g.size
                                     or not residual.flags.c_contiguous):
            raise ValueError(f"residual must be C-contiguous float32 of {g.size} elements, not {residual.dtype} of"
                             f" {residual.size}")
        inode = await self.create(path)
        writable(inode, path)
        uop: UpdateOp | Update = parse_update(inode.update_op or "assign")
        if as_update(uop).op == UpdateOp.ASSIGN:  # a push never overwrites: the gradient is added
            uop = UpdateOp.ADD
        if round is not None:
            uop = dataclasses.replace(as_update(uop), round=round)
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

    async def close_round(self, round: Round) -> int:
        """Close the synchronous rounds of run ``round.series`` up to ``round.round`` on every
        shard in service (:data:`irdma.wire.protocol.ROUND_CLOSE`): each applies the rounds it
        sums with the contributions they have, the mean over the members that pushed, and
        answers once applied. An elastic job's members send it after the job's clock passed the
        round, before they pull: a member that died mid-round no longer holds the round back.
        A shard that is down is left out (what it summed is lost with it).

        Returns:
            How many ranges were applied with fewer members than expected, over the shards.

        Raises:
            ShardUnavailable, BadRequest: a shard failed the close (it may be retried).
        """
        close = Update(UpdateOp.ADD, round=dataclasses.replace(round, flags=round.flags | ROUND_CLOSE | ROUND_ELASTIC))
        shards = [sid for sid, rec in self.view.shard_map.items()
                  if rec.state not in ("drained", "removed") and self.view.in_view(sid)]
        short = [0]

        async def one(sid: int) -> None:
            short[0] += await self.pool.run(sid, lambda conn: conn.write(0, 0, 4096, 0, close, b""))

        async with open_nursery() as nursery:
            for sid in shards:
                nursery.start_soon(one, sid)
        return short[0]

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

    async def pull_rows(self, path: str, ids: Sequence[int] | np.ndarray, *, row_len: int | None = None,
                        out: np.ndarray | None = None) -> np.ndarray:
        """Sparse pull: rows ``ids`` of a 2-D little-endian float32 file, in the order given
        (duplicates allowed), as a ``(len(ids), row_len)`` float32 array (:meth:`SparseRows.pull_rows`).

        Raises:
            InvalidArgument: bad ids, a row past the end of the file, no row length, a bad ``out``.
            DataLost, ShardUnavailable: as :meth:`pull`.
        """
        return await self.rows.pull_rows(path, ids, row_len=row_len, out=out)

    async def push_rows(self, path: str, ids: Sequence[int] | np.ndarray, rows: np.ndarray, *,
                        op: UpdateOp | Update | str | None = None, row_len: int | None = None) -> None:
        """Sparse push: apply ``rows`` to rows ``ids`` of a file with update op ``op`` (default:
        the file's ``user.irdma.update``), duplicates summed first (:meth:`SparseRows.push_rows`).

        Raises:
            InvalidArgument: bad ids or rows (nothing changed). DataLost, NoSpace,
                ShardUnavailable, BadRequest: as :meth:`write`.
        """
        await self.rows.push_rows(path, ids, rows, op=op, row_len=row_len)

    async def set_update_op(self, path: str, op: str) -> None:
        """Set what writes to ``path`` do: ``assign``, ``add`` or an optimizer with its
        arguments, e.g. ``"adam learning_rate=0.001"`` (:mod:`irdma.wire.optimizers`); on a
        directory, the default for files created in it.

        Raises:
            InvalidArgument: not a valid update op (nothing changed).
        """
        await self.meta.setxattr((await self.meta.resolve(path)).ino, XATTR_UPDATE, op.encode())

    # ------------------------------------------------------------ optimizer state
    async def state_of(self, inode: Inode) -> tuple[Layout, UpdateOp | None, int, int]:
        """Where a file's optimizer state lives: ``(layout, op, state chunk bytes, total bytes)``
        (:meth:`StateImages.state_of`; ``op`` None for ``assign`` and ``add``)."""
        return await self.states.state_of(inode)

    async def read_state_into(self, layout: Layout, per: int, offset: int, into: memoryview,
                              chunks: ChunkMap | None = None) -> None:
        """Read bytes of a file's state image (:meth:`StateImages.read_state_into`).
        Raises DataLost, ShardUnavailable."""
        await self.states.read_state_into(layout, per, offset, into, chunks)

    async def write_state_from(self, layout: Layout, per: int, offset: int, data: memoryview | bytes) -> None:
        """Restore bytes of a file's state image on every replica
        (:meth:`StateImages.write_state_from`). Raises BadRequest, NoSpace, ShardUnavailable."""
        await self.states.write_state_from(layout, per, offset, data)

    async def read_state(self, path: str) -> bytes:
        """A file's whole optimizer state image, for a checkpoint; empty when its update op is
        not an optimizer (:meth:`StateImages.read_state`). Raises ShardUnavailable."""
        return await self.states.read_state(path)

    async def write_state(self, path: str, image: bytes | memoryview) -> None:
        """Restore a file's optimizer state from a :meth:`read_state` image
        (:meth:`StateImages.write_state`).

        Raises:
            InvalidArgument: the file's op is not an optimizer, or the image's size is not this
                file's (nothing written). NoSpace, ShardUnavailable.
        """
        await self.states.write_state(path, image)

    async def optimizer_state(self, path: str) -> dict[str, np.ndarray]:
        """A file's optimizer state as arrays, one per slot (names:
        :data:`irdma.wire.optimizers.SLOT_NAMES`; :meth:`StateImages.optimizer_state`).
        Raises ShardUnavailable, DataLost."""
        return await self.states.optimizer_state(path)

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
        _, (raw_c, raw_n, raw_t, raw_e) = await self._jobs.get(job)
        if raw_n is None:
            raise InvalidArgument(f"inode {job} is not a job directory: set {xattrs.XATTR_WORKERS.decode()} on it first")
        consistency = xattrs.parse_consistency(raw_c or b"asp")
        timeout = xattrs.parse_timeout(raw_t) if raw_t else xattrs.DEFAULT_SYNC_TIMEOUT
        elastic = xattrs.parse_elastic(raw_e) if raw_e else None
        return await coord.tick(self.meta, job, w, xattrs.parse_workers(raw_n), consistency, timeout, elastic)

    async def clock(self, job_dir: str, worker: int) -> int:
        """The end of worker ``worker``'s push round in ``job_dir``: see :meth:`clock_at`."""
        ino, _ = await self._jobs.get(job_dir)
        return await self.clock_at(ino, worker)

    async def barrier(self, name: str, n: int, timeout: float = xattrs.DEFAULT_SYNC_TIMEOUT) -> None:
        """Return once ``n`` callers (any client or mount of the namespace) arrived at barrier
        ``name`` (:func:`irdma.train.coord.barrier`). Raises SyncTimeout, InvalidArgument."""
        await coord.barrier(self.meta, name, n, timeout)

    async def lock(self, name: str, lease: float, timeout: float = xattrs.DEFAULT_SYNC_TIMEOUT) -> int:
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
        writable(inode, path)
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
