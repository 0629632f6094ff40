"""The metadata engine interface: namespace, inodes, xattrs and the shard map.

One implementation per database (SQLite embedded by default). Every method is synchronous
and transactional: it either fully applies or raises and changes nothing. Names are bytes
(as the kernel hands them over); times are integer nanoseconds since the Unix epoch.
"""

from __future__ import annotations

import abc
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from irdma.placement import Move

ROOT_INO = 1
#: The incarnation a chunk-map row holds for a replica out of its chunk's in-sync set (it
#: missed acknowledged updates); never a shard's incarnation.
OUT_OF_SYNC = 0
#: The xattr that sets what a write to a file does: ``assign`` or ``add``.
XATTR_UPDATE = b"user.irdma.update"
#: The xattr that gives a file's chunk size in bytes (settable while the file is empty).
XATTR_CHUNK_SIZE = b"user.irdma.chunk_size"
#: The xattr that sets how a mount caches a file: ``cached`` (page cache, the default) or
#: ``direct`` (direct I/O: no page cache, large requests; for parameters streamed in bulk).
XATTR_IO = b"user.irdma.io"
IO_MODES = (b"cached", b"direct")
#: The xattr that sets how a client's local read cache (``--cache-dir``, ``--cache-memory``;
#: :mod:`irdma.client.cache`) keeps a file: ``default`` (kept, its chunk versions checked at every
#: open), ``readonly`` (kept, checked at most every 60 s while the file's ctime does not change:
#: for files nobody writes) or ``off`` (never kept).
XATTR_CACHE = b"user.irdma.cache"
CACHE_MODES = (b"default", b"readonly", b"off")
#: The xattr that gives a file's tensor shape, e.g. ``1000000,256`` (C order, little-endian
#: float32): a sparse pull or push of rows (:meth:`irdma.Client.pull_rows`) takes its row length
#: (the product of every dimension after the first) and row count (the first) from it.
XATTR_SHAPE = b"user.irdma.shape"


def parse_shape(value: bytes | str) -> tuple[int, ...]:
    """``b"1000000,256"`` (commas or ``x``, spaces ignored) -> ``(1000000, 256)``.

    Raises:
        ValueError: not one or more positive integers.
    """
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"bad {XATTR_SHAPE.decode()} {text!r}: use positive dimensions such as 1000000,256")
    return tuple(int(p) for p in parts)
#: The xattr that limits how many snapshots a directory may hold (``D/.snapshots/*``): set on
#: ``D`` or an ancestor (the smallest of them applies); a create past it fails (EDQUOT).
XATTR_MAX_SNAPSHOTS = b"user.irdma.max_snapshots"


def parse_max_snapshots(value: bytes | str) -> str:
    """The normalized text of a :data:`XATTR_MAX_SNAPSHOTS` value (``b" 10 "`` -> ``"10"``).

    Raises:
        ValueError: not a whole number of 0 or more (0: no snapshot may be made there).
    """
    text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip()
    if not text.isdigit():
        raise ValueError(f"bad {XATTR_MAX_SNAPSHOTS.decode()} {text!r}: use a whole number of snapshots such as 10")
    return str(int(text))


#: The name of a directory's snapshots (``D/.snapshots/NAME``, as CephFS's ``.snap``).
SNAPSHOTS_DIR = b".snapshots"
#: :attr:`Inode.snap` of a ``.snapshots`` directory.
SNAPSHOTS_DIR_MARK = -1
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
#: The longest file name (bytes) and symlink target (bytes, PATH_MAX less its NUL).
NAME_MAX = 255
SYMLINK_MAX = 4095


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
    rdev: int = 0  # device number of a character or block device node, else 0
    replicas: int = 1  # files: copies of each chunk, on distinct shards of the stripe
    #: 0: a live inode. > 0: the id of the snapshot it belongs to (read-only). SNAPSHOTS_DIR_MARK:
    #: a directory's ``.snapshots`` (hidden from readdir; mkdir/rmdir in it make/delete snapshots).
    snap: int = 0
    #: Files: the inode number whose chunk placement this file follows (a snapshot's copy, or
    #: a clone of one, follows the live file whose chunks it shares); 0: its own.
    place: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class Opened:
    """What an open of a file needs, read in one transaction (:meth:`MetaStore.open_file`,
    :meth:`MetaStore.create_open`)."""

    inode: Inode
    io_mode: bytes  # its ``user.irdma.io`` (``cached`` if unset)
    chunks: dict[int, dict[int, int]]  # chunk index -> {shard id: incarnation}
    #: the extended attributes asked for that are set: ``own`` ones on the file, ``inherited``
    #: ones on the file, else on its directory (as :meth:`MetaStore.inherited_xattrs` at depth 1)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    #: :meth:`MetaStore.create_open`: the directory as the create left it (mtime, ctime, size)
    parent: Inode | None = None


