"""The embedded metadata engine: one SQLite file in WAL mode.

Several processes of one host (every mount, the CLI, native clients) open the same file; WAL
lets readers run beside one writer, and every change is one ``BEGIN IMMEDIATE`` transaction,
so a rename is atomic for all of them (https://www.sqlite.org/wal.html). Inode numbers come
from ``AUTOINCREMENT`` and are never reused: they name files on the shards.

Each thread gets its own connection (callers run these methods in worker threads, off the
event loop). A writer waits at most ``busy_timeout`` seconds for another process's write lock,
then gets :class:`Busy` (EBUSY); any other database failure is a :class:`MetadataError` (EIO).
Both are logged once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from irdma._errors import (
    Busy,
    DataLost,
    Exists,
    InvalidArgument,
    IrdmaError,
    IsADirectory,
    MetadataError,
    NameTooLong,
    NoAttribute,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    Stale,
)
from irdma.placement import DEFAULT_CHUNK_SIZE, MOVE_ALL, Move, check_chunk_size
from irdma.protocol import UpdateOp

from .base import (
    IO_MODES,
    NAME_MAX,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    SESSION_EXPIRY_S,
    SYMLINK_MAX,
    UNLINK_GRACE_S,
    XATTR_CHUNK_SIZE,
    XATTR_IO,
    XATTR_UPDATE,
    DamagedFile,
    Inode,
    MetaStore,
    Session,
    ShardRecord,
    setid_bits,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes(
    ino INTEGER PRIMARY KEY AUTOINCREMENT, mode INTEGER NOT NULL, uid INTEGER NOT NULL,
    gid INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0, nlink INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    chunk_size INTEGER, stripe TEXT NOT NULL DEFAULT '', update_op TEXT,
    rdev INTEGER NOT NULL DEFAULT 0, target BLOB);
CREATE TABLE IF NOT EXISTS dentries(
    parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
    PRIMARY KEY(parent, name));
CREATE INDEX IF NOT EXISTS dentries_ino ON dentries(ino);
CREATE TABLE IF NOT EXISTS xattrs(
    ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL, PRIMARY KEY(ino, name));
CREATE TABLE IF NOT EXISTS shards(
    id INTEGER PRIMARY KEY, address TEXT NOT NULL UNIQUE, state TEXT NOT NULL,
    added_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS config(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(
    sid INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
    started_ns INTEGER NOT NULL, heartbeat_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS open_files(sid INTEGER NOT NULL, ino INTEGER NOT NULL, PRIMARY KEY(sid, ino));
CREATE INDEX IF NOT EXISTS open_files_ino ON open_files(ino);
CREATE TABLE IF NOT EXISTS moves(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, shard INTEGER NOT NULL, targets TEXT NOT NULL,
    share INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS chunks(
    ino INTEGER NOT NULL, idx INTEGER NOT NULL, shard INTEGER NOT NULL, incarnation INTEGER NOT NULL,
    PRIMARY KEY(ino, idx, shard));
"""
#: Columns added to the shards table since the first schema (added on open where missing).
_SHARD_COLUMNS = {
    "incarnation": "INTEGER NOT NULL DEFAULT 0",
    "health": "TEXT NOT NULL DEFAULT 'unknown'",
    "health_ns": "INTEGER NOT NULL DEFAULT 0",
}
_SHARD_COLS = "id, address, state, added_ns, incarnation, health, health_ns"
#: SQL: chunk-map row ``c`` has another replica on memory its shard still has (not lost).
_ELSEWHERE = ("EXISTS (SELECT 1 FROM chunks d JOIN shards s ON s.id = d.shard WHERE d.ino = c.ino AND d.idx = c.idx"
              " AND d.shard <> c.shard AND d.incarnation = s.incarnation AND s.state <> 'removed')")
#: Columns added to the inodes table since the first schema: the device number of a device
#: node, the target of a symbolic link.
_INODE_COLUMNS = {"rdev": "INTEGER NOT NULL DEFAULT 0", "target": "BLOB",
                  "replicas": "INTEGER NOT NULL DEFAULT 1"}
#: Shard health that takes a shard out of its chains (it missed updates, or may have).
_NOT_CURRENT = ("down", "syncing")
log = logging.getLogger("irdma.meta")
_F = TypeVar("_F", bound=Callable[..., Any])


