"""pyfuse3 operations for an irdma namespace.

Reads are pulls, writes are pushes. Writes are asynchronous transfers (write-behind): a
``write`` hands its bytes to a task that pushes them to the shards and returns at once;
``flush`` (every ``close``) and ``fsync`` wait until every transfer of the file has been
acknowledged by its shard, persist the file size, and report the first error a transfer met
(as NFS does). So an ``fsync`` that returned means the bytes are on the shards. Overlapping
writes are pushed in the order they were made, and a read waits for the writes it overlaps.
This module translates POSIX requests; the caching of a file's bytes (write-behind, read-ahead,
the residuals of compressed pushes) lives in :mod:`irdma.fs.cache`.

A file whose update op is ``add`` or an optimizer (xattr ``user.irdma.update``) is opened for
writing with direct I/O, so the page cache never holds a delta in place of the sum (a shared
mapping of such a handle fails with ENODEV: its pages would be pushed as deltas); opened
read-only it uses the page cache, which then holds pulled bytes only, never kept from one open to
the next (pushes may leave its mtime as it was: ``MTIME_LAZY_S``), so ``mmap(MAP_SHARED)`` of
it (``np.memmap(path, mode="r")``) reads the pulled sum. How stale those pages may get while
held open is bounded: a drain of this mount's pushes to the file (``flush`` at every ``close``,
``fsync``) drops them (``pyfuse3.invalidate_inode``, in a worker thread) before it returns, and
:meth:`IrdmaFS.refresh_pulled_pages` drops them every ``attr_cache`` seconds (1 s by default)
for pushes made elsewhere; the next read or page fault pulls. A read of such a file that does not
continue its handle's last one pulls afresh, never from a read-ahead window of an earlier scan.
A pull at every read: ``O_DIRECT`` (the kernel sends such reads past the page cache), or direct
I/O, which is what a file whose xattr ``user.irdma.io`` is ``direct`` (inherited from its
directory), or every file of a mount made with ``--direct-io``, gets: reads and writes then reach
the mount in requests of up to 1 MiB with no page-cache copy, the right choice for parameters
streamed in bulk. Other files use the page cache, kept at an open only if the file's mtime and
size are what this mount saw when it last closed it (close-to-open, as NFS revalidates), so a
new open sees other workers' pushes and an unchanged file is read again from memory. (The kernel
itself drops pages a mount wrote once the file's size or mtime changes: libfuse3 turns on
auto_inval_data.)

Never lies, never dies. Every handler runs inside :func:`fuse_errors`: an unexpected
exception fails that request with EIO and the mount serves on. A file's size grows only by
bytes the shards acknowledged (a failed push leaves the size of what is stored), and the
chunks a push created join the file's chunk map before ``close``/``fsync`` return, so a chunk
lost with a shard's memory reads as EIO, never as zeros. Extending a file (truncate up, or a
write past its end) first clears whatever a crashed writer left past the old end.

POSIX details the kernel cannot settle alone. An O_APPEND write lands at the file's size read
from the metadata at that write (or this mount's size, if larger: its own pushes in flight), not
at the offset the kernel sends: that comes from the kernel's cached size, stale for up to
``ATTR_TIMEOUT`` after another mount's writes (the Linux NFS client revalidates the size before
each append the same way). Such a handle uses direct I/O, so the page cache never holds bytes at
the kernel's offset. Appends through one mount are serialized by the kernel; appends from two
mounts at the same moment are not atomic (a write another mount has not flushed yet is not
seen), as on NFS. A write through
a handle that an unprivileged process opened for writing clears S_ISUID/S_ISGID (the kernel does
so for page-cache writes only; a FUSE ``write`` has no request context, so the open decides).
Permissions, the sticky bit and chown rules are the kernel's (``default_permissions``).

One file's lifetime across mounts: this mount is a *session* in the metadata (heartbeats
every ``HEARTBEAT_S``); each file open here is recorded there, so a file unlinked or renamed
over by any mount keeps its chunks until the last handle on any live mount closes (JuiceFS's
"sustained" inodes), and an open through a cached name of a removed inode answers ESTALE so
the kernel looks the path up again. A mount whose session was reaped (it missed its heartbeats)
registers again and records its open files anew; a file removed meanwhile (its chunks may be
freed) answers ESTALE to every read, write and fsync through the handles still open on it,
never stale or zeroed bytes. Metadata calls run in worker threads.

Compressed pushes with error feedback. A file whose update op is ``add`` or an optimizer and
whose xattr ``user.irdma.compress`` (else its directory's, read at open) is ``topk:FRACTION`` or
``sign`` gets handles whose writes are sent compressed (:mod:`irdma.wire.compress`) and decoded on the
shards. This mount keeps one residual per inode (:class:`irdma.fs.cache.Residuals`: float32,
one element per 4 bytes of the file, made on the first compressed write and grown to cover what
is written): a write of gradient ``g`` at ``off`` pushes ``g + residual[off/4 : ...]`` and keeps
what the compression dropped in its place, so error feedback works through plain ``pwrite``. The
residual of a write that failed is left as it was (the write's error is reported as for any
push). It lives as long as the kernel knows the inode (dropped at ``forget``, or once the file
has no name left): across opens and closes, not across mounts. Writes of ``assign`` are never
compressed.

Inode and file-handle bookkeeping follows pyfuse3's ``examples/passthroughfs.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyfuse3
import trio

from irdma._errors import InvalidArgument, IrdmaError, NoAttribute, NotFound, ReadOnly, Stale
from irdma.client import snapshots
from irdma.client.native import ChunkMap, Client, layout_of
from irdma.meta import ROOT_INO, Inode
from irdma.meta.base import SNAPSHOTS_DIR, SNAPSHOTS_DIR_MARK, XATTR_UPDATE, setid_bits
from irdma.ops.metrics import fuse_metrics
from irdma.placement import Layout
from irdma.train import comm, coord
from irdma.train.optimizers import parse_update
from irdma.wire.compress import XATTR_COMPRESS, Compression, parse_compress
from irdma.wire.protocol import Update, UpdateOp

from .cache import ReadAhead, Residuals, WriteBehind
from .control import CLOCK_PREFIX, CONTROL, STATE_PREFIX, XATTR_MOUNT, Control, caller_of
from .errors import fuse_errors

log = logging.getLogger("irdma.fs")

#: Seconds the kernel may cache a file's attributes (``irdma mount --attr-cache``'s default).
ATTR_TIMEOUT = 1.0
#: Seconds the kernel may cache a name's inode (``irdma mount --entry-cache``'s default). A mount
#: with a longer one raises the namespace's unlink grace to twice it before it serves
#: (:meth:`irdma.meta.base.MetaStore.raise_unlink_grace`): a name it cached stays openable.
ENTRY_TIMEOUT = 1.0
#: Requests that change the namespace or a file: a read-only mount answers them EROFS.
WRITE_OPS = frozenset({"write", "create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename", "setattr",
                       "setxattr", "removexattr"})
#: Seconds between mtime updates of a file written only through direct I/O without growing.
MTIME_LAZY_S = 1.0
#: Seconds between a mount's session heartbeats (and shard health checks).
HEARTBEAT_S = 5.0
#: Shortest period, in seconds, of :meth:`IrdmaFS.refresh_pulled_pages` (it runs every
#: ``--attr-cache`` seconds, so at this rate with ``--attr-cache 0``).
PULL_REFRESH_MIN_S = 0.1
#: Kernel page invalidations (they may block: :meth:`IrdmaFS._drop_pulled_pages`) in worker threads
#: at once; a limiter of their own, so a blocked one never holds a thread the metadata calls need.
INVALIDATIONS_IN_THREADS = 4


@dataclass
class _FileState:
    """What this mount knows of an open file beyond the metadata engine. Its bytes in flight
    and read ahead: ``write_behind`` and ``read_ahead`` (:mod:`irdma.fs.cache`), which share
    ``layout`` and ``chunks`` with it."""

    layout: Layout
    chunks: ChunkMap  # recorded (or created here) chunks
    write_behind: WriteBehind
    read_ahead: ReadAhead
    open_count: int = 0
    size: int = 0  # as reads and getattr see it here: persisted plus pushes in flight
    dirty: bool = False  # size/mtime/chunk map not yet persisted
    persisted_size: int = 0  # the size the metadata engine has
    cached_handles: int = 0  # open handles that use the page cache (they need exact mtimes)
    #: of those, handles of a file whose update op is not assign (read-only: they hold pulled
    #: bytes that pushes change without moving mtime): IrdmaFS.refresh_pulled_pages drops theirs
    pulled_handles: int = 0
    pushed: bool = False  # a write was admitted since the pages of those handles were last dropped
    #: set when this mount could not record the file as open after its session was reaped
    #: (the inode was removed meanwhile): every read, write, flush and fsync fails with it
    lost: IrdmaError | None = None

    def invalidate(self) -> None:
        """Drop the read-ahead windows: every write, truncate and open (close-to-open)."""
        self.read_ahead.invalidate()


@dataclass
class _Handle:
    ino: int
    op: Update
    direct: bool
    kill_setid: bool = False  # opened for writing by an unprivileged process: the first write clears S_ISUID/S_ISGID
    append: bool = False  # O_APPEND: every write lands at the file's size as this mount knows it
    next_read: int = 0  # where a sequential read would start (read-ahead; a fresh handle: 0)
    seq_hits: int = 0  # sequential reads in a row (the read-ahead window doubles with each)
    compress: Compression | None = None  # user.irdma.compress of the file (or its directory) at open
    sched: comm.Scheduling | None = None  # user.irdma.priority/.slice of the file (or its directory) at open
    writable: bool = True  # opened for writing: told of every push of the file that fails while open
    pulled: bool = False  # a page-cached handle of a file with an update op (see _FileState.pulled_handles)
    error: IrdmaError | None = None  # a push that failed since this handle's last flush/fsync (errseq)


def _scheduled(h: _Handle) -> contextlib.AbstractContextManager[object]:
    """The P3 priority and slices of a handle's requests (none set: as they come)."""
    return comm.priority(h.sched.level, h.sched.slice_bytes) if h.sched is not None else contextlib.nullcontext()