def setid_bits(mode: int) -> int:
    """The bits of ``mode`` that a change of owner, or a write or truncate by an unprivileged
    process, clears: S_ISUID, and S_ISGID where group-execute is set (S_ISGID without it marks
    mandatory locking, and stays)."""
    bits = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        bits |= stat.S_ISGID
    return bits


@dataclass
class ShardRecord:
    shard_id: int
    address: str
    # "up" (in service: new files are striped over it) | "draining" (its chunks are being
    # moved away) | "drained" (they were: in no chain) | "removed" (out of the cluster)
    state: str
    added_ns: int
    incarnation: int = 0  # the shard's memory as last seen by a client; 0: never contacted
    # "up" | "down" (as last seen by a heartbeat or a request) | "syncing" (back, catching up on
    # the updates it missed: in its chains as the tail, read from only when no replica is up) | "unknown"
    health: str = "unknown"
    health_ns: int = 0


@dataclass
class Snapshot:
    """A snapshot (:mod:`irdma.meta.sql_snap`): ``dir``'s ``.snapshots/name``, whose tree
    starts at inode ``root``, a copy of inode ``src`` (``dir`` itself, or a file in it) as it
    was at ``created_ns`` (nanoseconds since the Unix epoch). ``state``: ``creating`` or ``ready``.
    ``maker``: the uid of the user who made it through a mount (it may delete it; shown as its
    top directory's owner), or None (root or the operator's tools made it, or a database from
    before makers were recorded: its top directory's owner)."""

    id: int
    dir: int
    name: bytes
    root: int
    src: int
    created_ns: int
    state: str
    maker: int | None = None


@dataclass
class Session:
    """A client of the namespace that holds files open (each mount is one)."""

    sid: int
    name: str
    host: str
    pid: int
    started_ns: int
    heartbeat_ns: int


@dataclass
class Member:
    """A worker of a training job as the job's membership records it
    (:mod:`irdma.client.coord`): its process, its last heartbeat, the epoch it last began, and
    the barrier it waits at (``parked``; None while it trains) or ``left`` once it finished."""

    worker: int
    host: str
    pid: int
    heartbeat_ns: int
    epoch: int
    parked: str | None
    left: bool
    live: bool  # left is False, a heartbeat within MEMBER_EXPIRY_S and (on this host) its process alive


@dataclass
class DamagedFile:
    """A file some of whose recorded chunks are gone (see :meth:`MetaStore.damaged`)."""

    ino: int
    path: str  # "" when the inode has no name left
    lost_chunks: list[int]  # chunk indices
    shards: list[int]  # shard ids that lost them


#: Seconds a file that lost its last name stays openable (through a name a kernel cached just
#: before): a reader on another mount then sees the old content, never ESTALE or zeros. Twice
#: the mounts' entry cache time: this is the floor, for the default of 1 s; a mount with a
#: longer ``--entry-cache`` raises the namespace's grace to twice it before it serves
#: (:meth:`MetaStore.raise_unlink_grace`), so the rule holds for every mount. Its chunks are
#: freed only after it (:meth:`MetaStore.unlink_grace`).
UNLINK_GRACE_S = 2.0
#: Seconds after its last heartbeat that a session counts as dead (sooner for a session of
#: this host whose process is gone).
SESSION_EXPIRY_S = 30.0
#: Seconds after its last heartbeat that a training job's member counts as dead (sooner for a
#: member of this host whose process is gone); members beat every second.
MEMBER_EXPIRY_S = 10.0


