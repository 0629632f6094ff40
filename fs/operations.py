"""pyfuse3 operations for an irdma namespace.

Reads are pulls, writes are pushes. Writes are asynchronous transfers (write-behind): a
``write`` hands its bytes to a task that pushes them to the shards and returns at once (small
adjacent writes of ``assign`` are first gathered into chunk-sized pushes, and the kernel's
``getxattr security.capability`` before each write is answered from memory);
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

What a small file costs in metadata round trips (issue 39): a ``create`` is one transaction (the
file, recorded open, with what its directory gives it: ``create_open``), an ``open`` one (the
inode, I/O mode, chunk map, capabilities and compression settings, and the open record:
``open_file``), a ``close`` of a written file one (size and chunk map: ``extend``); the session's
open records of the files released meanwhile are dropped together, in one more transaction
(:meth:`irdma.fs.openfile.OpenFiles.run_closes`), since RELEASE comes after ``close(2)`` returned.
Attributes are cached by the mount too (``getattr``: a file held open here as its open or last
drain read it, a directory as this mount's last create in it left it), for ``attr_cache`` s and
never across any other change this mount makes (:data:`FORGET_ATTRS`). Close-to-open holds for
the kernel's own attribute cache: an open of a file that changed drops the kernel's attributes of
it, so a read through the page cache does not stop at the size it kept.

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

Where the pieces live (as 3FS keeps sessions and per-inode state outside ``FuseOps.cc``): this
module translates each request into calls on :class:`irdma.fs.openfile.OpenFiles` (the files and
handles open here, their reads, writes, drains and truncates; their state in
:mod:`irdma.fs.handles`, their bytes in :mod:`irdma.fs.cache`), :class:`irdma.fs.session.MountSession`
(the session, heartbeats, shard health, garbage collection at start),
:class:`irdma.fs.stateimage.StateImages` (``.irdma-state@NAME``) and :class:`irdma.fs.control.Control`
(``.irdma/``).

Inode and file-handle bookkeeping follows pyfuse3's ``examples/passthroughfs.py``.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from irdma import xattrs
from irdma._errors import InvalidArgument, NoAttribute, NotFound, ReadOnly
from irdma.client import snapshots
from irdma.client.native import Client
from irdma.meta import ROOT_INO, Inode
from irdma.meta.base import SNAPSHOTS_DIR, SNAPSHOTS_DIR_MARK, XATTR_UPDATE
from irdma.metrics import fuse_metrics
from irdma.wire.compress import XATTR_COMPRESS, parse_compress
from irdma.wire.optimizers import parse_update

from .control import CLOCK_PREFIX, CONTROL, STATE_PREFIX, XATTR_MOUNT, Control, caller_of
from .errors import fuse_errors
from .handles import COMM_XATTRS, communication_from, getattr_or_stale, kills_setid
from .openfile import INVALIDATIONS_IN_THREADS, MTIME_LAZY_S, XATTR_CAPS, OpenFiles
from .options import ATTR_TIMEOUT, ENTRY_TIMEOUT
from .session import HEARTBEAT_S, CollectGarbage, MountSession
from .stateimage import StateImages

__all__ = ["ATTR_TIMEOUT", "ENTRY_TIMEOUT", "HEARTBEAT_S", "INVALIDATIONS_IN_THREADS", "MTIME_LAZY_S",
           "PULL_REFRESH_MIN_S", "WRITE_OPS", "IrdmaFS"]

log = logging.getLogger("irdma.fs")

#: Requests that change the namespace or a file: a read-only mount answers them EROFS.
WRITE_OPS = frozenset({"write", "create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename", "setattr",
                       "setxattr", "removexattr"})
#: Requests before which the mount forgets the attributes it caches (:meth:`IrdmaFS.forget_attrs`):
#: they may change an inode's mode, owner, times, link count or size other than by the request's
#: own reply (a ``write`` changes only its file's size, which the mount tracks; a ``create``
#: gets the new file and its directory as they are now).
FORGET_ATTRS = WRITE_OPS - {"write", "create"}
#: Shortest period, in seconds, of :meth:`IrdmaFS.refresh_pulled_pages` (it runs every
#: ``--attr-cache`` seconds, so at this rate with ``--attr-cache 0``).
PULL_REFRESH_MIN_S = 0.1


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
        collect_garbage: what a read-write mount runs at start to reap dead sessions and their
            orphans (:class:`irdma.fs.session.CollectGarbage`; None: ``irdma.client.fsck.collect_garbage``).
    """

    enable_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, client: Client, *, direct_io: bool = False, read_only: bool = False, root: int = ROOT_INO,
                 attr_cache: float = ATTR_TIMEOUT, entry_cache: float = ENTRY_TIMEOUT,
                 collect_garbage: CollectGarbage | None = None) -> None:
        super().__init__()
        self.client = client
        self.direct_io = direct_io  # every file with direct I/O (else per file: user.irdma.io)
        self.read_only, self.root, self.attr_cache, self.entry_cache = read_only, root, attr_cache, entry_cache
        self.meta = client.meta
        self.after_init: Callable[[], object] | None = None
        #: the files and handles open here (their state, reads, writes and drains)
        self.files = OpenFiles(client, lambda: self.sid, attr_ttl=attr_cache)
        #: readdir snapshots per open directory: (name, inode), or (b"..", parent's inode number)
        self._dirs: dict[int, list[tuple[bytes, Inode | int]]] = {}
        self._control_dirs: dict[int, list[tuple[bytes, int]]] = {}
        #: directories as this mount's last create in each left them, and until when (monotonic s)
        self._dir_attrs: dict[int, tuple[Inode, float]] = {}
        #: ``.irdma/``: barriers, locks and counters as files (:mod:`irdma.fs.control`)
        self.control = Control(self.meta, 0, tick=client.clock_at)
        #: open ``.irdma-state@NAME`` handles
        self.images = StateImages(client, self.files)
        #: this mount's session in the metadata (:mod:`irdma.fs.session`)
        self.session = MountSession(client, self.control, self.files, read_only=read_only,
                                    collect_garbage=collect_garbage)

    @property
    def nursery(self) -> trio.Nursery | None:
        """The mount's nursery: pushes, read-ahead fetches and background work run in it."""
        return self.files.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self.files.nursery = nursery

    @property
    def sid(self) -> int:
        """This mount's session in the metadata (0 before :meth:`start_session`)."""
        return self.session.sid

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
        await self.session.start(name)

    async def run_heartbeats(self) -> None:
        """Keep the session alive and the shard map's health current, every HEARTBEAT_S."""
        await self.session.run_heartbeats()

    async def refresh_pulled_pages(self) -> None:
        """Bound how stale a parameter file's pages held here may be: every ``attr_cache``
        seconds (at least :data:`PULL_REFRESH_MIN_S`), drop the kernel's pages and the read-ahead
        windows of each file open here through a page-cached handle whose update op is not
        ``assign`` (a read-only open: a read or ``mmap`` of it then pulls afresh). Pushes made
        elsewhere (another mount, the native client) may leave such a file's mtime as it was
        (``MTIME_LAZY_S``), so the kernel's revalidation of its attributes would never drop them.
        Runs in the mount's nursery for the mount's life; costs nothing while no such handle is
        open."""
        await self.files.refresh_pulled_pages(max(self.attr_cache, PULL_REFRESH_MIN_S))

    async def expire_gathered_writes(self) -> None:
        """Push gathered writes that waited ``GATHER_AGE_S`` for more (:mod:`irdma.fs.cache`),
        for the mount's life."""
        await self.files.expire_gathers()

    async def run_closes(self) -> None:
        """Close the files released here in the session, together (:meth:`irdma.fs.openfile.OpenFiles.run_closes`),
        for the mount's life."""
        await self.files.run_closes()

    async def end_session(self) -> None:
        await self.session.end()

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
        st = self.files.files.get(inode.ino)
        e.st_size = st.size if st is not None and st.dirty else inode.size
        e.st_blksize = inode.chunk_size or 4096
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = inode.atime_ns
        e.st_mtime_ns = inode.mtime_ns
        e.st_ctime_ns = inode.ctime_ns
        return e

    def _dir_attr(self, ino: int) -> Inode | None:
        got = self._dir_attrs.get(ino)
        if got is None:
            return None
        if time.monotonic() >= got[1]:
            del self._dir_attrs[ino]
            return None
        return got[0]

    def forget_attrs(self) -> None:
        """This mount is about to change the namespace or a file's attributes (any of
        :data:`FORGET_ATTRS`): the attributes it caches are read again at the next ``getattr``."""
        self._dir_attrs.clear()
        self.files.forget_attrs()

    async def _getattr(self, ino: int) -> Inode:
        return await getattr_or_stale(self.meta, ino)

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
            # a file open here as its open or last drain read it, a directory as this mount's
            # last create in it left it (the mount's attribute cache: ATTR_CACHING)
            node = self.files.cached_attr(inode) or self._dir_attr(inode)
            if node is None:
                node = await self._getattr(inode)
                self.files.remember_attrs(node)
            return self._entry(node)

    async def _state_entry(self, ino: int) -> pyfuse3.EntryAttributes:
        """Attributes of a state image: its file's owner and mode (so the kernel's permission
        checks are the file's), its size, never cached."""
        target_ino = self.control.target_of(ino)
        assert target_ino is not None
        _, _, total, target = await self.images.of(target_ino)
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
                await self.files.truncate(await self._getattr(inode), attr.st_size)
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
                st = self.files.files.get(inode)
                if st is not None:
                    # A time the user sets (tar -x, cp -a, rsync: utimensat before close) outlives
                    # the writes made before it: they are recorded first, so no later drain of them
                    # stamps its own time over it (the NFS client flushes before a SETATTR too).
                    async with st.write_behind.admit:
                        await self.files.drain(st, inode, keep_error=True)
                        return self._entry(self.files.remember_attrs(await self.meta.setattr(inode, **kw)))
            return self._entry(self.files.remember_attrs(await self.meta.setattr(inode, **kw)))

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
            await self.files.maybe_destroy(await self.meta.unlink(parent_inode, name), self.nursery)

    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        with fuse_errors("rename"):
            self._new_name(name_new)
            await self.files.maybe_destroy(
                await self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags), self.nursery
            )

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        """A hard link: the file's chunks stay until its last name and its last open handle go."""
        with fuse_errors("link"):
            self._new_name(new_name)
            return self._entry(self.files.remember_attrs(await self.meta.link(inode, new_parent_inode, new_name)))

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
                fh = self.files.new_fh()
                entries = self.control.entries(inode)
                self._control_dirs[fh] = [(b".", inode), (b"..", self.control.parent_of(inode)), *entries]
                return fh
            node = await self._getattr(inode)
            if not node.is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            up = inode if inode == self.root else await self.meta.parent_of(inode)
            listing = await self.meta.readdir(inode)
            fh = self.files.new_fh()
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
            if name == xattrs.XATTR_CLOCKS:
                clocks = await self.meta.clocks(inode)
                return " ".join(f"{w}:{c}" for w, c in sorted(clocks.items())).encode()
            if name == XATTR_MOUNT and inode == self.root:  # what this mount shows (irdma info, irdma snapshot)
                shown = self.control.mount_xattr()
                if shown is not None:
                    return shown
            st = self.files.files.get(inode)
            if name == XATTR_CAPS and st is not None:  # the kernel's question before every write
                caps = await self.files.capability(st, inode, self.attr_cache)
                if caps is None:
                    raise pyfuse3.FUSEError(errno.ENODATA)
                return caps
            return await self.meta.getxattr(inode, name)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        with fuse_errors("setxattr"):
            try:
                await self.meta.setxattr(inode, name, value)
            except InvalidArgument as exc:
                log.warning("setxattr %s=%r on inode %d refused: %s", name.decode(errors="replace"), value[:200],
                            inode, exc)
                raise
            if name == XATTR_CAPS:
                self.files.forget_capability(inode)
            elif name == XATTR_UPDATE:  # this mount's open handles push with the new op at once
                self.files.set_op(inode, parse_update(value))
            elif name == XATTR_COMPRESS:  # this inode's open handles compress as told at once
                self.files.set_compress(inode, parse_compress(value) or None)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        with fuse_errors("listxattr"):
            if self.control.owns(inode):
                return []
            return await self.meta.listxattr(inode)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        with fuse_errors("removexattr"):
            await self.meta.removexattr(inode, name)
            if name == XATTR_CAPS:
                self.files.forget_capability(inode)
            elif name == XATTR_COMPRESS:  # this inode's open handles push dense from now on
                self.files.set_compress(inode, None)

    # ------------------------------------------------------------ files
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        with fuse_errors("open"):
            if Control.owns(inode):
                fh = self.files.new_fh()
                await self.control.open(inode, fh, flags, ctx)
                return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
            try:
                async with self.files.ino_lock(inode):
                    await self.files.keep_open_record(inode)  # its deferred close, if any, is off
                    return await self._open(inode, flags, ctx)
            finally:
                self.files.ino_unlock_done(inode)

    async def _open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        # one metadata round trip: the inode, its I/O mode, chunk map, capabilities and how its
        # bytes are sent, and the record that this session holds it open
        opened = await self.meta.open_file(self.sid, inode, own=(XATTR_CAPS,), inherited=COMM_XATTRS)
        node, io_mode, chunks = opened.inode, opened.io_mode, opened.chunks
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        try:
            if node.snap and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC):
                raise ReadOnly(f"inode {inode} is in a snapshot, which is read-only")
            kill_setid = kills_setid(node, flags, ctx)
            if kill_setid and flags & os.O_TRUNC:  # a truncate by an unprivileged process
                node = await self.meta.clear_setid(inode)
                kill_setid = False
            if flags & os.O_TRUNC:  # libfuse3 turns on atomic O_TRUNC: the truncate is ours
                await self.files.truncate(node, 0)
                node = await self._getattr(inode)
                chunks = {}
            coded, sched = communication_from(node, opened.xattrs)
            if self.client.cached is not None:  # close-to-open: the local read cache checks chunk versions
                await self.client.cache_open(node, chunks)
            fi = self.files.open_handle(node, io_mode, chunks, direct_io=self.direct_io,
                                        append=bool(flags & os.O_APPEND), compress=coded, sched=sched,
                                        writable=flags & os.O_ACCMODE != os.O_RDONLY,
                                        caps=opened.xattrs.get(XATTR_CAPS))
            self.files.handles[fi.fh].kill_setid = kill_setid
            if not fi.keep_cache:
                _kernel_forgets_attrs(inode)
            return fi
        except BaseException:
            if inode not in self.files.files:
                with trio.CancelScope(shield=True):
                    await self.meta.close_inode(self.sid, inode)
            raise

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        with fuse_errors("create"):
            self._new_name(name)
            # one metadata transaction: the new file, recorded open, with what its directory gives it
            opened = await self.meta.create_open(self.sid, parent_inode, name,
                                                 stat.S_IFREG | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid,
                                                 inherited=COMM_XATTRS)
            inode, io_mode, chunks = opened.inode, opened.io_mode, opened.chunks
            if opened.parent is not None and self.attr_cache > 0:  # the kernel asks for it at its next path walk
                self._dir_attrs[parent_inode] = (opened.parent, time.monotonic() + self.attr_cache)
            coded, sched = communication_from(inode, opened.xattrs)
            fi = self.files.open_handle(inode, io_mode, chunks, direct_io=self.direct_io,
                                        append=bool(flags & os.O_APPEND), compress=coded, sched=sched,
                                        writable=flags & os.O_ACCMODE != os.O_RDONLY, caps=None)
            self.files.handles[fi.fh].kill_setid = kills_setid(inode, flags, ctx)
            return fi, self._entry(inode)

    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # A file's handle first: a small random read is this, read_exact and one client call.
        # (Its errors are mapped by _guard, which wraps every handler in fuse_errors.)
        h = self.files.handles.get(fh)
        if h is None:
            return await self._read_control(fh, off, size)
        return await self.files.read(h, off, size, self.nursery)

    async def _read_control(self, fh: int, off: int, size: int) -> bytes | bytearray:
        """A read of a file the mount serves itself: a state image, or one of ``.irdma/``."""
        with fuse_errors("read"):
            target = self.control.handle_target(fh)
            if target is not None:  # DIR/.irdma-state@NAME
                return await self.images.read(fh, target, off, size)
            return (await self.control.read(fh))[off : off + size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        with fuse_errors("write"):
            target = self.control.handle_target(fh)
            if target is not None:  # DIR/.irdma-state@NAME: a restore
                return await self.images.write(fh, target, off, buf)
            if fh in self.control._handles:
                return await self.control.write(fh, buf)
            return await self.files.write(self.files.handles[fh], off, buf, self.nursery)

    async def flush(self, fh: int) -> None:
        await self._sync(fh, "flush", advance=False)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._sync(fh, "fsync", advance=True)

    async def _sync(self, fh: int, what: str, advance: bool) -> None:
        """FUSE_FLUSH (``close`` of any descriptor of the open file: reports a failed push and
        keeps it) or FUSE_FSYNC (reports it and forgets it): see :meth:`irdma.fs.openfile.OpenFiles.drain`."""
        with fuse_errors(what):
            if self.control.handle_target(fh) is not None:  # a restored state: durable on close
                await self.client.flush()
                return
            if fh in self.control._handles:
                return
            h = self.files.handles[fh]
            await self.files.drain(self.files.files[h.ino], h.ino, h, advance=advance, durable=advance)

    async def release(self, fh: int) -> None:
        await self.control.release(fh)
        self.images.release(fh)
        h = self.files.handles.pop(fh, None)
        if h is None:
            return
        await self.files.release(h, self.nursery)

    async def forget(self, inode_list: Any) -> None:
        for ino, _ in inode_list:  # the kernel evicted the inode: its residual goes with it
            self.files.residuals.drop(ino)


def _kernel_forgets_attrs(ino: int) -> None:
    """Close-to-open for the kernel's own attribute cache: an open of a file that changed since
    this mount last closed it (or that it never opened) drops the attributes the kernel keeps of
    it (for up to ``attr_cache`` s), so its next read or ``stat`` asks the mount, which answers
    with what the open just read (a read through the page cache stops at the kernel's size).
    Attributes only (offset -1: no page is locked), so the notification never blocks."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError as exc:  # ENOENT: the kernel does not know the inode (nothing cached)
        log.debug("cannot drop the kernel's attributes of inode %d: %s", ino, exc)


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` inside :func:`fuse_errors`, timed and counted in :class:`irdma.metrics.FuseMetrics`
    (``irdma_fuse_*``: requests, latency, bytes of read and write, errors by errno)."""
    metrics = fuse_metrics()
    sized = name in ("read", "write")
    forgets = name in FORGET_ATTRS

    inode_args = [i - 1 for i, p in enumerate(inspect.signature(fn).parameters) if p.endswith("inode")]

    async def guarded(self: IrdmaFS, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with fuse_errors(name):
                if self.read_only or self.root != ROOT_INO:
                    args = _mount_view(self, name, inode_args, args)
                if forgets:  # before and after: a getattr meanwhile may have read it half-changed
                    self.forget_attrs()
                    try:
                        out = await fn(self, *args, **kwargs)
                    finally:
                        self.forget_attrs()
                else:
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
