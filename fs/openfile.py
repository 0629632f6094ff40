"""The files open on the mount: their state, their handles, and the data path through them.

:class:`OpenFiles` is the mount's table of open files (:class:`irdma.fs.handles.FileState`, one
per inode open here) and file handles (:class:`irdma.fs.handles.Handle`), and what moves bytes
through them: reads served by a file's read-ahead windows, writes admitted to its write-behind
(:mod:`irdma.fs.cache`), the *drain* that ``flush``, ``fsync``, the last ``release`` and a
truncate run (wait for every push, persist the size and chunks the shards acknowledged, report the
first error, errseq-style), the truncate itself, and the end of a file with no name and no handle
left. :mod:`irdma.fs.operations` translates each FUSE request into calls on it.

How stale the pages of a parameter file held open here may get is bounded here too: a drain of
this mount's pushes drops them (:meth:`OpenFiles.drop_pulled_pages`, ``pyfuse3.invalidate_inode``
in a worker thread under a limiter of its own), and :meth:`OpenFiles.refresh_pulled_pages` drops
them every ``attr_cache`` seconds for pushes made elsewhere (see :mod:`irdma.fs.operations`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import pyfuse3
import trio

from irdma._errors import InvalidArgument, IrdmaError, NoAttribute, ReadOnly
from irdma.client import comm
from irdma.client.native import ChunkMap, Client, layout_of
from irdma.meta import Inode
from irdma.wire.compress import Compression
from irdma.wire.optimizers import parse_update
from irdma.wire.protocol import SYNC_INTERVAL_S, Update, UpdateOp

from .cache import GATHER_AGE_S, GATHER_WRITE_MAX, ReadAhead, Residuals, WriteBehind, WriteBudget
from .errors import fuse_errors
from .handles import FileState, Handle, getattr_or_stale, scheduled

log = logging.getLogger("irdma.fs")

#: The extended attribute the kernel reads before every write to a file (file capabilities,
#: which a write clears: ``file_remove_privs``).
XATTR_CAPS = b"security.capability"
#: Seconds between mtime updates of a file written only through direct I/O without growing.
MTIME_LAZY_S = 1.0
#: Kernel page invalidations (they may block: :meth:`OpenFiles.drop_pulled_pages`) in worker threads
#: at once; a limiter of their own, so a blocked one never holds a thread the metadata calls need.
INVALIDATIONS_IN_THREADS = 4
#: Seconds the files released here wait to be closed in the session together, one metadata
#: transaction for all (:meth:`OpenFiles.run_closes`).
CLOSE_GATHER_S = 0.05


class OpenFiles:
    """The files and handles open on one mount.

    Args:
        client: the mount's open :class:`irdma.Client`.
        sid: this mount's session in the metadata now (it changes when the session is
            registered again: :class:`irdma.fs.session.MountSession`).
        attr_ttl: seconds the attributes of a file open here, as its open or a drain read them
            from the metadata engine, answer the kernel's ``getattr`` (the mount's
            ``--attr-cache``: the kernel trusts what it is told that long anyway).
    """

    def __init__(self, client: Client, sid: Callable[[], int], attr_ttl: float = 0.0) -> None:
        self.client = client
        self.attr_ttl = attr_ttl
        self.meta = client.meta
        self.sid = sid
        self.files: dict[int, FileState] = {}
        self.handles: dict[int, Handle] = {}
        # (mtime_ns, size) of files as this mount last closed them: a later open of an unchanged
        # file keeps its page cache (how a restore right after a save skips the round trips)
        self.cached: dict[int, tuple[int, int]] = {}
        self._mtime_at: dict[int, float] = {}  # time.monotonic() of each file's last mtime update
        #: Files with pushes acknowledged but not synced by this mount: ``time.monotonic()`` of
        #: the drain that saw the last; an ``fsync`` of one syncs the shards (forgotten after
        #: :data:`SYNC_INTERVAL_S`: the shards have synced them by then by themselves).
        self._unsynced: dict[int, float] = {}
        self._next_fh = 1
        # an open and the last release of one inode never interleave (FUSE sends RELEASE
        # asynchronously: a reopen may arrive while the last close is freeing the file)
        self._ino_locks: dict[int, trio.Lock] = {}
        #: error feedback of compressed writes: per inode, float32, element i is bytes [4i, 4i+4)
        self.residuals = Residuals()
        self._invalidations = trio.CapacityLimiter(INVALIDATIONS_IN_THREADS)
        #: the bytes of this mount's gathered writes, all files together (MOUNT_WRITE_BYTES)
        self.budget = WriteBudget()
        #: the mount's nursery: the pushes of gathered writes run in it (set before serving)
        self.nursery: trio.Nursery | None = None
        # files released here whose open record the session still holds (run_closes), and those
        # being closed now (an open of one waits for it: keep_open_record)
        self._closing: dict[int, None] = {}
        self._closing_now: dict[int, trio.Event] = {}
        self._close_wake = trio.Event()

    def new_fh(self) -> int:
        """A new file handle number (the mount's one counter: files, directories, control files)."""
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def ino_lock(self, ino: int) -> trio.Lock:
        """The lock that keeps an open and the last release of ``ino`` apart; call
        :meth:`ino_unlock_done` once out of it."""
        lock = self._ino_locks.get(ino)
        if lock is None:
            lock = self._ino_locks[ino] = trio.Lock()
        return lock

    def ino_unlock_done(self, ino: int) -> None:
        lock = self._ino_locks.get(ino)
        if lock is not None and not lock.locked() and lock.statistics().tasks_waiting == 0:
            del self._ino_locks[ino]

    # ------------------------------------------------------------ opening
    def file_state(self, inode: Inode, chunks: ChunkMap) -> FileState:
        """The state of a file at its first open here: its size as the metadata has it, its
        chunk map ``chunks`` (shared with its write-behind and read-ahead)."""
        layout = layout_of(inode)
        wb = WriteBehind(self.client, layout, chunks, self.residuals, self.tell_writers, self.budget,
                         lambda: self.nursery)
        return FileState(layout, chunks, wb, ReadAhead(self.client, layout, chunks, wb), size=inode.size,
                         persisted_size=inode.size)

    def open_handle(self, inode: Inode, io_mode: bytes, chunks: ChunkMap, *, direct_io: bool, append: bool = False,
                    compress: Compression | None = None, sched: comm.Scheduling | None = None,
                    writable: bool = True, caps: bytes | None | object = ...) -> pyfuse3.FileInfo:
        """A new handle of ``inode`` (its file state made at its first open here), and how the
        kernel is to cache it: direct I/O (``direct_io``: the mount's ``--direct-io``) or the
        page cache, kept only for an unchanged file (close-to-open). ``inode`` was just read
        from the metadata engine: it answers ``getattr`` for ``attr_ttl`` s; ``caps``: its
        ``security.capability`` read with it (None: it has none; ``...``: not read)."""
        st = self.files.get(inode.ino)
        if st is None:
            self.client.forget_file(inode.ino)  # close-to-open: no stale chunk places
            st = self.files[inode.ino] = self.file_state(inode, {i: dict(r) for i, r in chunks.items()})
        else:
            for idx, rec in chunks.items():
                for shard, incarnation in rec.items():
                    st.chunks.setdefault(idx, {}).setdefault(shard, incarnation)
            if not st.write_behind.pending and not st.dirty:
                st.size = st.persisted_size = inode.size
        st.invalidate()  # close-to-open: a new open pulls fresh bytes
        st.open_count += 1
        self.remember_attrs(inode)
        if caps is not ...:
            st.caps, st.caps_until = caps if isinstance(caps, bytes) else None, time.monotonic() + self.attr_ttl
        op = parse_update(inode.update_op or "assign")
        # a handle that writes a file with an update op pushes deltas: never through the page
        # cache; one opened read-only holds pulled bytes only, so it may (and maps shared)
        pushes_deltas = op.op != UpdateOp.ASSIGN and writable
        direct = pushes_deltas or io_mode == b"direct" or direct_io or append
        fh = self.new_fh()
        pulled = not direct and op.op != UpdateOp.ASSIGN
        self.handles[fh] = Handle(inode.ino, op, direct, append=append, compress=compress, sched=sched,
                                  writable=writable, pulled=pulled)
        st.cached_handles += 0 if direct else 1
        st.pulled_handles += pulled
        # a file with an update op changes by pushes that may leave its mtime (MTIME_LAZY_S): its
        # pages are pulled afresh at every open, never kept
        keep = (not direct and op.op == UpdateOp.ASSIGN
                and self.cached.get(inode.ino) == (inode.mtime_ns, inode.size))
        log.debug("open inode %d: keep_cache %s (as last closed %s, now %s)", inode.ino, keep,
                  self.cached.get(inode.ino), (inode.mtime_ns, inode.size))
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep)

    def set_op(self, ino: int, op: Update) -> None:
        """This mount's open handles of ``ino`` push with ``op`` at once (xattr ``user.irdma.update``)."""
        for h in self.handles.values():
            if h.ino == ino and h.op.op.is_float32 == op.op.is_float32:
                h.op = op

    def set_compress(self, ino: int, coded: Compression | None) -> None:
        """This mount's open handles of ``ino`` compress as told at once (None: dense)."""
        for h in self.handles.values():
            if h.ino == ino:
                h.compress = coded

    async def capability(self, st: FileState, ino: int, ttl: float) -> bytes | None:
        """``security.capability`` of file ``ino``, open here (state ``st``): None when it has
        none. The kernel asks for it before every write (``file_remove_privs``: a write clears
        file capabilities), so it is read from the metadata engine once per ``ttl`` seconds (the
        mount's attribute cache: how long the kernel trusts a file's mode, setuid bits included)
        and kept in ``st``; a ``setxattr`` or ``removexattr`` of it through this mount drops it
        (:meth:`forget_capability`). Without this, each 4 KiB write cost a metadata call."""
        now = time.monotonic()
        if now >= st.caps_until:
            try:
                caps: bytes | None = await self.meta.getxattr(ino, XATTR_CAPS)
            except NoAttribute:
                caps = None
            st.caps, st.caps_until = caps, now + ttl
        return st.caps

    # ------------------------------------------------------------ attributes
    def remember_attrs(self, inode: Inode) -> Inode:
        """``inode``, just read from (or written to) the metadata engine, answers the kernel's
        ``getattr`` of it for ``attr_ttl`` seconds if it is open here (:meth:`cached_attr`);
        returns it. Another mount's change is seen at the next open (close-to-open) or once
        that time is over, as the kernel's own attribute cache of ``attr_ttl`` does."""
        st = self.files.get(inode.ino)
        if st is not None:
            st.attr, st.attr_until = inode, time.monotonic() + self.attr_ttl
        return inode

    def cached_attr(self, ino: int) -> Inode | None:
        """The attributes of file ``ino`` if it is open here and they are fresh (else None):
        its size as this mount's writes made it is in the entry :meth:`IrdmaFS._entry` makes."""
        st = self.files.get(ino)
        if st is None or st.attr is None or time.monotonic() >= st.attr_until:
            return None
        return st.attr

    def forget_attrs(self, ino: int | None = None) -> None:
        """This mount changed what the attributes of ``ino`` (None: of any file) may show (a
        rename, an unlink, an xattr: ctime, nlink): the next ``getattr`` reads them again."""
        for st in [self.files.get(ino)] if ino is not None else list(self.files.values()):
            if st is not None:
                st.attr_until = 0.0

    def forget_capability(self, ino: int) -> None:
        """``security.capability`` of ``ino`` changed through this mount: read it again."""
        st = self.files.get(ino)
        if st is not None:
            st.caps_until = 0.0

    # ------------------------------------------------------------ reads and writes
    async def read(self, h: Handle, off: int, size: int,
                   nursery: trio.Nursery | None) -> bytes | bytearray | memoryview:
        """Up to ``size`` bytes at ``off`` of the file of ``h``: after the pushes they overlap;
        from read-ahead windows within a sequential scan (started in ``nursery``), else one
        exact pull."""
        st = self.files[h.ino]
        if st.lost is not None:
            raise st.lost
        if st.write_behind.pending or st.write_behind.gathers:  # read your writes, any handle's
            await st.write_behind.settle(off, off + size)
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
        with scheduled(h):
            if h.seq_hits:
                assert nursery is not None
                return await st.read_ahead.read_windows(nursery, off, n, file_size, h.seq_hits)
            return await st.read_ahead.read_exact(off, n)

    async def write(self, h: Handle, off: int, buf: bytes, nursery: trio.Nursery | None) -> int:
        """Admit a write of ``buf`` at ``off`` (O_APPEND: at the file's end) through ``h``: a
        small write of ``assign`` is gathered with the adjacent ones into chunk-sized pushes, any
        other is pushed alone (see :mod:`irdma.fs.cache`); pushes run in ``nursery``; returns
        ``len(buf)`` at once (after a wait for room: at most ``MAX_INFLIGHT_WRITES`` pushes per
        file, ``MOUNT_WRITE_BYTES`` gathered on the mount).

        Raises:
            IrdmaError: the file's last failed push (kept for the next fsync or close); Stale: the
                file was lost; InvalidArgument: a write to a float32 file not float32 aligned.
        """
        st = self.files[h.ino]
        if st.lost is not None:
            raise st.lost
        wb = st.write_behind
        if wb.error is not None:  # reported here and kept for the next fsync/close
            raise wb.error
        if h.kill_setid:  # forgotten only once cleared: a write that failed to clear them retries
            self.remember_attrs(await self.meta.clear_setid(h.ino))
            h.kill_setid = False
        if h.append:  # at the end as the metadata knows it now (see irdma.fs.operations)
            st.size = max(st.size, (await getattr_or_stale(self.meta, h.ino)).size)
            off = st.size
        end = off + len(buf)
        if h.op.op.is_float32 and (off % 4 or len(buf) % 4):
            raise InvalidArgument(f"a write to an {h.op.op.name.lower()} file must be float32 aligned:"
                                  f" offset {off}, {len(buf)} bytes")
        # adjacent small writes of assign are gathered into one push
        gathered = h.op.op == UpdateOp.ASSIGN and len(buf) < GATHER_WRITE_MAX
        if gathered and off <= st.size and not wb.admit.locked() and wb.gather_nowait(off, buf, h.op):
            # the common case, with no wait at all: a sequential dd bs=4k costs its FUSE round trip
            st.invalidate()
            st.size = max(st.size, end)
            st.dirty = st.pushed = True
            return len(buf)
        async with wb.admit:
            if off > st.size:
                # a gap: it must read as zeros, whatever a failed writer left there
                await wb.wait_all()
                await self.client.truncate_data(st.layout, st.size)
            if gathered:
                await wb.gather(off, buf, h.op)
                st.invalidate()
                st.size = max(st.size, end)
                st.dirty = st.pushed = True
                return len(buf)
            await wb.settle(off, end)  # keep overlapping writes in order
            coded = h.compress if h.op.op.is_float32 and buf else None
            data: bytes | np.ndarray = buf
            feedback = None
            if coded is not None:  # after the overlapping writes: their residuals are in
                data, feedback = self.residuals.add_to(h.ino, off, buf)
            entry = await wb.admit_push(off, end)
            st.invalidate()
            st.size = max(st.size, end)
            st.dirty = st.pushed = True
            assert nursery is not None
            with scheduled(h):  # the push task inherits the file's P3 priority and slices
                nursery.start_soon(wb.push, entry, off, data, h.op, coded, feedback)
        return len(buf)

    def tell_writers(self, ino: int, exc: IrdmaError, but: Handle | None = None) -> None:
        """Every handle of ``ino`` open for writing hears of ``exc`` at its next flush, fsync or
        close, however many other handles drain the file first (Linux's errseq_t): with the page
        cache, the kernel's writeback may push a writer's bytes through another handle."""
        for h in self.handles.values():
            if h.ino == ino and h.writable and h.error is None and h is not but:
                h.error = exc

    # ------------------------------------------------------------ drains
    async def drain(self, st: FileState, ino: int, h: Handle | None = None, advance: bool = True,
                    keep_error: bool = False, durable: bool = False) -> None:
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
        ``durable`` (fsync): the shards written also sync (SYNC: on disk, every replica) before
        it returns; without it (close, a truncate) the pushes are acknowledged by every replica
        (in their memory: they survive a shard process's death, not its machine's) and the
        shards sync them within :data:`irdma.wire.protocol.SYNC_INTERVAL_S`, as a local
        filesystem's ``close`` leaves its pages to writeback.

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
                await self.drop_pulled_pages(st, ino)
        if st.lost is not None:  # removed while the session was reaped: nothing can be recorded
            if st.dirty:
                raise st.lost
            return
        async with wb.persist:
            if st.dirty and wb.acked_ends:
                self._note_unsynced(ino)
            if durable and self._needs_sync(ino):
                started = time.monotonic()
                try:
                    await self.client.flush()  # on disk on every replica written before fsync returns
                except IrdmaError as exc:  # every writer hears of it, not just this drain's caller
                    self.tell_writers(ino, exc, but=h)
                    if h is not None and advance:  # this fsync reports EIO, once (as errseq): the next one
                        h.error = None           # returns 0, the shards sync by themselves when back
                        wb.error = None
                        self._unsynced.pop(ino, None)
                    raise
                # every shard this client wrote synced: every push acknowledged before it began is on disk
                self._unsynced = {i: t for i, t in self._unsynced.items() if t > started}
            if st.dirty:
                seen = wb.seen(st.persisted_size)
                new_size, chunks = seen.size, seen.chunks
                # bytes past a failed push are not the file's (writes admitted meanwhile still are)
                st.size = max(new_size, st.persisted_size, *(p.end for p in wb.pending),
                              *(g.end for g in wb.gathers))
                # A push that does not grow a file opened only with direct I/O (a gradient to an
                # add file) refreshes mtime at most once a second, as lazytime does: one metadata
                # transaction per close of every parameter file would cost more than the push.
                now = time.monotonic()
                if (chunks or new_size > st.persisted_size or st.cached_handles
                        or now - self._mtime_at.get(ino, 0.0) >= MTIME_LAZY_S):
                    self.remember_attrs(await self.meta.extend(ino, new_size, time.time_ns(), chunks))
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

    def _note_unsynced(self, ino: int) -> None:
        now = time.monotonic()
        if len(self._unsynced) >= 4096:  # the shards synced those older than SYNC_INTERVAL_S themselves
            self._unsynced = {i: t for i, t in self._unsynced.items() if now - t < SYNC_INTERVAL_S}
        self._unsynced[ino] = now

    def _needs_sync(self, ino: int) -> bool:
        t = self._unsynced.get(ino)
        return t is not None and time.monotonic() - t < SYNC_INTERVAL_S + 1.0

    async def refresh_pulled_pages(self, period: float) -> None:
        """Every ``period`` seconds, drop the kernel's pages and the read-ahead windows of each
        file open here through a page-cached handle whose update op is not ``assign`` (see
        :meth:`irdma.fs.operations.IrdmaFS.refresh_pulled_pages`). Runs until cancelled."""
        while True:
            await trio.sleep(period)
            for ino, st in list(self.files.items()):
                if st.pulled_handles and self.files.get(ino) is st:
                    await self.drop_pulled_pages(st, ino)

    async def expire_gathers(self, age: float = GATHER_AGE_S) -> None:
        """Every ``age / 2`` seconds, push the gathered writes of every file open here that
        have waited ``age`` seconds for more (a slow writer's bytes reach the shards without a
        close). Runs until cancelled."""
        while True:
            await trio.sleep(age / 2)
            born = trio.current_time() - age
            for st in list(self.files.values()):
                if st.write_behind.gathers:
                    st.write_behind.flush_older_than(born)

    async def drop_pulled_pages(self, st: FileState, ino: int) -> None:
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

    # ------------------------------------------------------------ sizes and ends
    async def truncate(self, inode: Inode, size: int) -> None:
        """Set a file's size. Shrinking forgets the chunks past the end in the metadata first,
        then frees them; growing first clears what a failed writer may have left past the old
        end, so the new bytes read as zeros."""
        if inode.snap:
            raise ReadOnly(f"inode {inode.ino} is in a snapshot, which is read-only")
        st = self.files.get(inode.ino)
        if st is not None:
            async with st.write_behind.admit:
                await self.drain(st, inode.ino)
                await self._truncate_locked(await getattr_or_stale(self.meta, inode.ino), size, st)
        else:
            await self._truncate_locked(inode, size, None)

    async def _truncate_locked(self, inode: Inode, size: int, st: FileState | None) -> None:
        layout = layout_of(inode)
        if size < inode.size:
            await self.meta.setattr(inode.ino, size=size)
            await self.client.truncate_data(layout, size)
        else:
            await self.client.truncate_data(layout, inode.size)
            await self.meta.setattr(inode.ino, size=size)
        if st is not None:
            st.size = st.persisted_size = size
            st.attr_until = 0.0  # its mtime and ctime moved
            first_gone = layout.chunk_count(size)
            for idx in [i for i in st.chunks if i >= first_gone]:
                del st.chunks[idx]
            st.invalidate()

    async def destroy(self, inode: Inode) -> None:
        """Free the chunks of a file with no name and no open handle left, then its inode."""
        self.residuals.drop(inode.ino)
        if not inode.is_dir and inode.stripe:
            await self.client.truncate_data(layout_of(inode), 0)
        await self.meta.delete_inode(inode.ino)

    async def maybe_destroy(self, replaced: Inode | None, nursery: trio.Nursery | None) -> None:
        """The end of a file that an unlink or a rename left with no name: freed after its grace
        period (a task in ``nursery``) unless it is open here (its last close frees it)."""
        if replaced is not None and replaced.nlink <= 0:
            self.residuals.drop(replaced.ino)  # no name left: nobody pushes to it again
        if replaced is not None and replaced.nlink <= 0 and replaced.ino not in self.files:
            # freed after its grace period unless a live session holds it open then (its last
            # close frees it)
            assert nursery is not None
            nursery.start_soon(self.client.destroy_later, replaced.ino)

    async def release(self, h: Handle, nursery: trio.Nursery | None) -> None:
        """The release of handle ``h`` (already out of :attr:`handles`): drain the file for it
        (an error was reported by flush and is only logged here); at the file's last handle
        here, forget its state and leave its close in the session to :meth:`run_closes`."""
        st = self.files[h.ino]
        try:
            with fuse_errors("release"):
                await self.drain(st, h.ino, h)
        except pyfuse3.FUSEError:
            pass  # already logged; close(2) got it from flush
        finally:
            st.open_count -= 1
            st.cached_handles -= 0 if h.direct else 1
            st.pulled_handles -= h.pulled
            if st.open_count == 0:
                try:
                    async with self.ino_lock(h.ino):
                        if st.open_count == 0 and self.files.get(h.ino) is st:
                            del self.files[h.ino]
                            if not h.direct and st.attr is not None:  # close-to-open: as this mount saw it last
                                self.cached[h.ino] = (st.attr.mtime_ns, st.attr.size)
                            self._closing[h.ino] = None  # closed in the session by run_closes
                            self._close_wake.set()
                finally:
                    self.ino_unlock_done(h.ino)

    async def keep_open_record(self, ino: int) -> None:
        """An open of ``ino`` (under its :meth:`ino_lock`): a close of it in the session that is
        still to run is called off (the open record stays), one under way is waited for."""
        if ino in self._closing:
            del self._closing[ino]
            return
        done = self._closing_now.get(ino)
        if done is not None:
            await done.wait()  # an engine call: bounded by the engine's own timeout

    async def run_closes(self, gather: float = CLOSE_GATHER_S) -> None:
        """For the mount's life: once a file's last handle here was released, wait ``gather``
        seconds for others, then close all of them in the session in one metadata transaction
        (:meth:`close_pending`). The release itself never waits for the metadata engine: the
        kernel sends RELEASE after ``close(2)`` returned, and the size and chunk map were
        recorded by the FLUSH before (close-to-open)."""
        while True:
            await self._close_wake.wait()
            self._close_wake = trio.Event()
            await trio.sleep(gather)
            try:
                await self.close_pending()
            except Exception:  # noqa: BLE001 - a bug here must not end the mount; the next batch runs
                log.exception("closing released files in the session failed (`irdma gc` frees what is left)")

    async def close_pending(self) -> None:
        """Close the files released here in the session (shielded: an open of one of them
        waits for it): free each that was its last open anywhere and has no name (in its grace
        period: a task in the mount's nursery frees it after). A failure is logged; ``irdma
        gc`` frees what is left."""
        batch = list(self._closing)
        if not batch:
            return
        self._closing.clear()
        done = trio.Event()
        for ino in batch:
            self._closing_now[ino] = done
        try:
            with trio.CancelScope(shield=True):
                results = await self.meta.close_inodes(self.sid(), batch)
        except IrdmaError as exc:
            log.warning("closing %d released files in the session failed (`irdma gc` frees what is left): %s",
                        len(batch), exc)
            return
        finally:
            for ino in batch:
                if self._closing_now.get(ino) is done:
                    del self._closing_now[ino]
            done.set()
        ending: list[int] = []  # nameless files in their grace period as the mount ends
        for ino, inode, reclaim in results:
            if reclaim and inode is not None:
                self.cached.pop(ino, None)
                try:
                    with fuse_errors("release"):
                        await self.destroy(inode)
                except pyfuse3.FUSEError:
                    pass  # logged; `irdma gc` frees what is left
            elif inode is not None and inode.nlink <= 0 and self.nursery is not None:  # in its grace period
                try:
                    self.nursery.start_soon(self.client.destroy_later, ino)
                except RuntimeError:  # the mount is ending: its nursery takes no new task
                    ending.append(ino)
        if ending:  # the session's end (shielded, with its deadline): the grace period waited out here
            await trio.sleep(await self.meta.unlink_grace() + 0.1)
            for ino in ending:
                try:
                    await self.client.destroy_if_unused(ino)
                except IrdmaError as exc:
                    log.warning("freeing removed file %d as the mount ends failed (`irdma gc` will): %s", ino, exc)
