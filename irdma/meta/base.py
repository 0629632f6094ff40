"""The metadata engine interface: namespace, inodes, xattrs and the shard map.

One implementation per database (SQLite embedded by default). Every method is synchronous
and transactional: it either fully applies or raises and changes nothing. Names are bytes
(as the kernel hands them over); times are integer nanoseconds since the Unix epoch.
"""

from __future__ import annotations

import abc
import stat
from dataclasses import dataclass, field

ROOT_INO = 1
#: The xattr that sets what a write to a file does: ``assign`` or ``add``.
XATTR_UPDATE = b"user.irdma.update"
#: The xattr that gives a file's chunk size in bytes (settable while the file is empty).
XATTR_CHUNK_SIZE = b"user.irdma.chunk_size"
#: The xattr that sets how a mount caches a file: ``cached`` (page cache, the default) or
#: ``direct`` (direct I/O: no page cache, large requests; for parameters streamed in bulk).
XATTR_IO = b"user.irdma.io"
IO_MODES = (b"cached", b"direct")
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclass
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int  # bytes
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    chunk_size: int | None  # files: bytes per chunk; directories: default for new files or None
    stripe: tuple[int, ...] = field(default=())  # shard ids the file is striped over
    update_op: str | None = None  # files: "assign" | "add"; directories: default or None

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class ShardRecord:
    shard_id: int
    address: str
    state: str  # "up" (registered, expected to answer) or "drained"
    added_ns: int


class MetaStore(abc.ABC):
    """What the client and the FUSE layer need of a metadata database.

    Errors: NotFound (ENOENT), Exists (EEXIST), NotADirectory (ENOTDIR), IsADirectory
    (EISDIR), NotEmpty (ENOTEMPTY), NoAttribute (ENODATA), InvalidArgument (EINVAL).
    """

    url: str

    # namespace
    @abc.abstractmethod
    def lookup(self, parent: int, name: bytes) -> Inode: ...

    @abc.abstractmethod
    def getattr(self, ino: int) -> Inode: ...

    @abc.abstractmethod
    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> Inode:
        """Change attributes; ``mode`` keeps the file type bits of the inode."""

    @abc.abstractmethod
    def extend(self, ino: int, end: int, mtime_ns: int) -> Inode:
        """Grow ``size`` to at least ``end`` (never shrinks) and set mtime: after a write."""

    @abc.abstractmethod
    def create(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, chunk_size: int | None = None
    ) -> Inode:
        """Create a regular file or directory (by ``mode``). Files inherit the parent's
        chunk size and update op defaults, and get the stripe of all registered shards.

        Raises:
            Exists: ``name`` exists. InvalidArgument: no shard is registered (files only).
        """

    @abc.abstractmethod
    def readdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """Entries of a directory, sorted by name, without ``.`` and ``..``."""

    @abc.abstractmethod
    def unlink(self, parent: int, name: bytes) -> Inode:
        """Remove a file's name; returns the inode with its new ``nlink``. The inode itself
        stays until :meth:`delete_inode` (the caller frees its chunks first)."""

    @abc.abstractmethod
    def rmdir(self, parent: int, name: bytes) -> None: ...

    @abc.abstractmethod
    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int = 0) -> Inode | None:
        """Atomically move a name, replacing an existing target as rename(2) says.

        Returns:
            The replaced inode (its ``nlink`` already decremented) or None.
        """

    @abc.abstractmethod
    def delete_inode(self, ino: int) -> None: ...

    @abc.abstractmethod
    def parent_of(self, ino: int) -> int: ...

    def getattr_io(self, ino: int) -> tuple[Inode, bytes]:
        """The inode and its ``user.irdma.io`` mode (``cached`` if unset): what an open needs.

        Engines may answer in one round trip; this default takes two.
        """
        from irdma._errors import NoAttribute

        inode = self.getattr(ino)
        try:
            return inode, self.getxattr(ino, XATTR_IO)
        except NoAttribute:
            return inode, b"cached"

    # xattrs
    @abc.abstractmethod
    def getxattr(self, ino: int, name: bytes) -> bytes: ...

    @abc.abstractmethod
    def setxattr(self, ino: int, name: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    def listxattr(self, ino: int) -> list[bytes]: ...

    @abc.abstractmethod
    def removexattr(self, ino: int, name: bytes) -> None: ...

    # whole namespace
    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(number of inodes, bytes in files)."""

    @abc.abstractmethod
    def orphans(self) -> list[Inode]:
        """Inodes with no name left (unlinked while open by a process that went away)."""

    # shard map
    @abc.abstractmethod
    def add_shard(self, address: str) -> ShardRecord:
        """Register a shard; bumps the shard map's epoch.

        Raises:
            Exists: the address is already registered.
        """

    @abc.abstractmethod
    def shards(self) -> list[ShardRecord]: ...

    @abc.abstractmethod
    def epoch(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # helpers built on the above
    def resolve(self, path: str) -> Inode:
        """The inode at an absolute path in the namespace (``/`` is the root).

        Raises:
            NotFound, NotADirectory.
        """
        inode = self.getattr(ROOT_INO)
        for part in path.strip("/").split("/"):
            if part:
                inode = self.lookup(inode.ino, part.encode())
        return inode
