"""pyfuse3 operations for an irdma namespace.

Reads are pulls, writes are pushes. Writes are asynchronous transfers (write-behind): a
``write`` hands its bytes to a task that pushes them to the shards and returns at once;
``flush`` (every ``close``) and ``fsync`` wait until every transfer of the file has been
acknowledged by its shard, persist the file size, and report the first error a transfer met
(as NFS does). So an ``fsync`` that returned means the bytes are on the shards. Overlapping
writes are pushed in the order they were made, and a read waits for the writes it overlaps.

A file whose update op is ``add`` (xattr ``user.irdma.update``) is opened with direct I/O,
so the page cache never holds a delta in place of the sum; so is a file whose xattr
``user.irdma.io`` is ``direct`` (inherited from its directory), or every file of a mount made
with ``--direct-io``: reads and writes then reach the mount in requests of up to 1 MiB with no
page-cache copy, the right choice for parameters streamed in bulk. Other files use the page cache,
kept at an open only if the file's mtime and size are what this mount saw when it last
closed it (close-to-open, as NFS revalidates), so a new open sees other workers' pushes and an
unchanged file is read again from memory. (The kernel itself drops pages a mount wrote once the
file's size or mtime changes: libfuse3 turns on auto_inval_data.)

Inode and file-handle bookkeeping follows pyfuse3's ``examples/passthroughfs.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from irdma._errors import InvalidArgument, IrdmaError
from irdma.client import Client, layout_of
from irdma.meta import Inode
from irdma.placement import Layout
from irdma.protocol import UpdateOp

from .errors import fuse_errors

log = logging.getLogger("irdma.fs")

#: Seconds the kernel may cache entries and attributes.
ATTR_TIMEOUT = 1.0
#: Write requests in flight per file before a write waits.
MAX_INFLIGHT_WRITES = 64
#: Seconds between mtime updates of a file written only through direct I/O without growing.
MTIME_LAZY_S = 1.0
#: Read-ahead: the kernel asks for 128 KiB (page cache) or up to 1 MiB (direct I/O) at a time;
#: the mount pulls aligned windows of this many bytes, serves the kernel from them, and fetches
#: the next window while it does. Windows are dropped by every write, truncate and open.
READAHEAD_WINDOW = 4 << 20
#: Windows kept per open file (bytes held: READAHEAD_WINDOW times this).
READAHEAD_WINDOWS = 6


@dataclass
class _Pending:
    start: int
    end: int
    done: trio.Event = field(default_factory=trio.Event)


@dataclass
class _FileState:
    """What this mount knows of an open file beyond the metadata engine."""

    layout: Layout
    open_count: int = 0
    size: int = 0
    dirty: bool = False  # size/mtime not yet persisted
    persisted_size: int = 0  # the size the metadata engine has
    cached_handles: int = 0  # open handles that use the page cache (they need exact mtimes)
    pending: list[_Pending] = field(default_factory=list)
    error: IrdmaError | None = None
    slots: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(MAX_INFLIGHT_WRITES))
    # read-ahead windows: start offset -> bytes, in use order; fetches in flight
    windows: dict[int, bytearray] = field(default_factory=dict)
    read_error: IrdmaError | None = None
    fetching: dict[int, trio.Event] = field(default_factory=dict)
    generation: int = 0  # bumped by every write and truncate: older windows are dropped

    def invalidate(self) -> None:
        self.generation += 1
        self.windows.clear()


@dataclass
class _Handle:
    ino: int
    op: UpdateOp
    direct: bool


class IrdmaFS(pyfuse3.Operations):
    """The filesystem. ``nursery`` must be set before the FUSE main loop starts.

    Args:
        client: an open :class:`irdma.Client`.
        direct_io: open every file with direct I/O (no page cache, 1 MiB requests).
    """

    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, client: Client, *, direct_io: bool = False) -> None:
        super().__init__()
        self.client = client
        self.direct_io = direct_io  # every file with direct I/O (else per file: user.irdma.io)
        self.meta = client.meta
        self.nursery: trio.Nursery | None = None
        self.after_init: Callable[[], object] | None = None
        self._files: dict[int, _FileState] = {}
        # (mtime_ns, size) of files as this mount last closed them: a later open of an unchanged
        # file keeps its page cache (how a restore right after a save skips the round trips)
        self._cached: dict[int, tuple[int, int]] = {}
        self._mtime_at: dict[int, float] = {}
        self._unlinked: set[int] = set()  # open here when this mount removed their last name  # time.monotonic() of each file's last mtime update
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1

    def init(self) -> None:
        """FUSE INIT: once the kernel has the reply, run ``after_init`` (it may change settings
        the kernel fixes from that reply, such as read-ahead)."""
        if self.after_init is not None and self.nursery is not None:
            fn = self.after_init

            async def later() -> None:
                fn()

            self.nursery.start_soon(later)

    # ------------------------------------------------------------ helpers
    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode.ino
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        e.st_mode = inode.mode
        e.st_nlink = max(inode.nlink, 0)
        e.st_uid = inode.uid
        e.st_gid = inode.gid
        e.st_rdev = 0
        st = self._files.get(inode.ino)
        e.st_size = st.size if st is not None and st.dirty else inode.size
        e.st_blksize = inode.chunk_size or 4096
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = inode.atime_ns
        e.st_mtime_ns = inode.mtime_ns
        e.st_ctime_ns = inode.ctime_ns
        return e

    async def _drain(self, st: _FileState, ino: int) -> None:
        """Wait for every transfer of the file; persist its size; raise the first error."""
        while st.pending:
            await st.pending[0].done.wait()
        if st.dirty:
            st.dirty = False
            # A push that does not grow a file opened only with direct I/O (a gradient to an
            # add file) refreshes mtime at most once a second, as lazytime does: one metadata
            # transaction per close of every parameter file would cost more than the push.
            now = time.monotonic()
            if st.size > st.persisted_size or st.cached_handles or now - self._mtime_at.get(ino, 0.0) >= MTIME_LAZY_S:
                self.meta.extend(ino, st.size, time.time_ns())
                st.persisted_size = max(st.persisted_size, st.size)
                self._mtime_at[ino] = now
        if st.error is not None:
            err, st.error = st.error, None
            raise err

    async def _truncate(self, inode: Inode, size: int) -> None:
        """Set a file's size: wait for its transfers, drop the bytes past ``size`` on the shards."""
        st = self._files.get(inode.ino)
        if st is not None:
            await self._drain(st, inode.ino)
            inode = self.meta.getattr(inode.ino)
        if size < inode.size:
            await self.client.truncate_data(layout_of(inode), size)
        self.meta.setattr(inode.ino, size=size)
        if st is not None:
            st.size = st.persisted_size = size
            st.invalidate()

    async def _destroy(self, inode: Inode) -> None:
        """Free the chunks of a file with no name and no open handle left, then its inode."""
        if not inode.is_dir:
            await self.client.truncate_data(layout_of(inode), 0)
        self.meta.delete_inode(inode.ino)

    async def _maybe_destroy(self, replaced: Inode | None) -> None:
        if replaced is not None and replaced.nlink <= 0:
            if replaced.ino in self._files:
                self._unlinked.add(replaced.ino)  # freed when its last handle here closes
            else:
                await self._destroy(replaced)

    # ------------------------------------------------------------ namespace
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        with fuse_errors("lookup"):
            return self._entry(self.meta.lookup(parent_inode, name))

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        with fuse_errors("getattr"):
            return self._entry(self.meta.getattr(inode))

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> pyfuse3.EntryAttributes:
        with fuse_errors("setattr"):
            kw: dict[str, int] = {}
            if fields.update_size:
                await self._truncate(self.meta.getattr(inode), attr.st_size)
            if fields.update_mode:
                kw["mode"] = attr.st_mode
            if fields.update_uid:
                kw["uid"] = attr.st_uid
            if fields.update_gid:
                kw["gid"] = attr.st_gid
            if fields.update_atime:
                kw["atime_ns"] = attr.st_atime_ns
            if fields.update_mtime:
                kw["mtime_ns"] = attr.st_mtime_ns
            return self._entry(self.meta.setattr(inode, **kw))

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        with fuse_errors("mkdir"):
            inode = self.meta.create(parent_inode, name, stat.S_IFDIR | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
            return self._entry(inode)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("rmdir"):
            self.meta.rmdir(parent_inode, name)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("unlink"):
            await self._maybe_destroy(self.meta.unlink(parent_inode, name))

    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        with fuse_errors("rename"):
            await self._maybe_destroy(self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags))

    async def opendir(self, inode: int, ctx: Any) -> int:
        with fuse_errors("opendir"):
            if not self.meta.getattr(inode).is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        with fuse_errors("readdir"):
            entries = self.meta.readdir(fh)
            for i, (name, inode) in enumerate(entries[start_id:], start=start_id + 1):
                if not pyfuse3.readdir_reply(token, name, self._entry(inode), i):
                    break

    async def releasedir(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        with fuse_errors("statfs"):
            capacity = used = 0
            for _, st, _why in await self.client.shard_stats():
                if st is not None:
                    capacity += st.capacity
                    used += st.used
            n_inodes, _ = self.meta.usage()
            s = pyfuse3.StatvfsData()
            s.f_bsize = s.f_frsize = 4096
            s.f_blocks = capacity // 4096
            s.f_bfree = s.f_bavail = (capacity - used) // 4096
            s.f_files = n_inodes + (1 << 20)
            s.f_ffree = s.f_favail = 1 << 20
            s.f_namemax = 255
            return s

    # ------------------------------------------------------------ xattrs
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        with fuse_errors("getxattr"):
            return self.meta.getxattr(inode, name)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        with fuse_errors("setxattr"):
            self.meta.setxattr(inode, name, value)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        with fuse_errors("listxattr"):
            return self.meta.listxattr(inode)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("removexattr"):
            self.meta.removexattr(inode, name)

    # ------------------------------------------------------------ files
    def _open_handle(self, inode: Inode, io_mode: bytes = b"cached") -> pyfuse3.FileInfo:
        st = self._files.get(inode.ino)
        if st is None:
            self.client.forget_file(inode.ino)  # close-to-open: no stale chunk places
            st = self._files[inode.ino] = _FileState(layout_of(inode), size=inode.size, persisted_size=inode.size)
        elif not st.pending and not st.dirty:
            st.size = st.persisted_size = inode.size
        st.invalidate()  # close-to-open: a new open pulls fresh bytes
        st.open_count += 1
        op = UpdateOp.parse(inode.update_op or "assign")
        direct = op != UpdateOp.ASSIGN or io_mode == b"direct" or self.direct_io
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(inode.ino, op, direct)
        st.cached_handles += 0 if direct else 1
        keep = not direct and self._cached.get(inode.ino) == (inode.mtime_ns, inode.size)
        log.debug("open inode %d: keep_cache %s (as last closed %s, now %s)", inode.ino, keep,
                  self._cached.get(inode.ino), (inode.mtime_ns, inode.size))
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        with fuse_errors("open"):
            node, io_mode = self.meta.getattr_io(inode)
            if node.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if flags & os.O_TRUNC:  # libfuse3 turns on atomic O_TRUNC: the truncate is ours
                await self._truncate(node, 0)
                node = self.meta.getattr(inode)
            return self._open_handle(node, io_mode)

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        with fuse_errors("create"):
            inode = self.meta.create(parent_inode, name, stat.S_IFREG | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
            _, io_mode = self.meta.getattr_io(inode.ino)
            return self._open_handle(inode, io_mode), self._entry(inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        with fuse_errors("read"):
            h = self._handles[fh]
            st = self._files[h.ino]
            for p in list(st.pending):
                if p.start < off + size and off < p.end:
                    await p.done.wait()
            file_size = st.size  # as of open, plus this mount's writes (close-to-open)
            n = max(0, min(size, file_size - off))
            if n == 0:
                return b""
            return await self._read_windows(st, off, n, file_size)

    async def _read_windows(self, st: _FileState, off: int, n: int, file_size: int) -> bytes:
        """Serve a read from read-ahead windows, fetching the missing ones and the next one."""
        first = off - off % READAHEAD_WINDOW
        starts = list(range(first, off + n, READAHEAD_WINDOW))
        nxt = starts[-1] + READAHEAD_WINDOW
        if nxt < file_size:
            self._start_fetch(st, nxt, file_size)
        for w in starts:
            while w not in st.windows:
                self._start_fetch(st, w, file_size)
                await st.fetching[w].wait()
                if w not in st.windows and st.read_error is not None:
                    err, st.read_error = st.read_error, None
                    raise err
        if len(starts) == 1:
            return bytes(memoryview(st.windows[first])[off - first : off - first + n])
        return b"".join(st.windows[w] for w in starts)[off - first : off - first + n]

    def _start_fetch(self, st: _FileState, start: int, file_size: int) -> None:
        if start in st.windows or start in st.fetching:
            return
        assert self.nursery is not None
        st.fetching[start] = trio.Event()
        self.nursery.start_soon(self._fetch, st, start, min(READAHEAD_WINDOW, file_size - start))

    async def _fetch(self, st: _FileState, start: int, length: int) -> None:
        gen = st.generation
        buf = bytearray(length)
        try:
            await self.client.read_into(st.layout, start, memoryview(buf))
            if gen == st.generation:
                st.windows[start] = buf
                while len(st.windows) > READAHEAD_WINDOWS:
                    del st.windows[next(iter(st.windows))]
        except IrdmaError as exc:
            log.warning("read-ahead of %d bytes at %d of file %d failed: %s", length, start, st.layout.file_id, exc)
            st.read_error = exc
        finally:
            st.fetching.pop(start).set()

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        with fuse_errors("write"):
            h = self._handles[fh]
            st = self._files[h.ino]
            if st.error is not None:
                err, st.error = st.error, None
                raise err
            end = off + len(buf)
            if h.op == UpdateOp.ADD and (off % 4 or len(buf) % 4):
                raise InvalidArgument(f"a write to an add file must be float32 aligned: offset {off}, {len(buf)} bytes")
            for p in list(st.pending):  # keep overlapping writes in order
                if p.start < end and off < p.end:
                    await p.done.wait()
            await st.slots.acquire()
            st.invalidate()
            entry = _Pending(off, end)
            st.pending.append(entry)
            st.size = max(st.size, end)
            st.dirty = True
            assert self.nursery is not None
            self.nursery.start_soon(self._push, st, entry, off, buf, h.op)
            return len(buf)

    async def _push(self, st: _FileState, entry: _Pending, off: int, buf: bytes, op: UpdateOp) -> None:
        try:
            await self.client.write_from(st.layout, off, buf, op)
        except IrdmaError as exc:
            log.warning("push of %d bytes at %d to file %d failed: %s", len(buf), off, st.layout.file_id, exc)
            if st.error is None:
                st.error = exc
        finally:
            st.pending.remove(entry)
            entry.done.set()
            st.slots.release()

    async def flush(self, fh: int) -> None:
        with fuse_errors("flush"):
            h = self._handles[fh]
            await self._drain(self._files[h.ino], h.ino)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh)
        st = self._files[h.ino]
        try:
            with fuse_errors("release"):
                await self._drain(st, h.ino)
        except pyfuse3.FUSEError:
            pass  # already logged; close(2) got it from flush
        finally:
            st.open_count -= 1
            st.cached_handles -= 0 if h.direct else 1
            if st.open_count == 0:
                del self._files[h.ino]
                # a direct-I/O file not unlinked here has nothing to record or free: skip the
                # metadata round trip
                if not h.direct or h.ino in self._unlinked:
                    self._unlinked.discard(h.ino)
                    with fuse_errors("release"):
                        inode = self.meta.getattr(h.ino)
                        if inode.nlink <= 0:
                            self._cached.pop(h.ino, None)
                            await self._destroy(inode)
                        elif not h.direct:
                            self._cached[h.ino] = (inode.mtime_ns, inode.size)

    async def forget(self, inode_list: Any) -> None:
        return None

