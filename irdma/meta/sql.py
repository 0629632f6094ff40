"""The SQL metadata engine: every :class:`~irdma.meta.base.MetaStore` method, written once.

:class:`SqlMeta` holds the namespace's rules and every statement (in the SQL both SQLite and
PostgreSQL take, see :mod:`irdma.meta.sql_rows`); the shard map, chunk map and sessions come
from :class:`~irdma.meta.sql_cluster.SqlCluster`. A driver (:mod:`irdma.meta.sqlite`,
:mod:`irdma.meta.postgres`) is a subclass that supplies the dialect:

- ``_db``: where this call runs statements (a :class:`~irdma.meta.sql_rows.Cursor`); outside a
  transaction every statement sees the latest committed state (autocommit);
- ``_BEGIN``: the statement that starts a write transaction (SQLite ``BEGIN IMMEDIATE``: the
  write lock at once; PostgreSQL ``BEGIN ISOLATION LEVEL SERIALIZABLE``);
- ``_acquire`` / ``_release``: take and give back this call's connection (a pool's, for PostgreSQL);
- ``_retryable`` and ``_failure``: which database errors mean "run the whole call again" (a
  serialization failure: nothing was changed) and what every other one becomes (:class:`Busy`,
  :class:`MetadataError`), logged once;
- ``_DB_ERROR``: the driver's base exception class.

How a call runs (:meth:`SqlMeta._call`): every public method is wrapped; the outermost call of a
thread takes a connection, runs the method, and on a retryable error rolls back (``_tx`` does),
gives the connection back, sleeps a jittered, growing backoff, and runs the whole method again,
until ``busy_timeout`` seconds have passed; then :class:`Busy`. A method that calls another
public method (``lookup`` calls ``getattr``) runs it on the same connection, and leaves errors
to the outer call. Methods are pure database work, so running one again is safe, with one
exception that the next paragraphs deal with: a commit whose answer never came.

Lost connections (a driver whose ``_connection_lost`` says so: PostgreSQL, on a server restart,
a failover, a network cut): the call runs again on a new connection (``_acquire(fresh=True)``),
after a jittered pause of 50 ms doubling to 1 s, until ``failover_timeout`` seconds after the
first loss; then the driver's ``_lost_failure`` (:class:`MetadataError` with what to do).
Statements before the COMMIT changed nothing (the server rolls back a transaction whose
connection is gone), so those simply run again.

Commits whose outcome is unknown (drivers with ``_TXIDS``: PostgreSQL). When the connection
breaks after COMMIT was sent and before its answer came, the transaction may or may not have
committed, and the client gets the same error either way (the PostgreSQL documentation says so
where it offers ``pg_xact_status``, "Transaction ID and Snapshot Information Functions": it is
for applications that "become disconnected while a COMMIT is in progress"). Running the call
again could apply it twice (a create that landed would then report ``Exists``, a clock would
tick twice); reporting a failure would be wrong when it landed. So every write transaction
carries a transaction id, a UUID made once per call before its first attempt and recorded in a
row of its own (rather than the server's xid, which would take one more round trip per write
to learn before the COMMIT; a row works the same on any engine): ``_tx`` leaves the
transaction open, and :meth:`SqlMeta._call`, once the method returned its value, has the
driver's ``_commit`` insert the id into the ``txids`` table and commit, in the same
transaction (one message). If that commit's answer is lost, the next attempt first asks the
driver's ``_landed`` (on a new connection, once the old connection's server process is gone,
so its transaction is finished one way or the other) whether the id is there: if so, the call
landed and returns the value it computed in the transaction that committed (kept in memory:
the retry is the same call in the same process, so no result is stored, read back or
unpickled from the database); if not, nothing landed and the call runs again. Read-only
transactions (``_tx(read_only=True)``: nothing to apply twice) commit at once, without an id.
SQLite has no ids: its COMMIT is a call into a local file, which returns or takes the calling
process down with it; there is no connection that could be lost in between.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

from irdma import xattrs
from irdma._errors import (
    Busy,
    Exists,
    InvalidArgument,
    IrdmaError,
    IsADirectory,
    NameTooLong,
    NoAttribute,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    ReadOnly,
)
from irdma.placement import DEFAULT_CHUNK_SIZE, check_chunk_size
from irdma.wire import compress
from irdma.wire.optimizers import format_update, parse_update

from .base import (
    CACHE_MODES,
    IO_MODES,
    NAME_MAX,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    SNAPSHOTS_DIR_MARK,
    SYMLINK_MAX,
    XATTR_CACHE,
    XATTR_CHUNK_SIZE,
    XATTR_IO,
    XATTR_MAX_SNAPSHOTS,
    XATTR_SHAPE,
    XATTR_UPDATE,
    Inode,
    MetaStore,
    parse_max_snapshots,
    parse_shape,
    setid_bits,
)
from .sql_cluster import SqlCluster
from .sql_rows import COLS, I_COLS, VIRTUAL, Cursor, check_name, inode_row, now
from .sql_snap import SqlSnap
from .sql_sync import SqlSync

log = logging.getLogger("irdma.meta")
_F = TypeVar("_F", bound=Callable[..., Any])
#: First and largest pause (seconds) before a call runs again after a serialization failure.
RETRY_FIRST_S = 0.002
RETRY_MAX_S = 0.2
#: First and largest pause (seconds) before a call tries a lost server again (restart, failover).
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 1.0
#: Seconds a call waits for a lost metadata server to answer again, by default.
FAILOVER_TIMEOUT_S = 30.0


def _invalid_as_einval(parse: Callable[[bytes | str], str]) -> Callable[[bytes | str], str]:
    """A normalizer whose ValueError becomes InvalidArgument (EINVAL: nothing stored)."""

    def check(value: bytes | str) -> str:
        try:
            return parse(value)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    return check


_JOB_XATTRS = {
    xattrs.XATTR_CONSISTENCY: lambda v: xattrs.parse_consistency(v).name,
    xattrs.XATTR_WORKERS: lambda v: str(xattrs.parse_workers(v)),
    xattrs.XATTR_SYNC_TIMEOUT: lambda v: repr(xattrs.parse_timeout(v)),
    xattrs.XATTR_MAX_LEASE: lambda v: repr(xattrs.parse_timeout(v)),  # a lock's longest lease (fs/control.py)
    **{name: _invalid_as_einval(parse) for name, parse in xattrs.XATTRS.items()},  # P3 slicing, layer dropping
    compress.XATTR_COMPRESS: compress.xattr_value,
    XATTR_MAX_SNAPSHOTS: _invalid_as_einval(parse_max_snapshots),  # a directory's snapshots at most (sql_snap)
}


class SqlMeta(SqlCluster, SqlSync, SqlSnap, MetaStore):
    """The namespace in an SQL database; a driver subclass supplies the connection and dialect.

    Attributes:
        url: the metadata URL as users may see it (never with a password).
        busy_timeout: seconds a call may wait for other writers (locks, retries) before it
            raises :class:`Busy`; a client sets it to its own request timeout.
        retries: calls run again after a serialization failure, since the engine opened (a
            measure of contention between clients).
        failover_timeout: seconds a call keeps trying a server whose connection was lost
            (restart, failover) before :class:`MetadataError` (engines with connections).
        reconnects: tries after a lost connection, since the engine opened.
        commits_resolved: commits whose answer was lost, settled by looking up their
            transaction id; ``commits_landed`` of them had landed (their value was returned,
            the call not run again).
    """

    url: str
    busy_timeout: float = 10.0
    failover_timeout: float = FAILOVER_TIMEOUT_S
    retries: int = 0
    reconnects: int = 0
    commits_resolved: int = 0
    commits_landed: int = 0
    _BEGIN: ClassVar[str] = "BEGIN"
    _DB_ERROR: ClassVar[type[Exception]] = Exception
    #: Whether write transactions carry a transaction id (see the module docstring).
    _TXIDS: ClassVar[bool] = False
    _local: threading.local

    # ---------------------------------------------------------------- the driver's part
    @property
    def _db(self) -> Cursor:
        """Where this call runs statements outside a transaction."""
        raise NotImplementedError

    def _acquire(self, fresh: bool = False) -> None:
        """Take a connection for the call now starting on this thread; ``fresh``: a new one
        (the call lost its last), not one that may have been open before."""

    def _release(self, ok: bool = False) -> None:
        """Give back the connection :meth:`_acquire` took; ``ok``: the call succeeded on it."""

    @property
    def connection(self) -> Any:
        """This thread's call's driver connection (see :meth:`held`): sqlite3's or psycopg's."""
        raise NotImplementedError

    @contextlib.contextmanager
    def held(self) -> Iterator[Any]:
        """Hold one connection for the block, outside the per-call retries (a dump or load, which
        cannot run again once written halfway): engine calls in the block run on it as inside one
        call. Yields :attr:`connection`; given back when the block ends (failed if it raised)."""
        self._acquire()
        ok = False
        self._local.depth = 1  # engine calls made meanwhile run on this connection
        try:
            yield self.connection
            ok = True
        finally:
            self._local.depth = 0
            self._release(ok)

    def _connection_lost(self, exc: Exception) -> bool:
        """Whether ``exc`` (of ``_DB_ERROR``) means the connection to the server is gone, so
        the call may run again on a new one (the driver notes the loss)."""
        return False

    def _commit(self, txid: uuid.UUID) -> None:
        """Record ``txid`` in the open transaction and commit it (drivers with ``_TXIDS``)."""
        raise NotImplementedError

    def _landed(self, txid: uuid.UUID, committing: object, until: float) -> bool:
        """Whether the transaction with id ``txid`` committed; ``committing`` is what
        ``_commit`` left in ``self._local.committing`` when its answer was lost, ``until`` the
        call's deadline (``time.monotonic()``)."""
        raise NotImplementedError

    def _lost_failure(self, op: str, exc: Exception, unknown: bool) -> IrdmaError:
        """The error of method ``op`` whose server did not come back within
        ``failover_timeout``; ``unknown``: whether its last commit landed is not known."""
        return self._failure(op, exc, False)

    def _retryable(self, exc: Exception, attempt: int) -> bool:
        """Whether ``exc`` (of ``_DB_ERROR``, the ``attempt``-th failure of this call) changed
        nothing and the whole call may run again."""
        return False

    def _failure(self, op: str, exc: Exception, retried: bool) -> IrdmaError:
        """The :class:`IrdmaError` a database error of method ``op`` becomes (logged here, once).
        ``retried``: it was retryable but the call's ``busy_timeout`` ran out."""
        raise NotImplementedError

    # ---------------------------------------------------------------- how a call runs
    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run method ``fn`` on one connection, again while it fails in a retryable way or
        loses its connection; a commit whose answer was lost is settled by its transaction id
        (see the module docstring)."""
        local = self._local
        if getattr(local, "depth", 0):  # inside another public call: its connection, its errors
            return fn(self, *args, **kwargs)
        deadline = time.monotonic() + self.busy_timeout
        lost_until: float | None = None  # set by the first lost connection: when to give up
        pause, wait = RETRY_FIRST_S, RECONNECT_FIRST_S
        attempt = 0
        txid = uuid.uuid4() if self._TXIDS else None  # one per call, before its first attempt
        computed: Any = None  # the value of the attempt whose commit was sent last
        unknown: object = None  # what _commit left when that commit's answer was lost
        while True:
            local.committing = None
            try:
                self._acquire(fresh=lost_until is not None)
                ok = False
                local.depth = 1
                local.pending = False
                try:
                    if unknown is not None:
                        assert txid is not None and lost_until is not None
                        landed = self._landed(txid, unknown, lost_until)
                        self.commits_resolved += 1
                        unknown = None
                        if landed:
                            self.commits_landed += 1
                            ok = True
                            return computed
                    result = fn(self, *args, **kwargs)
                    if local.pending:  # a write transaction left open by _tx: its id, then COMMIT
                        assert txid is not None
                        local.pending = False
                        computed = result
                        self._commit(txid)
                    ok = True
                    return result
                finally:
                    local.depth = 0
                    local.pending = False
                    self._release(ok)
            except self._DB_ERROR as exc:
                sent, local.committing = local.committing, None
                if self._connection_lost(exc):
                    if sent is not None:  # COMMIT sent, no answer: landed or not, the id will tell
                        unknown = sent
                    t = time.monotonic()
                    if lost_until is None:
                        lost_until = t + self.failover_timeout
                    if t >= lost_until:
                        raise self._lost_failure(fn.__name__, exc, unknown is not None) from None
                    self.reconnects += 1
                    time.sleep(min(random.uniform(wait / 2, wait), lost_until - t))  # the last try: at the deadline
                    wait = min(wait * 2, RECONNECT_MAX_S)
                    deadline = max(deadline, time.monotonic() + self.busy_timeout)  # conflicts: their own time
                    continue
                if unknown is not None:  # the outcome could not be settled: say so, never guess
                    raise self._lost_failure(fn.__name__, exc, True) from None
                attempt += 1
                retry = self._retryable(exc, attempt)
                if not retry or time.monotonic() + pause >= deadline:
                    raise self._failure(fn.__name__, exc, retry) from None
            self.retries += 1
            time.sleep(random.uniform(pause / 2, pause))  # jitter: two writers do not collide again
            pause = min(pause * 2, RETRY_MAX_S)

    @contextlib.contextmanager
    def _tx(self, read_only: bool = False) -> Iterator[Cursor]:
        """A write transaction: committed if the block returns, rolled back if it raises.

        On an engine with transaction ids (``_TXIDS``) and inside an engine call, a block that
        returns leaves the transaction open: :meth:`_call` commits it with the call's id once
        the method has its value (the block must be the method's last statement).
        ``read_only``: a transaction that changes nothing (one snapshot of several reads),
        committed here without an id (running it again is harmless)."""
        c = self._db
        c.execute(self._BEGIN)
        try:
            yield c
        except BaseException:
            with contextlib.suppress(self._DB_ERROR):  # a broken connection has nothing to roll back
                c.execute("ROLLBACK")
            raise
        else:
            if self._TXIDS and not read_only and getattr(self._local, "depth", False):
                self._local.pending = True
            else:
                c.execute("COMMIT")

    def _get(self, c: Cursor, ino: int) -> Inode:
        row = c.execute(f"SELECT {COLS} FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None:
            raise NotFound(f"no inode {ino}")
        return inode_row(row)

    def _lookup(self, c: Cursor, parent: int, name: bytes) -> Inode:
        p = self._get(c, parent)
        if not p.is_dir:
            raise NotADirectory(f"inode {parent} is not a directory")
        row = c.execute(
            f"SELECT {I_COLS} FROM dentries d"
            " JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.name=?",
            (parent, name),
        ).fetchone()
        if row is None:
            raise NotFound(f"no entry {name.decode(errors='replace')!r} in directory {parent}")
        return inode_row(row)

    # ---------------------------------------------------------------- namespace
    def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes is longer than {NAME_MAX}")
        if name == b".":
            return self.getattr(parent)
        if name == b"..":
            return self.getattr(self.parent_of(parent))
        return self._shown(self._db, self._lookup(self._db, parent, name))

    def getattr(self, ino: int) -> Inode:
        return self._shown(self._db, self._get(self._db, ino))

    def getattr_io(self, ino: int) -> tuple[Inode, bytes]:
        got = self._get_io(self._db, ino)
        if got is None:
            raise NotFound(f"no inode {ino}")
        return got

    def _get_io(self, c: Cursor, ino: int) -> tuple[Inode, bytes] | None:
        """The inode and its ``user.irdma.io`` mode in one query, or None."""
        row = c.execute(
            f"SELECT {I_COLS}, x.value FROM inodes i"
            " LEFT JOIN xattrs x ON x.ino = i.ino AND x.name = ? WHERE i.ino = ?",
            (XATTR_IO, ino),
        ).fetchone()
        if row is None:
            return None
        return inode_row(row[:-1]), bytes(row[-1]) if row[-1] is not None else b"cached"

    def parent_of(self, ino: int) -> int:
        if ino == ROOT_INO:
            return ROOT_INO
        row = self._db.execute("SELECT parent FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
        if row is None:
            raise NotFound(f"inode {ino} has no parent")
        return int(row[0])

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
        with self._tx() as c:
            self._writable(c, ino)
            inode = self._get(c, ino)
            if size is not None:
                if inode.is_dir:
                    raise IsADirectory(f"inode {ino} is a directory")
                if size < 0:
                    raise InvalidArgument(f"negative size {size}")
                inode.size = size
                inode.mtime_ns = now()
                if inode.chunk_size:  # chunks past the new end are no longer the file's
                    c.execute("DELETE FROM chunks WHERE ino=? AND idx>=?", (ino, -(-size // inode.chunk_size)))
            if mode is not None:
                inode.mode = stat.S_IFMT(inode.mode) | stat.S_IMODE(mode)
            elif (uid is not None or gid is not None) and not inode.is_dir:
                inode.mode &= ~setid_bits(inode.mode)  # chown(2) drops them
            if uid is not None:
                inode.uid = uid
            if gid is not None:
                inode.gid = gid
            if atime_ns is not None:
                inode.atime_ns = atime_ns
            if mtime_ns is not None:
                inode.mtime_ns = mtime_ns
            inode.ctime_ns = now()
            c.execute(
                "UPDATE inodes SET mode=?, uid=?, gid=?, size=?, atime_ns=?, mtime_ns=?, ctime_ns=? WHERE ino=?",
                (inode.mode, inode.uid, inode.gid, inode.size, inode.atime_ns, inode.mtime_ns, inode.ctime_ns, ino),
            )
            return inode

    def extend(self, ino: int, end: int, mtime_ns: int, chunks: tuple[tuple[int, int, int], ...] = ()) -> Inode:
        with self._tx() as c:
            self._writable(c, ino)
            c.execute(
                "UPDATE inodes SET size=CASE WHEN size > ? THEN size ELSE ? END, mtime_ns=?, ctime_ns=? WHERE ino=?",
                (end, end, mtime_ns, mtime_ns, ino),
            )
            if chunks:
                c.executemany("INSERT INTO chunks VALUES (?,?,?,?) ON CONFLICT DO NOTHING", [(ino, i, s, n) for i, s, n in chunks])
            return self._get(c, ino)

    def create(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, chunk_size: int | None = None
    ) -> Inode:
        if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
            raise InvalidArgument("only regular files and directories can be created (mknod, symlink: the others)")
        if chunk_size is not None:
            try:
                check_chunk_size(chunk_size)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        with self._tx() as c:
            self._writable(c, parent)
            return self._insert(c, parent, name, mode, uid, gid, chunk_size=chunk_size)

    def mknod(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0) -> Inode:
        if stat.S_IFMT(mode) not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise InvalidArgument(f"mknod makes FIFOs, sockets and device nodes, not file type {stat.S_IFMT(mode):o}")
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        with self._tx() as c:
            self._writable(c, parent)
            return self._insert(c, parent, name, mode, uid, gid, rdev=rdev)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if not target or b"\0" in target:
            raise InvalidArgument(f"invalid symbolic link target {target[:64]!r}")
        if len(target) > SYMLINK_MAX:
            raise NameTooLong(f"symbolic link target of {len(target)} bytes is longer than {SYMLINK_MAX}")
        with self._tx() as c:
            self._writable(c, parent)
            return self._insert(c, parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def _insert(
        self, c: Cursor, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
        chunk_size: int | None = None, rdev: int = 0, target: bytes | None = None,
    ) -> Inode:
        """A new inode of any type named ``name`` in ``parent``; only regular files get a
        stripe, a chunk size and an update op."""
        check_name(name)
        is_dir = stat.S_ISDIR(mode)
        p = self._get(c, parent)
        if not p.is_dir:
            raise NotADirectory(f"inode {parent} is not a directory")
        if c.execute("SELECT 1 FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone():
            raise Exists(f"{name.decode(errors='replace')!r} exists")
        if p.mode & stat.S_ISGID:  # BSD group semantics in a set-group-ID directory
            gid = p.gid
            if is_dir:
                mode |= stat.S_ISGID
        t = now()
        values: tuple[object, ...]
        if is_dir:
            values = (mode, uid, gid, 2, t, t, t, chunk_size, "", None, 1)
        elif stat.S_ISREG(mode):
            shards = [r[0] for r in c.execute("SELECT id FROM shards WHERE state='up' ORDER BY id")]
            if not shards:
                raise InvalidArgument(
                    "no shard is registered in this namespace",
                    "start shards with `irdma up` or register one with `irdma shard add`",
                )
            csize = chunk_size or p.chunk_size or DEFAULT_CHUNK_SIZE
            replicas = max(1, min(self._replicas(c), len(shards)))
            values = (mode, uid, gid, 1, t, t, t, csize, ",".join(map(str, shards)), p.update_op or "assign", replicas)
        else:  # symbolic links, FIFOs, sockets, device nodes: metadata only
            values = (mode, uid, gid, 1, t, t, t, None, "", None, 1)
        ino = c.execute(
            "INSERT INTO inodes(mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe,"
            " update_op, replicas, size, rdev, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) RETURNING ino",
            (*values, len(target) if target is not None else 0, rdev, target),
        ).fetchone()[0]
        c.execute("INSERT INTO dentries VALUES (?,?,?)", (parent, name, ino))
        if is_dir or stat.S_ISREG(mode):
            # the I/O mode is inherited from the directory, like the update op and chunk size
            c.execute("INSERT INTO xattrs SELECT ?, name, value FROM xattrs WHERE ino=? AND name=?",
                      (ino, parent, XATTR_IO))
        if is_dir:
            c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (parent,))
        c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))
        return self._get(c, ino)

    def readlink(self, ino: int) -> bytes:
        row = self._db.execute("SELECT mode, target FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None:
            raise NotFound(f"no inode {ino}")
        if not stat.S_ISLNK(row[0]) or row[1] is None:
            raise InvalidArgument(f"inode {ino} is not a symbolic link")
        return bytes(row[1])

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        check_name(name)
        with self._tx() as c:
            self._writable(c, ino, parent)
            inode = self._get(c, ino)
            if inode.is_dir:
                raise NotPermitted(f"inode {ino} is a directory: directories cannot have hard links")
            if inode.nlink <= 0:
                raise NotFound(f"inode {ino} has no name left")
            p = self._get(c, parent)
            if not p.is_dir:
                raise NotADirectory(f"inode {parent} is not a directory")
            if c.execute("SELECT 1 FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone():
                raise Exists(f"{name.decode(errors='replace')!r} exists")
            t = now()
            c.execute("INSERT INTO dentries VALUES (?,?,?)", (parent, name, ino))
            c.execute("UPDATE inodes SET nlink=nlink+1, ctime_ns=? WHERE ino=?", (t, ino))
            c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))
            return self._get(c, ino)

    def clear_setid(self, ino: int) -> Inode:
        with self._tx() as c:
            self._writable(c, ino)
            inode = self._get(c, ino)
            bits = setid_bits(inode.mode)
            if bits:
                inode.mode &= ~bits
                inode.ctime_ns = now()
                c.execute("UPDATE inodes SET mode=?, ctime_ns=? WHERE ino=?", (inode.mode, inode.ctime_ns, ino))
            return inode

    def readdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        d = self.getattr(ino)
        if not d.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        rows = self._db.execute(
            f"SELECT d.name, {I_COLS} FROM dentries d"
            " JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND i.snap <> ? ORDER BY d.name",
            (ino, SNAPSHOTS_DIR_MARK),  # a directory's .snapshots is hidden (as CephFS's .snap)
        ).fetchall()
        if d.snap == SNAPSHOTS_DIR_MARK:  # the snapshots' top directories: their makers' (as lookup shows them)
            return [(bytes(r[0]), self._shown(self._db, inode_row(r[1:]))) for r in rows]
        return [(bytes(r[0]), inode_row(r[1:])) for r in rows]

    def unlink(self, parent: int, name: bytes) -> Inode:
        with self._tx() as c:
            self._writable(c, parent)
            inode = self._lookup(c, parent, name)
            if inode.is_dir:
                raise IsADirectory(f"{name.decode(errors='replace')!r} is a directory: use rmdir")
            self._drop_name(c, parent, name, inode)
            return inode

    def _drop_name(self, c: Cursor, parent: int, name: bytes, inode: Inode) -> None:
        t = now()
        c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
        inode.nlink -= 1
        c.execute("UPDATE inodes SET nlink=?, ctime_ns=? WHERE ino=?", (inode.nlink, t, inode.ino))
        c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))

    def rmdir(self, parent: int, name: bytes) -> None:
        with self._tx() as c:
            self._writable(c, parent)
            inode = self._lookup(c, parent, name)
            if not inode.is_dir:
                raise NotADirectory(f"{name.decode(errors='replace')!r} is not a directory")
            if not self._emptied(c, inode.ino):
                raise NotEmpty(f"directory {name.decode(errors='replace')!r} is not empty")
            c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
            c.execute("DELETE FROM inodes WHERE ino=?", (inode.ino,))
            c.execute("DELETE FROM xattrs WHERE ino=?", (inode.ino,))
            t = now()
            c.execute("UPDATE inodes SET nlink=nlink-1, mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))

    def rename(
        self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int = 0
    ) -> Inode | None:
        check_name(name_old)
        check_name(name_new)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise InvalidArgument(f"unsupported rename flags {flags:#x}")
        if flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_NOREPLACE and RENAME_EXCHANGE exclude each other")
        with self._tx() as c:
            self._writable(c, parent_old, parent_new)
            src = self._lookup(c, parent_old, name_old)
            if src.snap:
                raise ReadOnly(f"{name_old.decode(errors='replace')!r} holds snapshots: it cannot be renamed")
            if not self._get(c, parent_new).is_dir:
                raise NotADirectory(f"inode {parent_new} is not a directory")
            try:
                dst: Inode | None = self._lookup(c, parent_new, name_new)
            except NotFound:
                if flags & RENAME_EXCHANGE:
                    raise
                dst = None
            if dst is not None and dst.ino == src.ino:
                return None  # same file: rename(2) does nothing
            if dst is not None and flags & RENAME_NOREPLACE:
                raise Exists(f"{name_new.decode(errors='replace')!r} exists")
            if src.is_dir:
                self._check_not_under(c, src.ino, parent_new)
            if flags & RENAME_EXCHANGE:
                assert dst is not None
                self._exchange(c, parent_old, name_old, src, parent_new, name_new, dst)
                return None
            if dst is not None:
                if dst.is_dir and not src.is_dir:
                    raise IsADirectory(f"{name_new.decode(errors='replace')!r} is a directory")
                if src.is_dir and not dst.is_dir:
                    raise NotADirectory(f"{name_new.decode(errors='replace')!r} is not a directory")
                if dst.is_dir:
                    if not self._emptied(c, dst.ino):
                        raise NotEmpty(f"directory {name_new.decode(errors='replace')!r} is not empty")
                    c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent_new, name_new))
                    c.execute("DELETE FROM inodes WHERE ino=?", (dst.ino,))
                    c.execute("DELETE FROM xattrs WHERE ino=?", (dst.ino,))
                    c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (parent_new,))
                    dst = None
                else:
                    self._drop_name(c, parent_new, name_new, dst)
            t = now()
            c.execute(
                "UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?",
                (parent_new, name_new, parent_old, name_old),
            )
            if src.is_dir and parent_old != parent_new:
                c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (parent_old,))
                c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (parent_new,))
            c.execute("UPDATE inodes SET ctime_ns=? WHERE ino=?", (t, src.ino))
            c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino IN (?, ?)", (t, t, parent_old, parent_new))
            return dst

    def _check_not_under(self, c: Cursor, dir_ino: int, parent: int) -> None:
        """Refuse to move directory ``dir_ino`` into ``parent`` if that is ``dir_ino`` or lies
        under it."""
        p = parent
        while True:
            if p == dir_ino:
                raise InvalidArgument("cannot move a directory into itself")
            if p == ROOT_INO:
                return
            row = c.execute("SELECT parent FROM dentries WHERE ino=?", (p,)).fetchone()
            if row is None:
                return
            p = int(row[0])

    def _exchange(
        self, c: Cursor, parent_a: int, name_a: bytes, a: Inode, parent_b: int, name_b: bytes, b: Inode
    ) -> None:
        """RENAME_EXCHANGE: the two names swap inodes; a directory that changes parent moves
        its ``..`` link (the parents' ``nlink``) with it."""
        if b.is_dir:
            self._check_not_under(c, b.ino, parent_a)
        c.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?", (b.ino, parent_a, name_a))
        c.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?", (a.ino, parent_b, name_b))
        if parent_a != parent_b and a.is_dir != b.is_dir:
            moved_from, moved_to = (parent_a, parent_b) if a.is_dir else (parent_b, parent_a)
            c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (moved_from,))
            c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (moved_to,))
        t = now()
        c.execute("UPDATE inodes SET ctime_ns=? WHERE ino IN (?, ?)", (t, a.ino, b.ino))
        c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino IN (?, ?)", (t, t, parent_a, parent_b))

    def delete_inode(self, ino: int) -> None:
        with self._tx() as c:
            if c.execute("DELETE FROM inodes WHERE ino=? AND nlink<=0", (ino,)).rowcount:
                c.execute("DELETE FROM xattrs WHERE ino=?", (ino,))
                c.execute("DELETE FROM chunks WHERE ino=?", (ino,))
                c.execute("DELETE FROM open_files WHERE ino=?", (ino,))

    # ---------------------------------------------------------------- xattrs
    def getxattr(self, ino: int, name: bytes) -> bytes:
        inode = self.getattr(ino)
        if name == XATTR_UPDATE and inode.update_op:
            return inode.update_op.encode()
        if name == XATTR_CHUNK_SIZE and inode.chunk_size:
            return str(inode.chunk_size).encode()
        row = self._db.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
        if row is None:
            raise NoAttribute(f"no attribute {name.decode(errors='replace')} on inode {ino}")
        return bytes(row[0])

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        with self._tx() as c:
            self._writable(c, ino)
            inode = self._get(c, ino)
            if name == XATTR_UPDATE:
                try:
                    op = format_update(parse_update(value))
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
                c.execute("UPDATE inodes SET update_op=?, ctime_ns=? WHERE ino=?", (op, now(), ino))
            elif name in _JOB_XATTRS:  # a training job's settings (irdma.client.coord), normalized
                text = _JOB_XATTRS[name](value)  # InvalidArgument: nothing stored
                c.execute("INSERT INTO xattrs VALUES (?,?,?) ON CONFLICT (ino, name) DO UPDATE SET value=excluded.value",
                          (ino, name, text.encode()))
            elif name == XATTR_CHUNK_SIZE:
                try:
                    size = check_chunk_size(int(value.decode("ascii", "replace").strip() or "x"))
                except ValueError as exc:
                    raise InvalidArgument(f"bad {XATTR_CHUNK_SIZE.decode()} {value!r}: {exc}") from None
                if not inode.is_dir and inode.size:
                    raise Busy("the chunk size of a file can change only while it is empty")
                c.execute("UPDATE inodes SET chunk_size=?, ctime_ns=? WHERE ino=?", (size, now(), ino))
            else:
                if name == XATTR_IO and value.strip() not in IO_MODES:
                    raise InvalidArgument(f"bad {XATTR_IO.decode()} {value!r}: use cached or direct")
                if name == XATTR_CACHE:
                    if value.strip() not in CACHE_MODES:
                        raise InvalidArgument(f"bad {XATTR_CACHE.decode()} {value!r}: use default, readonly or off")
                    value = value.strip()
                if name == XATTR_SHAPE:
                    try:
                        value = ",".join(map(str, parse_shape(value))).encode()
                    except ValueError as exc:
                        raise InvalidArgument(str(exc)) from None
                c.execute("INSERT INTO xattrs VALUES (?,?,?) ON CONFLICT (ino, name) DO UPDATE SET value=excluded.value",
                          (ino, name, value.strip() if name == XATTR_IO else value))
                c.execute("UPDATE inodes SET ctime_ns=? WHERE ino=?", (now(), ino))

    def listxattr(self, ino: int) -> list[bytes]:
        inode = self.getattr(ino)
        names = [n for n, v in ((XATTR_UPDATE, inode.update_op), (XATTR_CHUNK_SIZE, inode.chunk_size)) if v]
        names += [bytes(r[0]) for r in self._db.execute("SELECT name FROM xattrs WHERE ino=? ORDER BY name", (ino,))]
        return names

    def removexattr(self, ino: int, name: bytes) -> None:
        with self._tx() as c:
            self._writable(c, ino)
            inode = self._get(c, ino)
            if name in VIRTUAL:
                if not inode.is_dir:
                    raise InvalidArgument(f"{name.decode()} of a file cannot be removed, only set")
                col = "update_op" if name == XATTR_UPDATE else "chunk_size"
                c.execute(f"UPDATE inodes SET {col}=NULL WHERE ino=?", (ino,))
                return
            if c.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount == 0:
                raise NoAttribute(f"no attribute {name.decode(errors='replace')} on inode {ino}")
            # a change of the inode (as Linux's removexattr): what a read cache checks before the xattr
            c.execute("UPDATE inodes SET ctime_ns=? WHERE ino=?", (now(), ino))

    # ---------------------------------------------------------------- whole namespace
    def usage(self) -> tuple[int, int]:
        n, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM inodes").fetchone()
        return int(n), int(size)

    def orphans(self) -> list[Inode]:
        return [inode_row(r) for r in self._db.execute(f"SELECT {COLS} FROM inodes WHERE nlink<=0")]

def _engine_call(fn: _F) -> _F:
    """Run a public method through :meth:`SqlMeta._call` (connection, retries, errors)."""

    @functools.wraps(fn)
    def wrapper(self: SqlMeta, *args: Any, **kwargs: Any) -> Any:
        return self._call(fn, args, kwargs)

    return wrapper  # type: ignore[return-value]


#: The methods that run through :meth:`SqlMeta._call`: the whole interface but ``close``, and
#: the synchronization state's (clocks, members, barriers, locks, counters: on PostgreSQL a
#: statement needs the call's connection).
ENGINE_METHODS = sorted((MetaStore.__abstractmethods__ | {"getattr_io"}
                         | {n for n, f in vars(SqlSync).items() if not n.startswith("_") and callable(f)}
                         | {n for n, f in vars(SqlSnap).items() if not n.startswith("_") and callable(f)}) - {"close"})
for _name in ENGINE_METHODS:
    setattr(SqlMeta, _name, _engine_call(getattr(SqlMeta, _name)))
