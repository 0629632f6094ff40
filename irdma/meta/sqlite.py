"""The embedded metadata engine: one SQLite file in WAL mode.

Several processes of one host (every mount, the CLI, native clients) open the same file; WAL
lets readers run beside one writer, and every change is one ``BEGIN IMMEDIATE`` transaction,
so a rename is atomic for all of them (https://www.sqlite.org/wal.html). Inode numbers come
from ``AUTOINCREMENT`` and are never reused: they name files on the shards.

Each thread gets its own connection (callers run these methods in worker threads, off the
event loop). A writer waits at most ``busy_timeout`` seconds for another process's write lock,
then gets :class:`Busy` (EBUSY); any other database failure is a :class:`MetadataError` (EIO).
Both are logged once.

The statements and the namespace's rules are :class:`~irdma.meta.sql.SqlMeta`'s; this module
is the dialect: the schema and its upgrades, connections, ``BEGIN IMMEDIATE``, and what an
``sqlite3`` error becomes. SQLite serializes writers itself, so nothing is retried here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import stat
import threading

from irdma._errors import Busy, InvalidArgument, IrdmaError, MetadataError, NotFound

from .base import ROOT_INO
from .sql import SqlMeta, log
from .sql_rows import now
from .sql_sync import SYNC_COLUMNS, SYNC_SCHEMA

SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes(
    ino INTEGER PRIMARY KEY AUTOINCREMENT, mode INTEGER NOT NULL, uid INTEGER NOT NULL,
    gid INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0, nlink INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    chunk_size INTEGER, stripe TEXT NOT NULL DEFAULT '', update_op TEXT,
    rdev INTEGER NOT NULL DEFAULT 0, target BLOB, replicas INTEGER NOT NULL DEFAULT 1,
    snap INTEGER NOT NULL DEFAULT 0, place INTEGER NOT NULL DEFAULT 0);
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
CREATE TABLE IF NOT EXISTS snapshots(
    id INTEGER PRIMARY KEY AUTOINCREMENT, dir INTEGER NOT NULL, name BLOB NOT NULL, root INTEGER NOT NULL DEFAULT 0,
    src INTEGER NOT NULL, created_ns INTEGER NOT NULL, state TEXT NOT NULL, maker_uid INTEGER, UNIQUE(dir, name));
""" + SYNC_SCHEMA
#: Columns added to the shards table since the first schema (added on open where missing).
_SHARD_COLUMNS = {
    "incarnation": "INTEGER NOT NULL DEFAULT 0",
    "health": "TEXT NOT NULL DEFAULT 'unknown'",
    "health_ns": "INTEGER NOT NULL DEFAULT 0",
}
#: Columns added to the inodes table since the first schema: the device number of a device
#: node, the target of a symbolic link.
_INODE_COLUMNS = {"rdev": "INTEGER NOT NULL DEFAULT 0", "target": "BLOB",
                  "replicas": "INTEGER NOT NULL DEFAULT 1", "snap": "INTEGER NOT NULL DEFAULT 0",
                  "place": "INTEGER NOT NULL DEFAULT 0"}
#: Columns added to the moves table since the first schema: the highest inode number when the
#: move was recorded (it applies to files up to it; NULL, a move recorded before: to every file).
_MOVE_COLUMNS = {"last_ino": "INTEGER"}
#: Columns added to the snapshots table since the first schema: the uid of the user who made it
#: through a mount (NULL: root or the operator's tools, or made before: its top directory's owner).
_SNAPSHOT_COLUMNS = {"maker_uid": "INTEGER"}


class SqliteMeta(SqlMeta):
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

    _BEGIN = "BEGIN IMMEDIATE"  # the write lock at once: no upgrade from a read lock to fail later
    _DB_ERROR = sqlite3.Error

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
    def _db(self) -> sqlite3.Connection:  # type: ignore[override]
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

    @property
    def connection(self) -> sqlite3.Connection:
        """This thread's connection (see :attr:`SqlMeta.connection`)."""
        return self._db

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
            for table, columns in (("shards", _SHARD_COLUMNS), ("inodes", _INODE_COLUMNS), ("moves", _MOVE_COLUMNS),
                                   ("snapshots", _SNAPSHOT_COLUMNS), *SYNC_COLUMNS.items()):
                have = {r[1] for r in c.execute(f"PRAGMA table_info({table})")}
                for col, decl in columns.items():
                    if col not in have:
                        c.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
            if c.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone() is None:
                t = now()
                c.execute(
                    "INSERT INTO inodes(ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns)"
                    " VALUES (?,?,?,?,2,?,?,?)",
                    (ROOT_INO, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), t, t, t),
                )
                c.execute("INSERT INTO config VALUES ('epoch', '0') ON CONFLICT DO NOTHING")

    def _failure(self, op: str, exc: Exception, retried: bool) -> IrdmaError:
        """``sqlite3.Error`` becomes Busy (a lock held too long) or MetadataError, logged once."""
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
            log.warning("metadata %s: %s held by another process for over %g s", op, self.path, self.busy_timeout)
            return Busy(f"metadata database {self.path} is locked by another process (waited"
                        f" {self.busy_timeout:g} s)", "retry; find the process holding it with `fuser`")
        log.error("metadata %s failed on %s: %s", op, self.path, exc)
        return MetadataError(f"metadata database {self.path}: {exc}")

    def close(self) -> None:
        with self._all_lock:
            dbs, self._all = self._all, []
        for db in dbs:
            db.close()
        self._local = threading.local()