def _db_errors(fn: _F) -> _F:
    """Turn ``sqlite3.Error`` into Busy (a lock held too long) or MetadataError, logged once."""

    @functools.wraps(fn)
    def wrapper(self: SqliteMeta, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                log.warning("metadata %s: %s held by another process for over %g s", fn.__name__, self.path,
                            self.busy_timeout)
                raise Busy(f"metadata database {self.path} is locked by another process (waited"
                           f" {self.busy_timeout:g} s)", "retry; find the process holding it with `fuser`") from None
            log.error("metadata %s failed on %s: %s", fn.__name__, self.path, exc)
            raise MetadataError(f"metadata database {self.path}: {exc}") from None
        except sqlite3.Error as exc:
            log.error("metadata %s failed on %s: %s", fn.__name__, self.path, exc)
            raise MetadataError(f"metadata database {self.path}: {exc}") from None

    return wrapper  # type: ignore[return-value]

_COLS = "ino, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe, update_op, rdev, replicas"
_VIRTUAL = (XATTR_UPDATE, XATTR_CHUNK_SIZE)


def _now() -> int:
    return time.time_ns()


def _inode(row: tuple) -> Inode:  # type: ignore[type-arg]
    stripe = tuple(int(s) for s in row[10].split(",") if s)
    ino, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size = row[:10]
    return Inode(ino, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe, row[11], row[12],
                 row[13])


class SqliteMeta(MetaStore):
    """The namespace in one SQLite database file.

    Args:
        path: the database file.
        create: create the database (and the root directory) if missing.

    Raises:
        NotFound: ``path`` does not exist and ``create`` is False.
        InvalidArgument: ``path`` is a directory, not an SQLite file, or (unless ``create``) an SQLite
            file without the irdma tables; nothing was written to it.
        IrdmaError: the file cannot be opened or written (permissions, locked, I/O error).
    """

    def __init__(self, path: str, *, create: bool = False, busy_timeout: float = 10.0) -> None:
        hint = "pass the URL `irdma up` printed, such as sqlite:///PATH/meta.db"
        if os.path.isdir(path):
            there = os.path.join(path, "meta.db")
            raise InvalidArgument(
                f"{path} is a directory, not a metadata database",
                f"pass sqlite://{there}" if os.path.isfile(there) else hint,
            )
        if not create and not os.path.exists(path):
            raise NotFound(
                f"no metadata database at {path}",
                "start a cluster with `irdma up` or pass the META URL it printed",
            )
        if create and not os.path.exists(path):
            # private from the start: names, owners and the shard map are nobody else's
            # business (SQLite gives its -wal and -shm files the database's mode)
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self.path = path
        self.url = f"sqlite://{path}"
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self._host = socket.gethostname()
        try:
            self._init_schema(create, hint)
        except BaseException as exc:
            self.close()
            if isinstance(exc, IrdmaError):
                raise
            if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
                raise InvalidArgument(f"{path} is not an irdma metadata database: {exc}", hint) from None
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise Busy(f"the metadata database {path} stayed locked for {busy_timeout:g} s ({exc})",
                           "another process holds a long write transaction on it; retry") from None
            if isinstance(exc, sqlite3.Error):
                raise IrdmaError(f"cannot open the metadata database {path}: {exc}",
                                 "check that the file and its directory are readable and writable") from None
            raise

    @property
    def _db(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        db = getattr(self._local, "db", None)
        if db is None:
            try:
                db = sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_timeout,
                                     check_same_thread=False)
            except sqlite3.Error as exc:
                raise IrdmaError(f"cannot open the metadata database {self.path}: {exc}",
                                 "check that its directory exists and is writable") from None
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            self._local.busy = None
            with self._all_lock:
                self._all.append(db)
        if self._local.busy != self.busy_timeout:
            db.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            self._local.busy = self.busy_timeout
        return db

    def _init_schema(self, create: bool, hint: str) -> None:
        # only our own tables may be created here: never turn someone else's file into a namespace
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not create and "inodes" not in tables:
            raise InvalidArgument(f"{self.path} is not an irdma metadata database: it has no irdma tables", hint)
        self._db.execute("PRAGMA journal_mode=WAL")
        with self._tx() as c:
            pk = [r[1] for r in sorted(c.execute("PRAGMA table_info(chunks)"), key=lambda r: r[5]) if r[5]]
            if pk and "shard" not in pk:  # before replication: one row per chunk, now one per replica
                c.execute("ALTER TABLE chunks RENAME TO chunks_v1")
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    c.execute(stmt)
            if pk and "shard" not in pk:
                c.execute("INSERT INTO chunks SELECT ino, idx, shard, incarnation FROM chunks_v1")
                c.execute("DROP TABLE chunks_v1")
            for table, columns in (("shards", _SHARD_COLUMNS), ("inodes", _INODE_COLUMNS)):
                have = {r[1] for r in c.execute(f"PRAGMA table_info({table})")}
                for col, decl in columns.items():
                    if col not in have:
                        c.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
            if c.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone() is None:
                t = _now()
                c.execute(
                    "INSERT INTO inodes(ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns)"
                    " VALUES (?,?,?,?,2,?,?,?)",
                    (ROOT_INO, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), t, t, t),
                )
                c.execute("INSERT OR IGNORE INTO config VALUES ('epoch', '0')")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")

    def _get(self, c: sqlite3.Cursor | sqlite3.Connection, ino: int) -> Inode:
        row = c.execute(f"SELECT {_COLS} FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None:
            raise NotFound(f"no inode {ino}")
        return _inode(row)

    def _lookup(self, c: sqlite3.Cursor | sqlite3.Connection, parent: int, name: bytes) -> Inode:
        p = self._get(c, parent)
        if not p.is_dir:
            raise NotADirectory(f"inode {parent} is not a directory")
        row = c.execute(
            f"SELECT {', '.join('i.' + x.strip() for x in _COLS.split(','))} FROM dentries d"
            " JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.name=?",
            (parent, name),
        ).fetchone()
        if row is None:
            raise NotFound(f"no entry {name.decode(errors='replace')!r} in directory {parent}")
        return _inode(row)

    # ---------------------------------------------------------------- namespace
    def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes is longer than {NAME_MAX}")
        if name == b".":
            return self.getattr(parent)
        if name == b"..":
            return self.getattr(self.parent_of(parent))
        return self._lookup(self._db, parent, name)

    def getattr(self, ino: int) -> Inode:
        return self._get(self._db, ino)

    def getattr_io(self, ino: int) -> tuple[Inode, bytes]:
        got = self._get_io(self._db, ino)
        if got is None:
            raise NotFound(f"no inode {ino}")
        return got

    def _get_io(self, c: sqlite3.Cursor | sqlite3.Connection, ino: int) -> tuple[Inode, bytes] | None:
        """The inode and its ``user.irdma.io`` mode in one query, or None."""
        row = c.execute(
            f"SELECT {', '.join('i.' + x.strip() for x in _COLS.split(','))}, x.value FROM inodes i"
            " LEFT JOIN xattrs x ON x.ino = i.ino AND x.name = ? WHERE i.ino = ?",
            (XATTR_IO, ino),
        ).fetchone()
        if row is None:
            return None
        return _inode(row[:-1]), bytes(row[-1]) if row[-1] is not None else b"cached"

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
            inode = self._get(c, ino)
            if size is not None:
                if inode.is_dir:
                    raise IsADirectory(f"inode {ino} is a directory")
                if size < 0:
                    raise InvalidArgument(f"negative size {size}")
                inode.size = size
                inode.mtime_ns = _now()
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
            inode.ctime_ns = _now()
            c.execute(
                "UPDATE inodes SET mode=?, uid=?, gid=?, size=?, atime_ns=?, mtime_ns=?, ctime_ns=? WHERE ino=?",
                (inode.mode, inode.uid, inode.gid, inode.size, inode.atime_ns, inode.mtime_ns, inode.ctime_ns, ino),
            )
            return inode

    def extend(self, ino: int, end: int, mtime_ns: int, chunks: tuple[tuple[int, int, int], ...] = ()) -> Inode:
        with self._tx() as c:
            c.execute(
                "UPDATE inodes SET size=MAX(size, ?), mtime_ns=?, ctime_ns=? WHERE ino=?", (end, mtime_ns, mtime_ns, ino)
            )
            if chunks:
                c.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?)", [(ino, i, s, n) for i, s, n in chunks])
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
            return self._insert(c, parent, name, mode, uid, gid, chunk_size=chunk_size)

    def mknod(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0) -> Inode:
        if stat.S_IFMT(mode) not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise InvalidArgument(f"mknod makes FIFOs, sockets and device nodes, not file type {stat.S_IFMT(mode):o}")
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        with self._tx() as c:
            return self._insert(c, parent, name, mode, uid, gid, rdev=rdev)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if not target or b"\0" in target:
            raise InvalidArgument(f"invalid symbolic link target {target[:64]!r}")
        if len(target) > SYMLINK_MAX:
            raise NameTooLong(f"symbolic link target of {len(target)} bytes is longer than {SYMLINK_MAX}")
        with self._tx() as c:
            return self._insert(c, parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def _insert(
        self, c: sqlite3.Cursor, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
        chunk_size: int | None = None, rdev: int = 0, target: bytes | None = None,
    ) -> Inode:
        """A new inode of any type named ``name`` in ``parent``; only regular files get a
        stripe, a chunk size and an update op."""
        _check_name(name)
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
        t = _now()
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
        c.execute(
            "INSERT INTO inodes(mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe,"
            " update_op, replicas, size, rdev, target) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (*values, len(target) if target is not None else 0, rdev, target),
        )
        ino = c.execute("SELECT last_insert_rowid()").fetchone()[0]
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
        _check_name(name)
        with self._tx() as c:
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
            t = _now()
            c.execute("INSERT INTO dentries VALUES (?,?,?)", (parent, name, ino))
            c.execute("UPDATE inodes SET nlink=nlink+1, ctime_ns=? WHERE ino=?", (t, ino))
            c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))
            return self._get(c, ino)

    def clear_setid(self, ino: int) -> Inode:
        with self._tx() as c:
            inode = self._get(c, ino)
            bits = setid_bits(inode.mode)
            if bits:
                inode.mode &= ~bits
                inode.ctime_ns = _now()
                c.execute("UPDATE inodes SET mode=?, ctime_ns=? WHERE ino=?", (inode.mode, inode.ctime_ns, ino))
            return inode

    def readdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        if not self.getattr(ino).is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        rows = self._db.execute(
            f"SELECT d.name, {', '.join('i.' + x.strip() for x in _COLS.split(','))} FROM dentries d"
            " JOIN inodes i ON i.ino = d.ino WHERE d.parent=? ORDER BY d.name",
            (ino,),
        ).fetchall()
        return [(bytes(r[0]), _inode(r[1:])) for r in rows]

    def unlink(self, parent: int, name: bytes) -> Inode:
        with self._tx() as c:
            inode = self._lookup(c, parent, name)
            if inode.is_dir:
                raise IsADirectory(f"{name.decode(errors='replace')!r} is a directory: use rmdir")
            self._drop_name(c, parent, name, inode)
            return inode

    def _drop_name(self, c: sqlite3.Cursor, parent: int, name: bytes, inode: Inode) -> None:
        t = _now()
        c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
        inode.nlink -= 1
        c.execute("UPDATE inodes SET nlink=?, ctime_ns=? WHERE ino=?", (inode.nlink, t, inode.ino))
        c.execute("UPDATE inodes SET mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))

    def rmdir(self, parent: int, name: bytes) -> None:
        with self._tx() as c:
            inode = self._lookup(c, parent, name)
            if not inode.is_dir:
                raise NotADirectory(f"{name.decode(errors='replace')!r} is not a directory")
            if c.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (inode.ino,)).fetchone():
                raise NotEmpty(f"directory {name.decode(errors='replace')!r} is not empty")
            c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
            c.execute("DELETE FROM inodes WHERE ino=?", (inode.ino,))
            c.execute("DELETE FROM xattrs WHERE ino=?", (inode.ino,))
            t = _now()
            c.execute("UPDATE inodes SET nlink=nlink-1, mtime_ns=?, ctime_ns=? WHERE ino=?", (t, t, parent))

    def rename(
        self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int = 0
    ) -> Inode | None:
        _check_name(name_old)
        _check_name(name_new)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise InvalidArgument(f"unsupported rename flags {flags:#x}")
        if flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_NOREPLACE and RENAME_EXCHANGE exclude each other")
        with self._tx() as c:
            src = self._lookup(c, parent_old, name_old)
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
                    if c.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (dst.ino,)).fetchone():
                        raise NotEmpty(f"directory {name_new.decode(errors='replace')!r} is not empty")
                    c.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent_new, name_new))
                    c.execute("DELETE FROM inodes WHERE ino=?", (dst.ino,))
                    c.execute("DELETE FROM xattrs WHERE ino=?", (dst.ino,))
                    c.execute("UPDATE inodes SET nlink=nlink-1 WHERE ino=?", (parent_new,))
                    dst = None
                else:
                    self._drop_name(c, parent_new, name_new, dst)
            t = _now()
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

    def _check_not_under(self, c: sqlite3.Cursor, dir_ino: int, parent: int) -> None:
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
        self, c: sqlite3.Cursor, parent_a: int, name_a: bytes, a: Inode, parent_b: int, name_b: bytes, b: Inode
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
        t = _now()
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
            inode = self._get(c, ino)
            if name == XATTR_UPDATE:
                try:
                    op = UpdateOp.parse(value).name.lower()
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
                c.execute("UPDATE inodes SET update_op=?, ctime_ns=? WHERE ino=?", (op, _now(), ino))
            elif name == XATTR_CHUNK_SIZE:
                try:
                    size = check_chunk_size(int(value.decode("ascii", "replace").strip() or "x"))
                except ValueError as exc:
                    raise InvalidArgument(f"bad {XATTR_CHUNK_SIZE.decode()} {value!r}: {exc}") from None
                if not inode.is_dir and inode.size:
                    raise Busy("the chunk size of a file can change only while it is empty")
                c.execute("UPDATE inodes SET chunk_size=?, ctime_ns=? WHERE ino=?", (size, _now(), ino))
            else:
                if name == XATTR_IO and value.strip() not in IO_MODES:
                    raise InvalidArgument(f"bad {XATTR_IO.decode()} {value!r}: use cached or direct")
                c.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (ino, name, value.strip() if name == XATTR_IO else value))
                c.execute("UPDATE inodes SET ctime_ns=? WHERE ino=?", (_now(), ino))

    def listxattr(self, ino: int) -> list[bytes]:
        inode = self.getattr(ino)
        names = [n for n, v in ((XATTR_UPDATE, inode.update_op), (XATTR_CHUNK_SIZE, inode.chunk_size)) if v]
        names += [bytes(r[0]) for r in self._db.execute("SELECT name FROM xattrs WHERE ino=? ORDER BY name", (ino,))]
        return names

    def removexattr(self, ino: int, name: bytes) -> None:
        with self._tx() as c:
            inode = self._get(c, ino)
            if name in _VIRTUAL:
                if not inode.is_dir:
                    raise InvalidArgument(f"{name.decode()} of a file cannot be removed, only set")
                col = "update_op" if name == XATTR_UPDATE else "chunk_size"
                c.execute(f"UPDATE inodes SET {col}=NULL WHERE ino=?", (ino,))
                return
            if c.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount == 0:
                raise NoAttribute(f"no attribute {name.decode(errors='replace')} on inode {ino}")

    # ---------------------------------------------------------------- whole namespace
    def usage(self) -> tuple[int, int]:
        n, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM inodes").fetchone()
        return int(n), int(size)

    def orphans(self) -> list[Inode]:
        return [_inode(r) for r in self._db.execute(f"SELECT {_COLS} FROM inodes WHERE nlink<=0")]

    # ---------------------------------------------------------------- shard map
    def add_shard(self, address: str) -> ShardRecord:
        with self._tx() as c:
            if c.execute("SELECT 1 FROM shards WHERE address=?", (address,)).fetchone():
                raise Exists(f"a shard at {address} is already registered")
            t = _now()
            c.execute("INSERT INTO shards(address, state, added_ns) VALUES (?, 'up', ?)", (address, t))
            sid = c.execute("SELECT last_insert_rowid()").fetchone()[0]
            c.execute("UPDATE config SET value=CAST(value AS INTEGER)+1 WHERE key='epoch'")
            return ShardRecord(int(sid), address, "up", t)

    def shards(self) -> list[ShardRecord]:
        return [_shard(r) for r in self._db.execute(f"SELECT {_SHARD_COLS} FROM shards ORDER BY id")]

    def epoch(self) -> int:
        return self._epoch(self._db)

    def close(self) -> None:
        with self._all_lock:
            dbs, self._all = self._all, []
        for db in dbs:
            db.close()
        self._local = threading.local()

    # ---------------------------------------------------------------- shard health and memory
    def note_incarnation(self, shard_id: int, incarnation: int) -> int:
        with self._tx() as c:
            row = c.execute("SELECT incarnation FROM shards WHERE id=?", (shard_id,)).fetchone()
            if row is None:
                raise NotFound(f"shard {shard_id} is not in the shard map")
            if int(row[0]) != incarnation:
                c.execute("UPDATE shards SET incarnation=? WHERE id=?", (incarnation, shard_id))
                if int(row[0]):  # it lost its memory: out of its chains until resynced
                    c.execute("UPDATE shards SET health='syncing', health_ns=? WHERE id=?", (_now(), shard_id))
                    self._bump_epoch(c)
            return int(row[0])

    def set_shard_health(self, shard_id: int, health: str) -> tuple[str, int]:
        with self._tx() as c:
            row = c.execute("SELECT health FROM shards WHERE id=?", (shard_id,)).fetchone()
            if row is None:
                raise NotFound(f"shard {shard_id} is not in the shard map")
            old = row[0]
            if health == "up" and old in _NOT_CURRENT:
                health = "syncing"  # it may have missed updates: a resync brings it back
            if health != old:
                c.execute("UPDATE shards SET health=?, health_ns=? WHERE id=?", (health, _now(), shard_id))
                if health in _NOT_CURRENT or old in _NOT_CURRENT:  # chains change: a new view
                    self._bump_epoch(c)
            return health, self._epoch(c)

    def mark_synced(self, shard_id: int, epoch: int) -> bool:
        with self._tx() as c:
            if self._epoch(c) != epoch:
                return False  # something changed since the resync began: resync again
            c.execute("UPDATE shards SET health='up', health_ns=? WHERE id=? AND health='syncing'", (_now(), shard_id))
            self._bump_epoch(c)
            return True

    @staticmethod
    def _bump_epoch(c: sqlite3.Cursor) -> None:
        c.execute("UPDATE config SET value=CAST(value AS INTEGER)+1 WHERE key='epoch'")

    @staticmethod
    def _epoch(c: sqlite3.Cursor | sqlite3.Connection) -> int:
        return int(c.execute("SELECT value FROM config WHERE key='epoch'").fetchone()[0])

    def shard_view(self) -> tuple[int, list[ShardRecord], list[Move]]:
        with self._tx() as c:
            return (self._epoch(c), [_shard(r) for r in c.execute(f"SELECT {_SHARD_COLS} FROM shards ORDER BY id")],
                    self._moves(c))

    @staticmethod
    def _moves(c: sqlite3.Cursor) -> list[Move]:
        return [Move(int(q), int(sh), tuple(int(t) for t in str(ts).split(",") if t), bool(d), int(share))
                for q, sh, ts, share, d in c.execute("SELECT seq, shard, targets, share, done FROM moves ORDER BY seq")]

    # ---------------------------------------------------------------- replication
    @staticmethod
    def _replicas(c: sqlite3.Cursor | sqlite3.Connection) -> int:
        row = c.execute("SELECT value FROM config WHERE key='replicas'").fetchone()
        return int(row[0]) if row else 1

    def replicas(self) -> int:
        return self._replicas(self._db)

    def set_replicas(self, replicas: int) -> None:
        if not 1 <= replicas <= 8:
            raise InvalidArgument(f"replicas must be 1 to 8, not {replicas}")
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO config VALUES ('replicas', ?)", (str(replicas),))

    def note_replica(self, ino: int, idx: int, shard_id: int, incarnation: int) -> None:
        with self._tx() as c:
            if c.execute("SELECT 1 FROM chunks WHERE ino=? AND idx=?", (ino, idx)).fetchone():  # still written
                c.execute("INSERT OR REPLACE INTO chunks VALUES (?,?,?,?)", (ino, idx, shard_id, incarnation))

    def replicated_chunks(self, shard_ids: Sequence[int], min_replicas: int = 2) -> list[tuple[Inode, list[int]]]:
        if not shard_ids:
            return []
        like = " OR ".join(["(',' || stripe || ',') LIKE ?"] * len(shard_ids))
        rows = self._db.execute(
            f"SELECT {_COLS} FROM inodes WHERE replicas >= ? AND chunk_size IS NOT NULL AND ({like}) ORDER BY ino",
            (min_replicas, *(f"%,{s},%" for s in shard_ids))).fetchall()
        out = []
        for row in rows:
            idx = [int(r[0]) for r in
                   self._db.execute("SELECT DISTINCT idx FROM chunks WHERE ino=? ORDER BY idx", (row[0],))]
            out.append((_inode(row), idx))
        return out

    def under_replicated(self) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM (SELECT c.ino, c.idx, i.replicas r,"
            f" SUM(c.incarnation = s.incarnation AND s.health NOT IN {_NOT_CURRENT!r}) good"
            " FROM chunks c JOIN shards s ON s.id = c.shard JOIN inodes i ON i.ino = c.ino"
            " GROUP BY c.ino, c.idx) WHERE good > 0 AND good < r").fetchone()
        return int(row[0])

    # ---------------------------------------------------------------- live shard operations
    def drain_shard(self, shard_id: int) -> int:
        with self._tx() as c:
            rec = self._shard_row(c, shard_id)
            if rec.state == "draining":
                return self._epoch(c)
            if rec.state != "up":
                raise InvalidArgument(f"shard {shard_id} is {rec.state}: only a shard in service can be drained")
            self._no_move_in_progress(c)
            targets = [int(r[0]) for r in c.execute("SELECT id FROM shards WHERE state='up' AND id<>? ORDER BY id",
                                                    (shard_id,))]
            if not targets:
                raise InvalidArgument(f"shard {shard_id} is the only shard in service: its chunks have nowhere to go",
                                      "add a shard first (`irdma shard add`)")
            c.execute("INSERT INTO moves(shard, targets, share) VALUES (?,?,?)",
                      (shard_id, ",".join(map(str, targets)), MOVE_ALL))
            c.execute("UPDATE shards SET state='draining' WHERE id=?", (shard_id,))
            self._bump_epoch(c)
            return self._epoch(c)

    def begin_move(self, shard_id: int, targets: Sequence[int], share: int) -> int:
        with self._tx() as c:
            self._no_move_in_progress(c)
            for sid in (shard_id, *targets):
                if self._shard_row(c, sid).state != "up":
                    raise InvalidArgument(f"shard {sid} is not in service")
            if not targets or shard_id in targets or not 0 < share <= MOVE_ALL:
                raise InvalidArgument(f"bad move of {share}/{MOVE_ALL} of shard {shard_id} to {list(targets)}")
            c.execute("INSERT INTO moves(shard, targets, share) VALUES (?,?,?)",
                      (shard_id, ",".join(map(str, targets)), share))
            self._bump_epoch(c)
            return self._epoch(c)

    def cancel_move(self, seq: int) -> None:
        with self._tx() as c:
            self._cancel(c, seq)

    def _cancel(self, c: sqlite3.Cursor, seq: int) -> None:
        row = c.execute("SELECT shard FROM moves WHERE seq=? AND done=0", (seq,)).fetchone()
        if row is None:
            return
        c.execute("DELETE FROM moves WHERE seq=?", (seq,))
        c.execute("UPDATE shards SET state='up' WHERE id=? AND state='draining'", (int(row[0]),))
        self._bump_epoch(c)

    @staticmethod
    def _no_move_in_progress(c: sqlite3.Cursor) -> None:
        row = c.execute("SELECT seq, shard FROM moves WHERE done=0").fetchone()
        if row:
            raise InvalidArgument(f"chunks of shard {row[1]} are moving (move {row[0]}): one move at a time",
                                  f"finish it first (`irdma shard drain {row[1]}` or `irdma rebalance`)")

    def finish_move(self, seq: int, epoch: int, moved: Sequence[tuple[int, int]] = ()) -> bool:
        with self._tx() as c:
            row = c.execute("SELECT shard FROM moves WHERE seq=? AND done=0", (seq,)).fetchone()
            if row is None or self._epoch(c) != epoch:
                return False
            shard_id = int(row[0])
            if self._shard_row(c, shard_id).state == "draining":
                alone = c.execute(f"SELECT ino, idx FROM chunks c WHERE shard=? AND NOT {_ELSEWHERE} LIMIT 5",
                                  (shard_id,)).fetchall()
                if alone:
                    raise DataLost(f"shard {shard_id} holds the only recorded copy of chunks {alone}: not drained",
                                   f"run `irdma shard drain {shard_id}` again")
                c.execute("DELETE FROM chunks WHERE shard=?", (shard_id,))
                c.execute("UPDATE shards SET state='drained' WHERE id=?", (shard_id,))
            else:
                c.executemany(f"DELETE FROM chunks AS c WHERE ino=? AND idx=? AND shard=? AND {_ELSEWHERE}",
                              [(ino, idx, shard_id) for ino, idx in moved])
            c.execute("UPDATE moves SET done=1 WHERE seq=?", (seq,))
            self._bump_epoch(c)
            return True

    def remove_shard(self, shard_id: int, force: bool = False) -> list[tuple[int, int]]:
        with self._tx() as c:
            rec = self._shard_row(c, shard_id)
            if rec.state == "removed":
                raise InvalidArgument(f"shard {shard_id} was removed already")
            if rec.state != "drained" and not force:
                raise InvalidArgument(f"shard {shard_id} is {rec.state}, not drained: removing it would lose"
                                      " the chunks it holds",
                                      f"drain it first (`irdma shard drain {shard_id}`), or pass --force to"
                                      " declare its chunks lost")
            lost = [(int(i), int(x)) for i, x in c.execute(
                f"SELECT ino, idx FROM chunks c WHERE shard=? AND NOT {_ELSEWHERE} ORDER BY ino, idx", (shard_id,))]
            if rec.state != "drained":  # it leaves its chains now: a move of all its chunks, done
                # a move in progress to or from it cannot finish now: cancelled
                for seq, targets in c.execute("SELECT seq, targets FROM moves WHERE done=0").fetchall():
                    if str(shard_id) in str(targets).split(","):
                        self._cancel(c, int(seq))
                c.execute("DELETE FROM moves WHERE shard=? AND done=0", (shard_id,))
                targets = [int(r[0]) for r in c.execute(
                    "SELECT id FROM shards WHERE state='up' AND id<>? ORDER BY id", (shard_id,))]
                c.execute("INSERT INTO moves(shard, targets, share, done) VALUES (?,?,?,1)",
                          (shard_id, ",".join(map(str, targets)), MOVE_ALL))
            # replicas held elsewhere stay readable there; a chunk it alone held stays recorded on
            # it with an incarnation no memory has (-1), so it reads as lost, never as zeros
            c.execute(f"DELETE FROM chunks AS c WHERE shard=? AND {_ELSEWHERE}", (shard_id,))
            c.execute("UPDATE chunks SET incarnation=-1 WHERE shard=?", (shard_id,))
            c.execute("UPDATE shards SET state='removed', health='down', address=?, incarnation=0 WHERE id=?",
                      (f"removed-{shard_id}:{rec.address}", shard_id))
            self._bump_epoch(c)
            return lost

    @staticmethod
    def _shard_row(c: sqlite3.Cursor, shard_id: int) -> ShardRecord:
        row = c.execute(f"SELECT {_SHARD_COLS} FROM shards WHERE id=?", (shard_id,)).fetchone()
        if row is None:
            raise NotFound(f"shard {shard_id} is not in the shard map", "`irdma shard list` shows the shards")
        return _shard(row)

    # ---------------------------------------------------------------- chunk map
    def chunk_map(self, ino: int) -> dict[int, dict[int, int]]:
        return self._chunk_map(self._db, ino)

    @staticmethod
    def _chunk_map(c: sqlite3.Cursor | sqlite3.Connection, ino: int) -> dict[int, dict[int, int]]:
        out: dict[int, dict[int, int]] = {}
        for i, s, n in c.execute("SELECT idx, shard, incarnation FROM chunks WHERE ino=?", (ino,)):
            out.setdefault(int(i), {})[int(s)] = int(n)
        return out

    def damaged(self) -> list[DamagedFile]:
        # lost: no replica of the chunk is on the memory it was written to
        rows = self._db.execute(
            "SELECT c.ino, c.idx, MIN(c.shard) FROM chunks c JOIN shards s ON s.id = c.shard"
            " GROUP BY c.ino, c.idx HAVING SUM(c.incarnation = s.incarnation) = 0 ORDER BY c.ino, c.idx"
        ).fetchall()
        out: dict[int, DamagedFile] = {}
        for ino, idx, shard in rows:
            d = out.get(ino)
            if d is None:
                d = out[ino] = DamagedFile(int(ino), self.path_of(int(ino)), [], [])
            d.lost_chunks.append(int(idx))
            if shard not in d.shards:
                d.shards.append(int(shard))
        return list(out.values())

    # ---------------------------------------------------------------- sessions and open files
    def open_session(self, name: str) -> int:
        t = _now()
        with self._tx() as c:
            c.execute("INSERT INTO sessions(name, host, pid, started_ns, heartbeat_ns) VALUES (?,?,?,?,?)",
                      (name, self._host, os.getpid(), t, t))
            return int(c.execute("SELECT last_insert_rowid()").fetchone()[0])

    def heartbeat(self, sid: int) -> None:
        with self._tx() as c:
            if c.execute("UPDATE sessions SET heartbeat_ns=? WHERE sid=?", (_now(), sid)).rowcount == 0:
                raise NotFound(f"session {sid} was reaped (it missed its heartbeats)")

    def close_session(self, sid: int) -> None:
        self.reap_session(sid)

    def reap_session(self, sid: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM open_files WHERE sid=?", (sid,))
            c.execute("DELETE FROM sessions WHERE sid=?", (sid,))

    def sessions(self) -> list[Session]:
        return [Session(*r) for r in self._db.execute(
            "SELECT sid, name, host, pid, started_ns, heartbeat_ns FROM sessions ORDER BY sid")]

    def dead_sessions(self) -> list[Session]:
        from irdma._proc import pid_alive

        limit = _live_since()
        return [s for s in self.sessions()
                if s.heartbeat_ns < limit or (s.host == self._host and not pid_alive(s.pid))]

    def _live_openers(self, c: sqlite3.Cursor, ino: int, exclude: int = 0) -> int:
        limit = _live_since()
        return int(c.execute(
            "SELECT COUNT(*) FROM open_files o JOIN sessions s ON s.sid = o.sid"
            " WHERE o.ino=? AND o.sid<>? AND s.heartbeat_ns>=?", (ino, exclude, limit)).fetchone()[0])

    def open_inode(self, sid: int, ino: int) -> tuple[Inode, bytes, dict[int, dict[int, int]]]:
        with self._tx() as c:
            got = self._get_io(c, ino)
            if got is None:
                raise Stale(f"inode {ino} was removed")
            inode, io_mode = got
            if (inode.nlink <= 0 and _now() - inode.ctime_ns > UNLINK_GRACE_S * 1e9
                    and not c.execute("SELECT 1 FROM open_files WHERE sid=? AND ino=?", (sid, ino)).fetchone()):
                raise Stale(f"inode {ino} has no name left")
            if sid:
                c.execute("INSERT OR IGNORE INTO open_files VALUES (?,?)", (sid, ino))
            return inode, io_mode, self._chunk_map(c, ino)

    def close_inode(self, sid: int, ino: int) -> tuple[Inode | None, bool]:
        with self._tx() as c:
            c.execute("DELETE FROM open_files WHERE sid=? AND ino=?", (sid, ino))
            try:
                inode = self._get(c, ino)
            except NotFound:
                return None, False
            return inode, self._reclaimable(c, ino) is not None

    def reclaimable(self, ino: int, grace: bool = True) -> Inode | None:
        with self._tx() as c:
            return self._reclaimable(c, ino, grace)

    def _reclaimable(self, c: sqlite3.Cursor, ino: int, grace: bool = True) -> Inode | None:
        try:
            inode = self._get(c, ino)
        except NotFound:
            return None
        if inode.nlink > 0 or (grace and _now() - inode.ctime_ns <= UNLINK_GRACE_S * 1e9) or self._live_openers(c, ino):
            return None
        return inode

    def path_of(self, ino: int) -> str:
        parts: list[str] = []
        cur = ino
        for _ in range(4096):
            if cur == ROOT_INO:
                return "/" + "/".join(reversed(parts))
            row = self._db.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (cur,)).fetchone()
            if row is None:
                return ""
            parts.append(bytes(row[1]).decode(errors="replace"))
            cur = int(row[0])
        return ""

    def file_sizes(self) -> dict[int, tuple[int, int, bool]]:
        limit = _live_since()
        open_now = {int(r[0]) for r in self._db.execute(
            "SELECT DISTINCT o.ino FROM open_files o JOIN sessions s ON s.sid = o.sid WHERE s.heartbeat_ns>=?",
            (limit,))}
        return {int(ino): (int(size), int(cs), ino in open_now) for ino, size, cs in self._db.execute(
            "SELECT ino, size, chunk_size FROM inodes WHERE chunk_size IS NOT NULL AND stripe <> ''")}


for _name in [n for n, v in vars(SqliteMeta).items() if callable(v) and not n.startswith("_")]:
    setattr(SqliteMeta, _name, _db_errors(getattr(SqliteMeta, _name)))


def _shard(row: Sequence[Any]) -> ShardRecord:
    sid, address, state, added_ns, incarnation, health, health_ns = row
    return ShardRecord(int(sid), str(address), str(state), int(added_ns), int(incarnation), str(health),
                       int(health_ns))


def _live_since() -> int:
    """Heartbeats at or after this time (ns) mark a live session."""
    return _now() - int(SESSION_EXPIRY_S * 1e9)


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes is longer than {NAME_MAX}")
    if not name or b"/" in name or name in (b".", b"..") or b"\0" in name:
        raise InvalidArgument(f"invalid file name {name!r}")