class IrdmaFS(pyfuse3.Operations):
    """The filesystem. ``nursery`` must be set, and :meth:`start_session` awaited, before the
    FUSE main loop starts.

    Args:
        client: an open :class:`irdma.Client`.
        direct_io: open every file with direct I/O (no page cache, 1 MiB requests).
        read_only: answer every request that would change something (:data:`WRITE_OPS`, an
            open for writing or with O_TRUNC) with EROFS, as ``juicefs mount --read-only``.
        root: the namespace directory served as the mount's root (``--subdir``): the kernel's
            inode 1 is it, it is its own ``..``, and it is listed as inode 1; no other inode
            number changes (nothing above it can be named from inside: directories have one name).
        attr_cache, entry_cache: seconds the kernel may cache attributes and names (FUSE's
            attr_timeout and entry_timeout).
    """

    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, client: Client, *, direct_io: bool = False, read_only: bool = False, root: int = ROOT_INO,
                 attr_cache: float = ATTR_TIMEOUT, entry_cache: float = ENTRY_TIMEOUT) -> None:
        super().__init__()
        self.client = client
        self.direct_io = direct_io  # every file with direct I/O (else per file: user.irdma.io)
        self.read_only, self.root, self.attr_cache, self.entry_cache = read_only, root, attr_cache, entry_cache
        self.meta = client.meta
        self.sid = 0  # this mount's session in the metadata
        self.nursery: trio.Nursery | None = None
        self.after_init: Callable[[], object] | None = None
        self._files: dict[int, _FileState] = {}
        # (mtime_ns, size) of files as this mount last closed them: a later open of an unchanged
        # file keeps its page cache (how a restore right after a save skips the round trips)
        self._cached: dict[int, tuple[int, int]] = {}
        self._mtime_at: dict[int, float] = {}  # time.monotonic() of each file's last mtime update
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        #: readdir snapshots per open directory: (name, inode), or (b"..", parent's inode number)
        self._dirs: dict[int, list[tuple[bytes, Inode | int]]] = {}
        self._control_dirs: dict[int, list[tuple[bytes, int]]] = {}
        #: open ``.irdma-state@NAME`` handles: (layout, state chunk bytes, image bytes, inode, chunk map)
        self._state_handles: dict[int, tuple[Layout, int, int, Inode, ChunkMap]] = {}
        # an open and the last release of one inode never interleave (FUSE sends RELEASE
        # asynchronously: a reopen may arrive while the last close is freeing the file)
        self._ino_locks: dict[int, trio.Lock] = {}
        #: inodes open here not yet recorded as open in the session (after it was registered again)
        self._unrecorded: set[int] = set()
        #: error feedback of compressed writes: per inode, float32, element i is bytes [4i, 4i+4)
        self._residuals = Residuals()
        #: ``.irdma/``: barriers, locks and counters as files (:mod:`irdma.fs.control`)
        self.control = Control(self.meta, 0, tick=client.clock_at)
        self._invalidations = trio.CapacityLimiter(INVALIDATIONS_IN_THREADS)

    def init(self) -> None:
        """FUSE INIT: once the kernel has the reply, run ``after_init`` (it may change settings
        the kernel fixes from that reply, such as read-ahead)."""
        if self.after_init is not None and self.nursery is not None:
            fn = self.after_init

            async def later() -> None:
                fn()

            self.nursery.start_soon(later)

    # ------------------------------------------------------------ session
    async def start_session(self, name: str) -> None:
        """Register this mount as a session, then reap dead sessions and their orphans."""
        self.sid = await self.meta.open_session(name)
        self.control.session = self.sid
        if self.read_only:
            return  # it changes nothing in the namespace (the next read-write mount or `irdma gc` reaps)
        from irdma.ops.fsck import collect_garbage

        try:
            report = await collect_garbage(self.client, leaked_chunks=False)
            if report.sessions or report.orphans:
                log.info("reaped %d dead sessions and %d orphaned files at start", len(report.sessions),
                         len(report.orphans))
        except IrdmaError as exc:
            log.warning("garbage collection at start failed (run `irdma gc`): %s", exc)

    async def run_heartbeats(self) -> None:
        """Keep the session alive and the shard map's health current, every HEARTBEAT_S."""
        while True:
            await trio.sleep(HEARTBEAT_S)
            try:
                await self.meta.heartbeat(self.sid)
            except NotFound:
                log.error("session %d was reaped (missed heartbeats): registering again", self.sid)
                try:
                    self.sid = await self.meta.open_session(f"{self.client.pool.name} (again)")
                    self.control.session = self.sid
                    self._unrecorded.update(self._files)
                except IrdmaError as exc:
                    log.warning("registering the session again failed (retried in %g s): %s", HEARTBEAT_S, exc)
            except IrdmaError as exc:
                log.warning("heartbeat failed: %s", exc)
            await self._record_open_files()
            try:
                await self.client.shard_stats()  # marks shards up/down in the shard map
                await self.client.resync_all()  # shards back after being down catch up
            except IrdmaError as exc:
                log.warning("shard health check failed: %s", exc)

    async def refresh_pulled_pages(self) -> None:
        """Bound how stale a parameter file's pages held here may be: every ``attr_cache``
        seconds (at least :data:`PULL_REFRESH_MIN_S`), drop the kernel's pages and the read-ahead
        windows of each file open here through a page-cached handle whose update op is not
        ``assign`` (a read-only open: a read or ``mmap`` of it then pulls afresh). Pushes made
        elsewhere (another mount, the native client) may leave such a file's mtime as it was
        (``MTIME_LAZY_S``), so the kernel's revalidation of its attributes would never drop them.
        Runs in the mount's nursery for the mount's life; costs nothing while no such handle is
        open."""
        period = max(self.attr_cache, PULL_REFRESH_MIN_S)
        while True:
            await trio.sleep(period)
            for ino, st in list(self._files.items()):
                if st.pulled_handles and self._files.get(ino) is st:
                    await self._drop_pulled_pages(st, ino)

    async def _drop_pulled_pages(self, st: _FileState, ino: int) -> None:
        """Drop the read-ahead windows of file ``ino`` and the kernel's cached pages (and
        attributes) of it: its next read, or fault of a mapping, pulls from the shards.

        ``pyfuse3.invalidate_inode`` may block (the kernel locks each cached page, so it waits for
        a read of that page in flight): it runs in a worker thread while this mount serves on,
        and is never called from a read request of the file (that would wait for itself)."""
        st.invalidate()
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, limiter=self._invalidations,
                                          abandon_on_cancel=True)
        except OSError as exc:  # ENOENT: the kernel forgot the inode (nothing cached); ENOSYS
            log.debug("cannot drop the cached pages of inode %d: %s", ino, exc)

    async def _record_open_files(self) -> None:
        """Record, in the session registered again, every file open here. A file removed while
        the session was gone (reaped: its open records dropped, so its chunks may be freed
        already) is marked lost: its handles' reads, writes, flushes and fsyncs fail with
        ESTALE from then on, never serve freed chunks. Any other failure is retried at the
        next heartbeat."""
        for ino in list(self._unrecorded):
            st = self._files.get(ino)
            if st is None:
                self._unrecorded.discard(ino)
                continue
            try:
                async with self._ino_lock(ino):  # no open or last close of it meanwhile
                    if self._files.get(ino) is not st:  # closed meanwhile (a new open recorded itself)
                        self._unrecorded.discard(ino)
                        continue
                    try:
                        await self.meta.open_inode(self.sid, ino)
                    except (Stale, NotFound) as exc:
                        log.error("file %d, open here, was removed while this mount's session was reaped (%s):"
                                  " its open handles fail with ESTALE; close and reopen it by name", ino, exc)
                        st.lost = Stale(f"inode {ino} was removed while the mount's session was reaped: reopen it")
                    except IrdmaError as exc:
                        log.warning("cannot record file %d as open in session %d (retried in %g s): %s", ino,
                                    self.sid, HEARTBEAT_S, exc)
                        continue
                    self._unrecorded.discard(ino)
            finally:
                self._ino_unlock_done(ino)

    async def end_session(self) -> None:
        if self.sid:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self.meta.close_session(self.sid)

    # ------------------------------------------------------------ helpers
    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ROOT_INO if inode.ino == self.root else inode.ino
        e.generation = 0
        e.entry_timeout = self.entry_cache
        # a .snapshots shows its directory's mode and owner now: the kernel asks again at each check
        e.attr_timeout = 0 if inode.snap == SNAPSHOTS_DIR_MARK else self.attr_cache
        e.st_mode = inode.mode
        e.st_nlink = max(inode.nlink, 0)
        e.st_uid = inode.uid
        e.st_gid = inode.gid
        e.st_rdev = inode.rdev
        st = self._files.get(inode.ino)
        e.st_size = st.size if st is not None and st.dirty else inode.size
        e.st_blksize = inode.chunk_size or 4096
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = inode.atime_ns
        e.st_mtime_ns = inode.mtime_ns
        e.st_ctime_ns = inode.ctime_ns
        return e

    async def _getattr(self, ino: int) -> Inode:
        try:
            return await self.meta.getattr(ino)
        except NotFound:
            raise Stale(f"inode {ino} was removed") from None

    async def _drain(self, st: _FileState, ino: int, h: _Handle | None = None, advance: bool = True,
                     keep_error: bool = False) -> None:
        """Wait for every transfer of the file; persist the size of what the shards
        acknowledged and the chunks created; raise the first error.

        The records of acknowledged pushes (their ends, the chunks they created) are forgotten
        only once the metadata engine has them: an ``extend`` that fails or is cancelled leaves
        them, and the file dirty, for the next flush, fsync or close to record (a chunk missing
        from the chunk map would read as zeros). Drains of one file take turns, so a truncate
        never runs between another drain's snapshot and its ``extend``.

        ``h``: the handle a flush, fsync or close drains for: it hears of every push that failed
        while it was open for writing, whatever other drains reported (errseq); without one (a
        truncate), the first error a push met since the last drain. ``advance``: the error is
        forgotten once reported (fsync, as ``file_check_and_advance_wb_err``); without it
        (FUSE_FLUSH, sent at every ``close`` of any descriptor of the open file, also one a
        forked child inherited and closed at exec) it is reported and kept for the next fsync,
        as ``filemap_check_wb_err``: a child's close must not take the error from the
        writer's fsync. ``keep_error`` (a setattr of mtime, which drains first): a push's error
        is neither raised nor forgotten; the writers hear of it at their flush, fsync or close.

        Raises:
            IrdmaError: a push's error (see ``h``), the metadata engine's error (the records
                are kept for the next drain); Stale: the file was written here and then removed
                while the session was reaped (``lost``).
        """
        wb = st.write_behind
        await wb.wait_all()
        if st.pushed:
            st.pushed = False  # a write admitted from here on sets it again for the next drain
            if st.pulled_handles:  # before fsync/close return: the pages held here show the new sums
                await self._drop_pulled_pages(st, ino)
        if st.lost is not None:  # removed while the session was reaped: nothing can be recorded
            if st.dirty:
                raise st.lost
            return
        async with wb.persist:
            if st.dirty and wb.acked_ends:
                try:
                    await self.client.flush()  # durable on the shards before close/fsync return
                except IrdmaError as exc:  # every writer hears of it, not just this drain's caller
                    self._tell_writers(ino, exc, but=h)
                    raise
            if st.dirty:
                seen = wb.seen(st.persisted_size)
                new_size, chunks = seen.size, seen.chunks
                # bytes past a failed push are not the file's (writes admitted meanwhile still are)
                st.size = max(new_size, st.persisted_size, *(p.end for p in wb.pending))
                # A push that does not grow a file opened only with direct I/O (a gradient to an
                # add file) refreshes mtime at most once a second, as lazytime does: one metadata
                # transaction per close of every parameter file would cost more than the push.
                now = time.monotonic()
                if (chunks or new_size > st.persisted_size or st.cached_handles
                        or now - self._mtime_at.get(ino, 0.0) >= MTIME_LAZY_S):
                    await self.meta.extend(ino, new_size, time.time_ns(), chunks)
                    st.persisted_size = max(st.persisted_size, new_size)
                    self._mtime_at[ino] = now
                # recorded: forget what this drain saw (pushes that ended meanwhile appended after it)
                st.dirty = wb.forget(seen)
        if h is not None:
            err = h.error
            if err is not None:
                if advance:
                    h.error = None
                wb.error = None  # writes go on: this handle was told
                raise err
            return
        if keep_error:
            return
        first = wb.take_error()
        if first is not None:
            raise first

    async def _truncate(self, inode: Inode, size: int) -> None:
        """Set a file's size. Shrinking forgets the chunks past the end in the metadata first,
        then frees them; growing first clears what a failed writer may have left past the old
        end, so the new bytes read as zeros."""
        if inode.snap:
            raise ReadOnly(f"inode {inode.ino} is in a snapshot, which is read-only")
        st = self._files.get(inode.ino)
        if st is not None:
            async with st.write_behind.admit:
                await self._drain(st, inode.ino)
                await self._truncate_locked(await self._getattr(inode.ino), size, st)
        else:
            await self._truncate_locked(inode, size, None)

    async def _truncate_locked(self, inode: Inode, size: int, st: _FileState | None) -> None:
        layout = layout_of(inode)
        if size < inode.size:
            await self.meta.setattr(inode.ino, size=size)
            await self.client.truncate_data(layout, size)
        else:
            await self.client.truncate_data(layout, inode.size)
            await self.meta.setattr(inode.ino, size=size)
        if st is not None:
            st.size = st.persisted_size = size
            first_gone = layout.chunk_count(size)
            for idx in [i for i in st.chunks if i >= first_gone]:
                del st.chunks[idx]
            st.invalidate()

    async def _destroy(self, inode: Inode) -> None:
        """Free the chunks of a file with no name and no open handle left, then its inode."""
        self._residuals.drop(inode.ino)
        if not inode.is_dir and inode.stripe:
            await self.client.truncate_data(layout_of(inode), 0)
        await self.meta.delete_inode(inode.ino)

    async def _maybe_destroy(self, replaced: Inode | None) -> None:
        if replaced is not None and replaced.nlink <= 0:
            self._residuals.drop(replaced.ino)  # no name left: nobody pushes to it again
        if replaced is not None and replaced.nlink <= 0 and replaced.ino not in self._files:
            # freed after its grace period unless a live session holds it open then (its last
            # close frees it)
            assert self.nursery is not None
            self.nursery.start_soon(self.client.destroy_later, replaced.ino)

    @staticmethod
    def _kills_setid(inode: Inode, flags: int, ctx: Any) -> bool:
        """Whether writes through this open must clear S_ISUID/S_ISGID: a regular file that
        has them, opened for writing by a process that is not root. (The kernel does it itself
        for page-cache writes, not for direct I/O ones, and pyfuse3's ``write`` has no request
        context: so the open decides, and the handle's first write clears them, as Linux's
        ``file_remove_privs`` does on a write. Root stands for CAP_FSETID.)"""
        return (ctx is not None and ctx.uid != 0 and flags & os.O_ACCMODE != os.O_RDONLY
                and stat.S_ISREG(inode.mode) and setid_bits(inode.mode) != 0)

    # ------------------------------------------------------------ namespace
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        with fuse_errors("lookup"):
            if name == CONTROL and not Control.owns(parent_inode):  # DIR/.irdma: DIR's sync objects
                return await self._control_entry(self.control.scope_dir(parent_inode), ctx)
            if Control.owns(parent_inode):
                return await self._control_entry(self.control.lookup(parent_inode, name), ctx)
            if name.startswith(CLOCK_PREFIX):  # JOB/.irdma-clock@K (irdma.train.coord)
                if not (await self._getattr(parent_inode)).is_dir:
                    raise NotFound("not a directory")
                return await self._control_entry(self.control.clock_file(parent_inode, name), ctx)
            if name.startswith(STATE_PREFIX):  # DIR/.irdma-state@NAME: NAME's optimizer state
                target = await self.meta.lookup(parent_inode, name[len(STATE_PREFIX):])
                if target.is_dir:
                    raise NotFound(f"{name.decode(errors='replace')}: a directory has no optimizer state")
                return await self._state_entry(self.control.state_file(target.ino))
            try:
                return self._entry(await self.meta.lookup(parent_inode, name))
            except NotFound:
                if name != SNAPSHOTS_DIR:
                    raise
                # always there, as CephFS's .snap; a read-only mount writes nothing: only one that exists
                return self._entry(await self.meta.snapshots_dir(parent_inode, create=not self.read_only))

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        with fuse_errors("getattr"):
            if Control.owns(inode):
                if self.control.target_of(inode) is not None:
                    return await self._state_entry(inode)
                return await self._control_entry(inode, ctx)
            return self._entry(await self._getattr(inode))

    async def _state_of(self, target_ino: int) -> tuple[Layout, int, int, Inode]:
        """``(layout, state chunk bytes, image bytes, inode)`` of a file's optimizer state,
        sized by the file as this mount sees it (its own writes included)."""
        target = await self._getattr(target_ino)
        st = self._files.get(target_ino)
        if st is not None and st.dirty:
            target = dataclasses.replace(target, size=st.size)
        layout, _, per, total = await self.client.state_of(target)
        return layout, per, total, target

    async def _state_handle(self, fh: int, target_ino: int) -> tuple[Layout, int, int, Inode, ChunkMap]:
        """What a state image handle reads and writes, looked up at its first request and kept
        until it is released (close-to-open, as a file's size): no metadata round trip per
        request. The chunk map is this mount's own when it has the file open."""
        got = self._state_handles.get(fh)
        if got is None:
            layout, per, total, node = await self._state_of(target_ino)
            st = self._files.get(target_ino)
            chunks = st.chunks if st is not None else await self.meta.chunk_map(target_ino)
            got = self._state_handles[fh] = (layout, per, total, node, chunks)
        return got

    async def _state_entry(self, ino: int) -> pyfuse3.EntryAttributes:
        """Attributes of a state image: its file's owner and mode (so the kernel's permission
        checks are the file's), its size, never cached."""
        target_ino = self.control.target_of(ino)
        assert target_ino is not None
        _, _, total, target = await self._state_of(target_ino)
        e = self._entry(target)
        e.st_ino = ino
        e.st_size = total
        e.st_blocks = (total + 511) // 512
        e.entry_timeout = e.attr_timeout = 0
        return e

    async def _control_entry(self, ino: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        for k, v in (await self.control.attr(ino, ctx)).items():
            setattr(e, k, v)
        e.entry_timeout = e.attr_timeout = 0
        return e

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> pyfuse3.EntryAttributes:
        with fuse_errors("setattr"):
            if Control.owns(inode):  # chmod, chown of a sync object; `echo 4 > counter` truncates: ignored
                await self.control.setattr(inode, attr, fields, ctx)
                return await self._control_entry(inode, ctx)
            kw: dict[str, int] = {}
            if fields.update_size:
                await self._truncate(await self._getattr(inode), attr.st_size)
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
                st = self._files.get(inode)
                if st is not None:
                    # A time the user sets (tar -x, cp -a, rsync: utimensat before close) outlives
                    # the writes made before it: they are recorded first, so no later drain of them
                    # stamps its own time over it (the NFS client flushes before a SETATTR too).
                    async with st.write_behind.admit:
                        await self._drain(st, inode, keep_error=True)
                        return self._entry(await self.meta.setattr(inode, **kw))
            return self._entry(await self.meta.setattr(inode, **kw))

    @staticmethod
    def _new_name(name: bytes) -> None:
        """Refuse a new name the mount serves itself (``.irdma-clock@K``, ``.irdma-state@NAME``):
        a real file there would be hidden behind the virtual one."""
        if name.startswith((CLOCK_PREFIX, STATE_PREFIX)):
            raise InvalidArgument(f"{name.decode(errors='replace')}: names starting {CLOCK_PREFIX.decode()} or"
                                  f" {STATE_PREFIX.decode()} are the mount's own (clocks, optimizer state): pick another")

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        with fuse_errors("mkdir"):
            if (await self._getattr(parent_inode)).snap == SNAPSHOTS_DIR_MARK:  # mkdir D/.snapshots/NAME
                who = caller_of(ctx)  # its owner; it must read every file the snapshot would keep
                await snapshots.create_at(self.client, await self.meta.parent_of(parent_inode), name,
                                          owner=who.uid or None, reader=(who.uid, sorted({who.gid, *who.groups})))
                return self._entry(await self.meta.lookup(parent_inode, name))
            self._new_name(name)
            inode = await self.meta.create(parent_inode, name, stat.S_IFDIR | (mode & ~ctx.umask & 0o7777), ctx.uid,
                                           ctx.gid)
            return self._entry(inode)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("rmdir"):
            if (await self._getattr(parent_inode)).snap == SNAPSHOTS_DIR_MARK:  # rmdir D/.snapshots/NAME
                await snapshots.delete_at(self.client, await self.meta.parent_of(parent_inode), name, uid=ctx.uid)
                return
            await self.meta.rmdir(parent_inode, name)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("unlink"):
            await self._maybe_destroy(await self.meta.unlink(parent_inode, name))

    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        with fuse_errors("rename"):
            self._new_name(name_new)
            await self._maybe_destroy(
                await self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
            )

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        """A hard link: the file's chunks stay until its last name and its last open handle go."""
        with fuse_errors("link"):
            self._new_name(new_name)
            return self._entry(await self.meta.link(inode, new_parent_inode, new_name))

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        with fuse_errors("symlink"):
            self._new_name(name)
            return self._entry(await self.meta.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        with fuse_errors("readlink"):
            return await self.meta.readlink(inode)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> pyfuse3.EntryAttributes:
        """FIFOs, sockets and device nodes (metadata only: the kernel serves them, never this
        mount); a regular file when ``mode`` says so."""
        with fuse_errors("mknod"):
            self._new_name(name)
            perm = mode & ~ctx.umask & 0o7777
            if stat.S_IFMT(mode) in (0, stat.S_IFREG):
                inode = await self.meta.create(parent_inode, name, stat.S_IFREG | perm, ctx.uid, ctx.gid)
            else:
                inode = await self.meta.mknod(parent_inode, name, stat.S_IFMT(mode) | perm, ctx.uid, ctx.gid, rdev)
            return self._entry(inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        """Take a snapshot of the directory: readdir continuations are served from it (linear
        in the directory's size, and stable while other mounts change it). It starts with
        ``.`` (the directory) and ``..`` (its parent; the root's is the root), as POSIX
        readdir(3) and getdents(2) callers expect (``ls -a``, pjdfstest)."""
        with fuse_errors("opendir"):
            if Control.owns(inode):
                fh = self._next_fh
                self._next_fh += 1
                entries = self.control.entries(inode)
                self._control_dirs[fh] = [(b".", inode), (b"..", self.control.parent_of(inode)), *entries]
                return fh
            node = await self._getattr(inode)
            if not node.is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            up = inode if inode == self.root else await self.meta.parent_of(inode)
            listing = await self.meta.readdir(inode)
            fh = self._next_fh
            self._next_fh += 1
            self._dirs[fh] = [(b".", node), (b"..", up), *listing]
            return fh

    @staticmethod
    def _dot_entry(ino: int) -> pyfuse3.EntryAttributes:
        """The entry of a ``..`` in a readdir reply: the kernel takes only the inode number and
        the type from a ``.`` or ``..`` entry (it never caches their attributes or counts a
        lookup of them), so no metadata round trip fetches the parent's attributes."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.st_mode = stat.S_IFDIR | 0o755
        return e

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        with fuse_errors("readdir"):
            if fh in self._control_dirs:
                listing = self._control_dirs[fh]
                for i in range(start_id, len(listing)):
                    name, ino = listing[i]
                    e = (await self._control_entry(ino)) if Control.owns(ino) else self._dot_entry(
                        ROOT_INO if ino == self.root else ino)
                    if not pyfuse3.readdir_reply(token, name, e, i + 1):
                        break
                return
            entries = self._dirs.get(fh, [])
            for i in range(start_id, len(entries)):
                name, inode = entries[i]
                e = self._entry(inode) if isinstance(inode, Inode) else self._dot_entry(
                    ROOT_INO if inode == self.root else inode)
                if not pyfuse3.readdir_reply(token, name, e, i + 1):
                    break

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)
        self._control_dirs.pop(fh, None)

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        """The shards' capacity and use, divided by the namespace's replica count."""
        with fuse_errors("statfs"):
            capacity = used = 0
            for _, st, _why in await self.client.shard_stats():
                if st is not None:
                    capacity += st.capacity
                    used += st.used
            n_inodes, _ = await self.meta.usage()
            # in bytes a file can hold: each chunk takes room on `replicas` shards
            r = max(1, min(await self.meta.replicas(), len(self.client._shard_map) or 1))
            capacity, used = capacity // r, used // r
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
            if self.control.owns(inode):  # sync objects and clock files keep no xattrs
                raise NoAttribute(f"{name.decode(errors='replace')} is not set on a control file")
            if name == coord.XATTR_CLOCKS:
                clocks = await self.meta.clocks(inode)
                return " ".join(f"{w}:{c}" for w, c in sorted(clocks.items())).encode()
            if name == XATTR_MOUNT and inode == self.root:  # what this mount shows (irdma info, irdma snapshot)
                shown = self.control.mount_xattr()
                if shown is not None:
                    return shown
            return await self.meta.getxattr(inode, name)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        with fuse_errors("setxattr"):
            try:
                await self.meta.setxattr(inode, name, value)
            except InvalidArgument as exc:
                log.warning("setxattr %s=%r on inode %d refused: %s", name.decode(errors="replace"), value[:200],
                            inode, exc)
                raise
            if name == XATTR_UPDATE:  # this mount's open handles push with the new op at once
                op = parse_update(value)
                for h in self._handles.values():
                    if h.ino == inode and h.op.op.is_float32 == op.op.is_float32:
                        h.op = op
            elif name == XATTR_COMPRESS:  # this inode's open handles compress as told at once
                coded = parse_compress(value) or None
                for h in self._handles.values():
                    if h.ino == inode:
                        h.compress = coded

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        with fuse_errors("listxattr"):
            if self.control.owns(inode):
                return []
            return await self.meta.listxattr(inode)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("removexattr"):
            await self.meta.removexattr(inode, name)
            if name == XATTR_COMPRESS:  # this inode's open handles push dense from now on
                for h in self._handles.values():
                    if h.ino == inode:
                        h.compress = None

    # ------------------------------------------------------------ files
    async def _communication_of(self, inode: Inode) -> tuple[Compression | None, comm.Scheduling | None]:
        """How this mount sends a parameter file's bytes (update op add or an optimizer; None,
        None for any other file), from the file's xattrs, else its directory's, read in one
        metadata hop:

        * compression of its writes: ``user.irdma.compress`` (None: dense);
        * P3's scheduling of its pulls and pushes: ``user.irdma.priority`` and
          ``user.irdma.slice`` (a priority alone slices at P3's 40,000 float32; None when
          neither is set).

        Raises:
            InvalidArgument: a stored value that does not parse (remove the xattr or set a valid one).
        """
        if not parse_update(inode.update_op or "assign").op.is_float32:
            return None, None
        found = await self.meta.inherited_xattrs(inode.ino, (XATTR_COMPRESS, comm.XATTR_PRIORITY, comm.XATTR_SLICE))
        coded, sched = None, None
        try:
            if XATTR_COMPRESS in found:
                coded = parse_compress(found[XATTR_COMPRESS]) or None
            if comm.XATTR_PRIORITY in found or comm.XATTR_SLICE in found:
                level = comm.parse_priority(found[comm.XATTR_PRIORITY]) if comm.XATTR_PRIORITY in found else 0
                elems = (comm.parse_slice(found[comm.XATTR_SLICE]) if comm.XATTR_SLICE in found
                         else comm.DEFAULT_SLICE_ELEMS)
                sched = comm.Scheduling(level, 4 * elems)
        except ValueError as exc:
            raise InvalidArgument(f"inode {inode.ino}: {exc}") from None
        return coded, sched

    def _open_handle(self, inode: Inode, io_mode: bytes, chunks: ChunkMap, *, append: bool = False,
                     compress: Compression | None = None, sched: comm.Scheduling | None = None,
                     writable: bool = True) -> pyfuse3.FileInfo:
        st = self._files.get(inode.ino)
        if st is None:
            self.client.forget_file(inode.ino)  # close-to-open: no stale chunk places
            st = self._files[inode.ino] = self._file_state(inode, {i: dict(r) for i, r in chunks.items()})
        else:
            for idx, rec in chunks.items():
                for shard, incarnation in rec.items():
                    st.chunks.setdefault(idx, {}).setdefault(shard, incarnation)
            if not st.write_behind.pending and not st.dirty:
                st.size = st.persisted_size = inode.size
        st.invalidate()  # close-to-open: a new open pulls fresh bytes
        st.open_count += 1
        op = parse_update(inode.update_op or "assign")
        # a handle that writes a file with an update op pushes deltas: never through the page
        # cache; one opened read-only holds pulled bytes only, so it may (and maps shared)
        pushes_deltas = op.op != UpdateOp.ASSIGN and writable
        direct = pushes_deltas or io_mode == b"direct" or self.direct_io or append
        fh = self._next_fh
        self._next_fh += 1
        pulled = not direct and op.op != UpdateOp.ASSIGN
        self._handles[fh] = _Handle(inode.ino, op, direct, append=append, compress=compress, sched=sched,
                                    writable=writable, pulled=pulled)
        st.cached_handles += 0 if direct else 1
        st.pulled_handles += pulled
        # a file with an update op changes by pushes that may leave its mtime (MTIME_LAZY_S): its
        # pages are pulled afresh at every open, never kept
        keep = (not direct and op.op == UpdateOp.ASSIGN
                and self._cached.get(inode.ino) == (inode.mtime_ns, inode.size))
        log.debug("open inode %d: keep_cache %s (as last closed %s, now %s)", inode.ino, keep,
                  self._cached.get(inode.ino), (inode.mtime_ns, inode.size))
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep)

    def _file_state(self, inode: Inode, chunks: ChunkMap) -> _FileState:
        """The state of a file at its first open here: its size as the metadata has it, its
        chunk map ``chunks`` (shared with its write-behind and read-ahead)."""
        layout = layout_of(inode)
        wb = WriteBehind(self.client, layout, chunks, self._residuals, self._tell_writers)
        return _FileState(layout, chunks, wb, ReadAhead(self.client, layout, chunks, wb), size=inode.size,
                          persisted_size=inode.size)

    def _ino_lock(self, ino: int) -> trio.Lock:
        lock = self._ino_locks.get(ino)
        if lock is None:
            lock = self._ino_locks[ino] = trio.Lock()
        return lock

    def _ino_unlock_done(self, ino: int) -> None:
        lock = self._ino_locks.get(ino)
        if lock is not None and not lock.locked() and lock.statistics().tasks_waiting == 0:
            del self._ino_locks[ino]

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        with fuse_errors("open"):
            if Control.owns(inode):
                fh = self._next_fh
                self._next_fh += 1
                await self.control.open(inode, fh, flags, ctx)
                return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
            try:
                async with self._ino_lock(inode):
                    return await self._open(inode, flags, ctx)
            finally:
                self._ino_unlock_done(inode)

    async def _open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node, io_mode, chunks = await self.meta.open_inode(self.sid, inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        try:
            if node.snap and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC):
                raise ReadOnly(f"inode {inode} is in a snapshot, which is read-only")
            kill_setid = self._kills_setid(node, flags, ctx)
            if kill_setid and flags & os.O_TRUNC:  # a truncate by an unprivileged process
                node = await self.meta.clear_setid(inode)
                kill_setid = False
            if flags & os.O_TRUNC:  # libfuse3 turns on atomic O_TRUNC: the truncate is ours
                await self._truncate(node, 0)
                node = await self._getattr(inode)
                chunks = {}
            coded, sched = await self._communication_of(node)
            if self.client.cached is not None:  # close-to-open: the local read cache checks chunk versions
                await self.client.cache_open(node, chunks)
            fi = self._open_handle(node, io_mode, chunks, append=bool(flags & os.O_APPEND), compress=coded, sched=sched,
                                   writable=flags & os.O_ACCMODE != os.O_RDONLY)
            self._handles[fi.fh].kill_setid = kill_setid
            return fi
        except BaseException:
            if inode not in self._files:
                with trio.CancelScope(shield=True):
                    await self.meta.close_inode(self.sid, inode)
            raise

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        with fuse_errors("create"):
            self._new_name(name)
            inode = await self.meta.create(parent_inode, name, stat.S_IFREG | (mode & ~ctx.umask & 0o7777), ctx.uid,
                                           ctx.gid)
            inode, io_mode, chunks = await self.meta.open_inode(self.sid, inode.ino)
            coded, sched = await self._communication_of(inode)
            fi = self._open_handle(inode, io_mode, chunks, append=bool(flags & os.O_APPEND), compress=coded, sched=sched,
                                   writable=flags & os.O_ACCMODE != os.O_RDONLY)
            self._handles[fi.fh].kill_setid = self._kills_setid(inode, flags, ctx)
            return fi, self._entry(inode)

    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # A file's handle first: a small random read is this, read_exact and one client call.
        # (Its errors are mapped by _guard, which wraps every handler in fuse_errors.)
        h = self._handles.get(fh)
        if h is None:
            return await self._read_control(fh, off, size)
        st = self._files[h.ino]
        if st.lost is not None:
            raise st.lost
        if st.write_behind.pending:
            await st.write_behind.wait_overlapping(off, off + size)
        file_size = st.size  # as of open, plus this mount's writes (close-to-open)
        n = max(0, min(size, file_size - off))
        if n == 0:
            return b""
        if off == h.next_read:
            h.seq_hits += 1
        else:
            h.seq_hits = 0
            if h.op.op != UpdateOp.ASSIGN:
                # pushes change a parameter file in place: a read that does not continue this
                # handle's scan pulls afresh, and no window of an earlier scan serves the one it starts
                st.read_ahead.invalidate()
        h.next_read = off + n
        with _scheduled(h):
            if h.seq_hits:
                assert self.nursery is not None
                return await st.read_ahead.read_windows(self.nursery, off, n, file_size, h.seq_hits)
            return await st.read_ahead.read_exact(off, n)

    async def _read_control(self, fh: int, off: int, size: int) -> bytes | bytearray:
        """A read of a file the mount serves itself: a state image, or one of ``.irdma/``."""
        with fuse_errors("read"):
            target = self.control.handle_target(fh)
            if target is not None:  # DIR/.irdma-state@NAME
                layout, per, total, _, chunks = await self._state_handle(fh, target)
                buf = bytearray(max(0, min(size, total - off)))
                if buf:
                    await self.client.read_state_into(layout, per, off, memoryview(buf), chunks)
                return buf
            return (await self.control.read(fh))[off : off + size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        with fuse_errors("write"):
            target = self.control.handle_target(fh)
            if target is not None:  # DIR/.irdma-state@NAME: a restore
                layout, per, total, node, _ = await self._state_handle(fh, target)
                if node.snap:
                    raise ReadOnly(f"inode {target} is in a snapshot: its optimizer state is read-only")
                if not total or off + len(buf) > total:
                    raise InvalidArgument(
                        f"optimizer state of inode {target}: the image is {total} bytes"
                        f" ({node.update_op or 'assign'}, {node.size} bytes of weights); a write of"
                        f" [{off}, {off + len(buf)}) does not fit: set the optimizer and write the weights first")
                await self.client.write_state_from(layout, per, off, buf)
                return len(buf)
            if fh in self.control._handles:
                return await self.control.write(fh, buf)
            h = self._handles[fh]
            st = self._files[h.ino]
            if st.lost is not None:
                raise st.lost
            wb = st.write_behind
            if wb.error is not None:  # reported here and kept for the next fsync/close
                raise wb.error
            if h.kill_setid:  # forgotten only once cleared: a write that failed to clear them retries
                await self.meta.clear_setid(h.ino)
                h.kill_setid = False
            if h.append:  # at the end as the metadata knows it now (see the module docstring)
                st.size = max(st.size, (await self._getattr(h.ino)).size)
                off = st.size
            end = off + len(buf)
            if h.op.op.is_float32 and (off % 4 or len(buf) % 4):
                raise InvalidArgument(f"a write to an {h.op.op.name.lower()} file must be float32 aligned:"
                                      f" offset {off}, {len(buf)} bytes")
            async with wb.admit:
                if off > st.size:
                    # a gap: it must read as zeros, whatever a failed writer left there
                    await wb.wait_all()
                    await self.client.truncate_data(st.layout, st.size)
                await wb.wait_overlapping(off, end)  # keep overlapping writes in order
                coded = h.compress if h.op.op.is_float32 and buf else None
                data: bytes | np.ndarray = buf
                feedback = None
                if coded is not None:  # after the overlapping writes: their residuals are in
                    data, feedback = self._residuals.add_to(h.ino, off, buf)
                entry = await wb.admit_push(off, end)
                st.invalidate()
                st.size = max(st.size, end)
                st.dirty = st.pushed = True
                assert self.nursery is not None
                with _scheduled(h):  # the push task inherits the file's P3 priority and slices
                    self.nursery.start_soon(wb.push, entry, off, data, h.op, coded, feedback)
            return len(buf)

    def _tell_writers(self, ino: int, exc: IrdmaError, but: _Handle | None = None) -> None:
        """Every handle of ``ino`` open for writing hears of ``exc`` at its next flush, fsync or
        close, however many other handles drain the file first (Linux's errseq_t): with the page
        cache, the kernel's writeback may push a writer's bytes through another handle."""
        for h in self._handles.values():
            if h.ino == ino and h.writable and h.error is None and h is not but:
                h.error = exc

    async def flush(self, fh: int) -> None:
        await self._sync(fh, "flush", advance=False)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._sync(fh, "fsync", advance=True)

    async def _sync(self, fh: int, what: str, advance: bool) -> None:
        """FUSE_FLUSH (``close`` of any descriptor of the open file: reports a failed push and
        keeps it) or FUSE_FSYNC (reports it and forgets it): see :meth:`_drain`."""
        with fuse_errors(what):
            if self.control.handle_target(fh) is not None:  # a restored state: durable on close
                await self.client.flush()
                return
            if fh in self.control._handles:
                return
            h = self._handles[fh]
            await self._drain(self._files[h.ino], h.ino, h, advance=advance)

    async def release(self, fh: int) -> None:
        await self.control.release(fh)
        self._state_handles.pop(fh, None)
        h = self._handles.pop(fh, None)
        if h is None:
            return
        st = self._files[h.ino]
        try:
            with fuse_errors("release"):
                await self._drain(st, h.ino, h)
        except pyfuse3.FUSEError:
            pass  # already logged; close(2) got it from flush
        finally:
            st.open_count -= 1
            st.cached_handles -= 0 if h.direct else 1
            st.pulled_handles -= h.pulled
            if st.open_count == 0:
                try:
                    async with self._ino_lock(h.ino):
                        if st.open_count == 0 and self._files.get(h.ino) is st:
                            del self._files[h.ino]
                            await self._close_inode(h)
                finally:
                    self._ino_unlock_done(h.ino)

    async def _close_inode(self, h: _Handle) -> None:
        try:
            with fuse_errors("release"):
                inode, reclaim = await self.meta.close_inode(self.sid, h.ino)
                if reclaim and inode is not None:
                    self._cached.pop(h.ino, None)
                    await self._destroy(inode)
                elif inode is not None and inode.nlink <= 0:  # in its grace period: free it after
                    assert self.nursery is not None
                    self.nursery.start_soon(self.client.destroy_later, h.ino)
                elif inode is not None and not h.direct:
                    self._cached[h.ino] = (inode.mtime_ns, inode.size)
        except pyfuse3.FUSEError:
            pass  # logged; `irdma gc` frees what is left

    async def forget(self, inode_list: Any) -> None:
        for ino, _ in inode_list:  # the kernel evicted the inode: its residual goes with it
            self._residuals.drop(ino)


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` inside :func:`fuse_errors`, timed and counted in :class:`irdma.ops.metrics.FuseMetrics`
    (``irdma_fuse_*``: requests, latency, bytes of read and write, errors by errno)."""
    metrics = fuse_metrics()
    sized = name in ("read", "write")

    inode_args = [i - 1 for i, p in enumerate(inspect.signature(fn).parameters) if p.endswith("inode")]

    async def guarded(self: IrdmaFS, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with fuse_errors(name):
                if self.read_only or self.root != ROOT_INO:
                    args = _mount_view(self, name, inode_args, args)
                out = await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError as exc:
            metrics.end(t0, name, exc.errno)
            raise
        nbytes = 0
        if sized:
            nbytes = len(out) if name == "read" else out
        metrics.end(t0, name, 0, nbytes)
        return out

    guarded.__name__ = fn.__name__
    guarded.__doc__ = fn.__doc__
    return guarded


def _mount_view(fs: IrdmaFS, name: str, inode_args: list[int], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A request's arguments as the mount's options see it: EROFS for a change on a read-only
    mount; the kernel's root inode (1) as ``fs.root`` on a ``--subdir`` mount, whose ``..``
    is itself (as a chroot's)."""
    if fs.read_only and (name in WRITE_OPS or name == "open" and args[1] & (os.O_ACCMODE | os.O_TRUNC)):
        raise pyfuse3.FUSEError(errno.EROFS)
    if fs.root == ROOT_INO or not inode_args:
        return args
    out = list(args)
    for i in inode_args:
        if out[i] == ROOT_INO:
            out[i] = fs.root
    if name == "lookup" and out[0] == fs.root and out[1] == b"..":
        out[1] = b"."
    return tuple(out)


# Belt and braces: every request handler, whatever its body does, lets only FUSEError out
# (pyfuse3 ends the main loop on anything else).
for _name, _fn in list(vars(IrdmaFS).items()):
    if _name in vars(pyfuse3.Operations) and not _name.startswith("_") and inspect.iscoroutinefunction(_fn):
        setattr(IrdmaFS, _name, _guard(_name, _fn))