class MetaStore(abc.ABC):
    """What the client and the FUSE layer need of a metadata database.

    Errors: NotFound (ENOENT), Exists (EEXIST), NotADirectory (ENOTDIR), IsADirectory
    (EISDIR), NotEmpty (ENOTEMPTY), NoAttribute (ENODATA), InvalidArgument (EINVAL),
    NameTooLong (ENAMETOOLONG: a name over :data:`NAME_MAX` bytes), NotPermitted (EPERM).

    Permissions (modes, owners, the sticky bit) are the caller's to check: the mount leaves
    them to the kernel (``default_permissions``). The engine keeps what POSIX makes part of the
    data: new entries of a set-group-ID directory take its group (and subdirectories its
    set-group-ID bit), a change of owner drops the set-user-ID and set-group-ID bits.
    """

    url: str

    # namespace
    @abc.abstractmethod
    def lookup(self, parent: int, name: bytes) -> Inode:
        """The inode named ``name`` in directory ``parent`` (``.`` and ``..`` included).

        Raises:
            NotFound, NotADirectory: ``parent`` is not a directory. NameTooLong.
        """

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
        """Change attributes; ``mode`` keeps the file type bits of the inode. A new ``uid``
        or ``gid`` of a non-directory clears S_ISUID, and S_ISGID where group-execute is set
        (as chown(2) does on Linux), unless ``mode`` is given in the same call."""

    @abc.abstractmethod
    def clear_setid(self, ino: int) -> Inode:
        """Clear S_ISUID, and S_ISGID where group-execute is set: what a write or truncate by
        an unprivileged process does to a regular file (Linux's ``file_remove_privs``).
        Changes nothing (not even ctime) when neither bit is to be cleared.

        Returns:
            The inode as it is now.
        """

    @abc.abstractmethod
    def extend(self, ino: int, end: int, mtime_ns: int, chunks: tuple[tuple[int, int, int], ...] = ()) -> Inode:
        """Grow ``size`` to at least ``end`` (never shrinks) and set mtime: after a write
        acknowledged by the shards. ``chunks`` are ``(index, shard id, incarnation)`` of chunks
        the write created; they join the file's chunk map (an existing record is kept)."""

    @abc.abstractmethod
    def create(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, chunk_size: int | None = None
    ) -> Inode:
        """Create a regular file or directory (by ``mode``), owned by ``uid``/``gid``. Files
        inherit the parent's chunk size and update op defaults, and get the stripe of all
        registered shards. In a set-group-ID directory the entry gets the directory's group
        instead of ``gid``, and a new directory the set-group-ID bit.

        Raises:
            Exists: ``name`` exists. InvalidArgument: no shard is registered (files only), or
            ``mode`` is neither a regular file nor a directory. NameTooLong.
        """

    @abc.abstractmethod
    def mknod(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0) -> Inode:
        """Create a FIFO, a socket, or a character or block device node (by ``mode``; ``rdev``
        is kept for devices, 0 for the others). Metadata only: no stripe, no chunks. Owner
        and group as in :meth:`create`.

        Raises:
            Exists, NameTooLong. InvalidArgument: ``mode`` is another file type.
        """

    @abc.abstractmethod
    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        """Create a symbolic link to ``target`` (kept as given, never resolved), mode 0777,
        ``size`` the length of ``target`` in bytes. No stripe, no chunks. Owner and group as
        in :meth:`create`.

        Raises:
            Exists, NameTooLong (also a target over :data:`SYMLINK_MAX` bytes).
            InvalidArgument: an empty target or one with a NUL byte.
        """

    @abc.abstractmethod
    def readlink(self, ino: int) -> bytes:
        """The target of a symbolic link.

        Raises:
            NotFound. InvalidArgument: ``ino`` is not a symbolic link.
        """

    @abc.abstractmethod
    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        """Give inode ``ino`` another name (a hard link); returns it with ``nlink`` counted.
        The inode and its chunks stay until its last name is gone and no session holds it open.

        Raises:
            Exists, NameTooLong. NotPermitted: ``ino`` is a directory. NotFound: ``ino`` has
            no name left (an unlinked file still open).
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

        ``flags``: :data:`RENAME_NOREPLACE` (fail with Exists if the target exists) or
        :data:`RENAME_EXCHANGE` (swap the two names, both must exist; a directory and a file
        may be swapped across directories, the parents' link counts follow).

        Returns:
            The replaced inode (its ``nlink`` already decremented) or None (nothing replaced,
            always so with :data:`RENAME_EXCHANGE`).

        Raises:
            NotFound, NotADirectory, IsADirectory, NotEmpty, NameTooLong, Exists (see above).
            InvalidArgument: a directory moved under itself, both flags, or an unknown flag.
        """

    @abc.abstractmethod
    def delete_inode(self, ino: int) -> None:
        """Delete an inode with no name left (``nlink <= 0``) and its xattrs and chunk map;
        an inode that still has a name is left alone."""

    @abc.abstractmethod
    def parent_of(self, ino: int) -> int: ...

    def inherited_xattrs(self, ino: int, names: Sequence[bytes], depth: int = 1) -> dict[bytes, bytes]:
        """Each of ``names`` as set on ``ino``, else on its nearest ancestor up to ``depth``
        levels up (a file's settings given on its job directory); names set nowhere are absent.
        One call (engines run it in one worker-thread hop)."""
        from irdma._errors import NoAttribute, NotFound

        found: dict[bytes, bytes] = {}
        at: int | None = ino
        for _ in range(depth + 1):
            if at is None or len(found) == len(names):
                break
            for name in names:
                if name not in found:
                    try:
                        found[name] = self.getxattr(at, name)
                    except (NoAttribute, NotFound):
                        pass
            try:
                parent = self.parent_of(at)
            except NotFound:
                break
            at = parent if parent != at else None
        return found

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

    # shard health and memory
    @abc.abstractmethod
    def note_incarnation(self, shard_id: int, incarnation: int) -> int:
        """Record the incarnation a client found the shard in; return the one recorded before
        (0 if none). A different non-zero previous value means the shard lost its memory: every
        chunk recorded on it with the old incarnation is lost."""

    @abc.abstractmethod
    def set_shard_health(self, shard_id: int, health: str) -> tuple[str, int]:
        """``up`` or ``down``, as a heartbeat or a failed request found it. A shard found up
        after it was down becomes ``syncing`` (it may have missed updates) until
        :meth:`mark_synced`. A change that alters chains bumps the epoch (the *view* requests
        carry). Returns the health recorded and the epoch."""

    @abc.abstractmethod
    def mark_synced(self, shard_id: int, epoch: int) -> bool:
        """A ``syncing`` shard is up to date: ``up`` again, if the epoch is still ``epoch``
        (else False: resync again)."""

    @abc.abstractmethod
    def shard_view(self) -> tuple[int, list[ShardRecord], list[Move]]:
        """The epoch, the shard map and its moves (oldest first), read together."""

    # replication
    @abc.abstractmethod
    def replicas(self) -> int:
        """Copies of each chunk for files created from now on (the namespace's setting)."""

    @abc.abstractmethod
    def set_replicas(self, replicas: int) -> None:
        """Set :meth:`replicas` (1 to 8; files get at most as many as they have shards).

        Raises:
            InvalidArgument: out of range.
        """

    @abc.abstractmethod
    def note_replica(self, ino: int, idx: int, shard_id: int, incarnation: int, epoch: int | None = None) -> bool:
        """Record that shard ``shard_id`` (in ``incarnation``) holds an up-to-date copy of a
        written chunk (after a resync or a move brought it level): it joins the chunk's in-sync
        set again. With ``epoch``, only if the shard map's epoch is still ``epoch`` (the view the
        copy was made in: a replica that went down since may have missed updates again).

        Returns:
            Whether it was recorded (False: the chunk is no longer written, or the epoch moved).
        """

    @abc.abstractmethod
    def withdraw_replicas(self, ino: int, replicas: Sequence[tuple[int, int]], epoch: int | None = None) -> bool:
        """Take replicas out of their chunks' in-sync sets before an update that skips them is
        sent (their shard is down): ``(chunk index, shard id)`` pairs. With ``epoch``, only if
        the shard map's epoch is still ``epoch`` (the view the update is built on: in a newer
        one the shard may have been resynced, and a withdrawal after that would keep a current
        copy out for good); returns whether it was recorded. The chunk map then holds
        them with incarnation :data:`OUT_OF_SYNC`, recorded even for a chunk not recorded yet,
        so that no later record of the chunk (:meth:`extend`) counts them in again; only
        :meth:`note_replica` does, after a resync copied the chunk to them.

        What this gives (Kafka's ISR; 3FS's chain states): a replica whose row is current
        holds every acknowledged update of its chunk, so after any sequence of failures
        recovery reads the in-sync set instead of guessing which copy is newest.
        """

    @abc.abstractmethod
    def replicated_chunks(self, shard_ids: Sequence[int], min_replicas: int = 2) -> list[tuple[Inode, list[int]]]:
        """Every file with at least ``min_replicas`` replicas striped over any of ``shard_ids``,
        each with the indices of its written chunks (some of which have a replica there; none
        for an empty file)."""

    # live shard operations (irdma.placement.substitute says what a move does to chains)
    @abc.abstractmethod
    def drain_shard(self, shard_id: int) -> int:
        """Begin draining a shard in service: state ``draining``, and a move of all its chunks
        to every other shard in service; bumps the epoch. Returns the new epoch (the current
        one, nothing changed, when it drains already).

        Raises:
            NotFound: no such shard. InvalidArgument: another move is in progress, the shard is
            drained or removed, or no other shard is in service.
        """

    @abc.abstractmethod
    def begin_move(self, shard_id: int, targets: Sequence[int], share: int) -> int:
        """Begin moving ``share`` (in 1/MOVE_ALL parts) of a shard's chunks to ``targets``
        (``irdma rebalance``); bumps the epoch. Returns the new epoch.

        Raises:
            InvalidArgument: another move is in progress, or a shard is not in service.
        """

    @abc.abstractmethod
    def finish_move(self, seq: int, epoch: int, moved: Sequence[tuple[int, int]] = ()) -> bool:
        """Mark move ``seq`` done, if the epoch is still ``epoch`` (its copies were made on that
        view), and forget the shard's replicas of the chunks ``moved`` (``(ino, index)``) in
        the chunk map; a drain forgets all of them and marks the shard ``drained``. Bumps the
        epoch. Returns whether it did.

        Raises:
            DataLost: a drain's shard holds the only recorded copy of a chunk (nothing changed).
        """

    @abc.abstractmethod
    def cancel_move(self, seq: int) -> None:
        """Forget move ``seq`` while it is in progress (a drain that cannot finish: its shard is
        back in service); bumps the epoch."""

    @abc.abstractmethod
    def remove_shard(self, shard_id: int, force: bool = False) -> list[tuple[int, int]]:
        """Take a drained shard out of the cluster (state ``removed``; its address may be
        registered again). With ``force`` a shard in any state: it leaves its chains at once (a
        move of all its chunks, done), a move in progress to or from it is cancelled, and the
        chunks only it held count as lost.

        Returns:
            ``(ino, chunk index)`` of the chunks recorded on it that no other replica holds
            (now lost; empty unless ``force``).

        Raises:
            NotFound: no such shard. InvalidArgument: not drained and not ``force``, or removed already.
        """

    @abc.abstractmethod
    def under_replicated(self) -> int:
        """Written chunks with at least one good replica but fewer than their file asks for
        (a good replica: on the memory it was written to, of a shard neither down nor syncing)."""

    # the chunk map: which chunks of a file hold written bytes, and on which shard memory
    @abc.abstractmethod
    def chunk_map(self, ino: int) -> dict[int, dict[int, int]]:
        """Recorded chunks of a file: chunk index -> {shard id: incarnation when written there},
        one entry per replica written; :data:`OUT_OF_SYNC` (0) for a replica that missed
        acknowledged updates (see :meth:`withdraw_replicas`). A replica is in the chunk's
        in-sync set when its incarnation is its shard's current one."""

    @abc.abstractmethod
    def damaged(self) -> list[DamagedFile]:
        """Files with a recorded chunk none of whose in-sync replicas is on the memory it was
        written to (lost for good unless an operator adopts a stale copy: ``irdma shard resync
        --force-from``). Chunks recorded only as out-of-sync replicas (a write that was never
        acknowledged recorded nothing else) are not counted."""

    # sessions and open files (JuiceFS's sessions and sustained inodes)
    @abc.abstractmethod
    def open_session(self, name: str) -> int:
        """Register a session of this process; returns its id."""

    @abc.abstractmethod
    def heartbeat(self, sid: int) -> None:
        """Keep a session alive.

        Raises:
            NotFound: the session was reaped (it missed its heartbeats): the caller must stop.
        """

    @abc.abstractmethod
    def close_session(self, sid: int) -> None:
        """End a session and drop its open-file records."""

    @abc.abstractmethod
    def sessions(self) -> list[Session]: ...

    @abc.abstractmethod
    def open_inode(self, sid: int, ino: int) -> tuple[Inode, bytes, dict[int, dict[int, int]]]:
        """What an open needs, in one transaction: the inode, its ``user.irdma.io`` mode and its
        chunk map; and a record that session ``sid`` holds it open, so that no other client
        frees its chunks while it is open (a "sustained" inode once unlinked).

        Raises:
            Stale: the inode was removed or has no name left (the kernel looks the path up again).
        """

    @abc.abstractmethod
    def open_file(self, sid: int, ino: int, own: Sequence[bytes] = (), inherited: Sequence[bytes] = ()) -> Opened:
        """:meth:`open_inode` and the extended attributes an open reads (``own``: set on the
        file; ``inherited``: set on it, else on its directory), in one transaction: an open of a
        file is one metadata round trip.

        Raises:
            Stale: as :meth:`open_inode`.
        """

    @abc.abstractmethod
    def create_open(self, sid: int, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    inherited: Sequence[bytes] = ()) -> Opened:
        """:meth:`create` of a regular file and :meth:`open_file` of it in one transaction (its
        chunk map is empty; it has no own xattr but the inherited I/O mode).

        Raises:
            as :meth:`create`.
        """

    @abc.abstractmethod
    def close_inodes(self, sid: int, inos: Sequence[int]) -> list[tuple[int, Inode | None, bool]]:
        """:meth:`close_inode` of each of ``inos`` in one transaction: ``(ino, inode or None,
        reclaimable)`` each, in order (a mount closes the files released meanwhile together)."""

    @abc.abstractmethod
    def resolve_chunks(self, path: str, create_mode: int | None = None, uid: int = 0, gid: int = 0,
                       chunk_size: int | None = None) -> tuple[Inode, dict[int, dict[int, int]]]:
        """The inode at ``path`` and its chunk map, in one call; with ``create_mode``, a missing
        regular file is created first (``mode``, ``uid``, ``gid``, ``chunk_size`` as
        :meth:`create`): the native client's open of a file.

        Raises:
            NotFound (the file without ``create_mode``, or a parent), NotADirectory,
            InvalidArgument: as :meth:`create`.
        """

    @abc.abstractmethod
    def close_inode(self, sid: int, ino: int) -> tuple[Inode | None, bool]:
        """Drop session ``sid``'s open record of ``ino``. Returns the inode (None if gone) and
        whether it is reclaimable: no name left and no live session holds it open; the caller
        then frees its chunks and calls :meth:`delete_inode`."""

    @abc.abstractmethod
    def reclaimable(self, ino: int, grace: bool = True) -> Inode | None:
        """The inode if it has no name left, no live session holds it open and (with ``grace``)
        its unlink grace period is over; else None."""

    @abc.abstractmethod
    def unlink_grace(self) -> float:
        """Seconds a file that lost its last name stays openable: :data:`UNLINK_GRACE_S`, or
        more where a mount raised it (:meth:`raise_unlink_grace`)."""

    @abc.abstractmethod
    def raise_unlink_grace(self, seconds: float) -> float:
        """Make :meth:`unlink_grace` at least ``seconds`` (a mount whose entry cache is longer
        than half of it calls this before it serves). It never lowers it: a mount that left
        cannot say whether another still caches names that long. Returns the grace now in force."""

    @abc.abstractmethod
    def dead_sessions(self) -> list[Session]:
        """Sessions past their expiry, or of this host with their process gone."""

    @abc.abstractmethod
    def reap_session(self, sid: int) -> None:
        """Remove a dead session and its open-file records."""

    @abc.abstractmethod
    def path_of(self, ino: int) -> str:
        """One path of an inode ("" if it has no name)."""

    @abc.abstractmethod
    def file_sizes(self) -> dict[int, tuple[int, int, bool]]:
        """Every regular file: ino -> (size in bytes, chunk size, open in a live session)."""

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
