"""What the mount keeps per open file and per file handle, and what an open decides for them.

One :class:`FileState` per inode open on this mount (made at its first open, dropped at its last
release: :class:`irdma.fs.openfile.OpenFiles`), one :class:`Handle` per open file handle. An open
decides, from the file and the opener, how its handle sends bytes: whether its writes clear
S_ISUID/S_ISGID (:func:`kills_setid`), whether they are compressed and how P3 schedules them
(:func:`communication_from`, applied by :func:`scheduled`). Pure bookkeeping: no request is
translated here, and no byte is held but through :mod:`irdma.fs.cache`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import Any

from irdma import xattrs
from irdma._errors import InvalidArgument, IrdmaError, NotFound, Stale
from irdma.client import comm
from irdma.client.native import ChunkMap
from irdma.meta import Inode
from irdma.meta.aio import AsyncMeta
from irdma.meta.base import setid_bits
from irdma.placement import Layout
from irdma.wire.compress import XATTR_COMPRESS, Compression, parse_compress
from irdma.wire.optimizers import parse_update
from irdma.wire.protocol import Update

from .cache import ReadAhead, WriteBehind


@dataclass
class FileState:
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
    #: bytes that pushes change without moving mtime): OpenFiles.refresh_pulled_pages drops theirs
    pulled_handles: int = 0
    pushed: bool = False  # a write was admitted since the pages of those handles were last dropped
    #: set when this mount could not record the file as open after its session was reaped
    #: (the inode was removed meanwhile): every read, write, flush and fsync fails with it
    lost: IrdmaError | None = None
    #: ``security.capability`` of the file as last read (None: not set) and until when (monotonic
    #: seconds) it answers the kernel's ``getxattr`` of it before each write (OpenFiles.capability)
    caps: bytes | None = None
    caps_until: float = 0.0
    #: the file's attributes as this mount last read or wrote them (open, create, the drain's
    #: ``extend``) and until when (monotonic seconds) they answer the kernel's ``getattr``: the
    #: mount's attribute cache (OpenFiles.cached_attr); dropped by any change of this mount that
    #: may move an inode's attributes other than by its own writes
    attr: Inode | None = None
    attr_until: float = 0.0

    def invalidate(self) -> None:
        """Drop the read-ahead windows: every write, truncate and open (close-to-open)."""
        self.read_ahead.invalidate()


@dataclass
class Handle:
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
    pulled: bool = False  # a page-cached handle of a file with an update op (see FileState.pulled_handles)
    error: IrdmaError | None = None  # a push that failed since this handle's last flush/fsync (errseq)


def scheduled(h: Handle) -> contextlib.AbstractContextManager[object]:
    """The P3 priority and slices of a handle's requests (none set: as they come)."""
    return comm.priority(h.sched.level, h.sched.slice_bytes) if h.sched is not None else contextlib.nullcontext()


def kills_setid(inode: Inode, flags: int, ctx: Any) -> bool:
    """Whether writes through this open must clear S_ISUID/S_ISGID: a regular file that
    has them, opened for writing by a process that is not root. (The kernel does it itself
    for page-cache writes, not for direct I/O ones, and pyfuse3's ``write`` has no request
    context: so the open decides, and the handle's first write clears them, as Linux's
    ``file_remove_privs`` does on a write. Root stands for CAP_FSETID.)"""
    return (ctx is not None and ctx.uid != 0 and flags & os.O_ACCMODE != os.O_RDONLY
            and stat.S_ISREG(inode.mode) and setid_bits(inode.mode) != 0)


async def getattr_or_stale(meta: AsyncMeta, ino: int) -> Inode:
    """The inode ``ino`` from the metadata engine ``meta``.

    Raises:
        Stale: it was removed (the kernel looks the path up again).
    """
    try:
        return await meta.getattr(ino)
    except NotFound:
        raise Stale(f"inode {ino} was removed") from None


#: The xattrs that decide how a parameter file's bytes are sent, the file's or else its directory's
#: (:func:`communication_from`): an open reads them with the inode (``MetaStore.open_file``).
COMM_XATTRS = (XATTR_COMPRESS, xattrs.XATTR_PRIORITY, xattrs.XATTR_SLICE)


def communication_from(inode: Inode, found: dict[bytes, bytes]) -> tuple[Compression | None, comm.Scheduling | None]:
    """How this mount sends a parameter file's bytes (update op add or an optimizer; None,
    None for any other file), from ``found``: the :data:`COMM_XATTRS` set on the file, else
    on its directory:

    * compression of its writes: ``user.irdma.compress`` (None: dense);
    * P3's scheduling of its pulls and pushes: ``user.irdma.priority`` and
      ``user.irdma.slice`` (a priority alone slices at P3's 40,000 float32; None when
      neither is set).

    Raises:
        InvalidArgument: a stored value that does not parse (remove the xattr or set a valid one).
    """
    if not parse_update(inode.update_op or "assign").op.is_float32:
        return None, None
    coded, sched = None, None
    try:
        if XATTR_COMPRESS in found:
            coded = parse_compress(found[XATTR_COMPRESS]) or None
        if xattrs.XATTR_PRIORITY in found or xattrs.XATTR_SLICE in found:
            level = xattrs.parse_priority(found[xattrs.XATTR_PRIORITY]) if xattrs.XATTR_PRIORITY in found else 0
            elems = (xattrs.parse_slice(found[xattrs.XATTR_SLICE]) if xattrs.XATTR_SLICE in found
                     else xattrs.DEFAULT_SLICE_ELEMS)
            sched = comm.Scheduling(level, 4 * elems)
    except ValueError as exc:
        raise InvalidArgument(f"inode {inode.ino}: {exc}") from None
    return coded, sched
