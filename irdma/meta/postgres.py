"""The multi-host metadata engine: a PostgreSQL database (13 or later), through psycopg 3.

Mounts on different hosts share one namespace in one database. The statements and rules are
:class:`~irdma.meta.sql.SqlMeta`'s; this module is the dialect and the concurrency policy.

Connections: a :class:`psycopg_pool.ConnectionPool` (1 to 8) per engine, in autocommit mode;
each public call takes one connection for its whole length (callers run calls in worker
threads, :data:`irdma.meta.aio.META_THREADS` per client). Each connection runs with
``lock_timeout = busy_timeout`` (a row lock waited for longer: :class:`Busy`),
``statement_timeout = 6 x busy_timeout`` and ``idle_in_transaction_session_timeout`` likewise
(a client that died inside a transaction cannot keep its locks). Unless the URL sets them,
connections use TCP keepalives (idle 5 s, then 3 probes 2 s apart) and ``tcp_user_timeout``
10 s, so a server that vanished without closing the connection (a host gone, a partition) is
noticed in seconds rather than after TCP's retransmissions (minutes).

Several hosts: a URL may name several servers, in libpq's multi-host syntax
``postgresql://h1:5432,h2:5432,h3:5432/irdma?target_session_attrs=read-write`` (PostgreSQL
documentation, libpq "Connection Strings", "Specifying Multiple Hosts"; psycopg 3 passes it to
libpq): every connection tries the hosts in order and keeps the first that answers and, with
``target_session_attrs=read-write``, accepts writes: the primary of a replicated cluster
(Patroni). :attr:`PostgresMeta.server` names them all (``h1:5432, h2:5432, h3:5432``).

Lost connections (a restart, a failover, a network cut): a call whose connection breaks, or
that cannot get one, runs again on a new connection (so the hosts are tried again and the new
primary is found) after a pause of 50 ms doubling to 1 s, until ``failover_timeout`` seconds
(default 30; the constructor's argument, else ``?failover_timeout=SECONDS`` in the URL, which
is taken out before libpq sees it) after the loss; then :class:`MetadataError` with what to
check. Errors that mean "this connection is gone": an ``OperationalError`` without an SQLSTATE
(libpq lost the socket), class 08 (connection exception), ``admin_shutdown`` 57P01,
``crash_shutdown`` 57P02, ``cannot_connect_now`` 57P03, ``idle_session_timeout`` 57P05,
``idle_in_transaction_session_timeout`` 25P03, and ``read_only_sql_transaction`` 25006 (the
server became a standby: the primary is elsewhere now). While the pool has not shown that it
reconnected, calls wait at most 0.1 s for a pooled connection and otherwise open their own,
so they do not wait for the pool's reconnection backoff (1 s doubling).

Transaction ids (the mechanism is :mod:`irdma.meta.sql`'s): every write transaction inserts its
call's UUID into ``txids(id UUID PRIMARY KEY, at TIMESTAMPTZ DEFAULT now())`` and commits, both
in one simple-query message (``INSERT ...; COMMIT``: no extra round trip). When a COMMIT got no
answer, the call, on a new connection, first makes sure that the old connection's server
process is gone (``pg_stat_activity``, matched by pid and ``backend_start``; if it still runs,
``pg_terminate_backend`` and a wait: a process still running could commit after the lookup),
then looks the id up: present, the call landed; absent, it did not and runs again. After a
failover the old process is on another host and the new primary holds exactly the commits
that were replicated to it (with synchronous replication, every acknowledged one): the lookup
there is the answer. Ids older than :data:`TXID_KEEP_S` (10 min, twice the longest
``failover_timeout`` allowed) are deleted, by each engine at most once a minute, after a commit,
in ``READ COMMITTED`` outside any ``SERIALIZABLE`` transaction (so the scan takes no predicate
locks that would make writers conflict); a BRIN index on ``at`` keeps that delete cheap.

Isolation, per method group:

- **Every write** (create, mknod, symlink, link, unlink, rmdir, rename with
  ``RENAME_NOREPLACE``/``RENAME_EXCHANGE``, setattr, extend, xattrs, delete_inode; the shard
  map, moves, health, incarnations and replication settings; sessions, heartbeats, open and
  close of inodes, reclaimable) is one ``SERIALIZABLE`` transaction: its checks (does the
  target exist, is the directory empty, is the epoch still the one the caller saw) and its
  changes happen as if no other transaction ran beside it. So a rename is atomic across hosts
  (a reader sees the old name or the new, never neither or both), two creates of one name give
  one ``Exists``, link counts never drift, ``finish_move(epoch)``/``mark_synced(epoch)`` are
  compare-and-set on the epoch, and a heartbeat never revives a session another host reaped.
  A transaction that PostgreSQL aborts (``serialization_failure`` 40001, ``deadlock_detected``
  40P01, or a ``unique_violation`` 23505 a concurrent insert caused) changed nothing: the whole
  call runs again after a jittered backoff (2 ms doubling to 200 ms) until ``busy_timeout``
  has passed since it began, then :class:`Busy` (EBUSY), as SQLite's ``busy_timeout`` does.
- **Single-statement reads** (lookup, getattr, getattr_io, readdir, readlink, getxattr,
  listxattr, parent_of, path_of, shards, epoch, replicas, chunk_map, sessions, usage, orphans,
  damaged, under_replicated, file_sizes, replicated_chunks) run in autocommit, each statement
  ``READ COMMITTED``: it sees every transaction committed before it began, never a half-done
  one. Several statements of one read (readdir's check then its list) may see different
  commits, exactly as on SQLite outside a transaction; a read that needs one snapshot uses a
  transaction: ``shard_view`` (epoch, shard map and moves read together) and ``open_inode``
  (the inode, its I/O mode, its chunk map and the open record) are ``SERIALIZABLE``.
- **Inode, session, shard and move ids** come from identity columns (sequences): never reused,
  also when a transaction that took one rolls back (numbers are skipped, never handed out twice).
  The root is inode 1; the inodes' sequence starts at 2.
- **Sessions**: ``host`` is ``socket.gethostname()``; a session of another host is dead only
  after :data:`~irdma.meta.base.SESSION_EXPIRY_S` without a heartbeat, one of this host also
  when its process is gone (as on SQLite).

Errors: :class:`Busy` as above, ``lock_not_available`` (55P03) and ``query_canceled`` (57014);
a server lost for longer than ``failover_timeout`` and any other ``psycopg.Error`` are a
:class:`MetadataError` (EIO), logged once. The password of the URL never appears in a message,
a log line, ``repr`` or :attr:`PostgresMeta.url` (``***``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import stat
import threading
import time
import uuid
import weakref
from typing import Any

import psycopg
import psycopg.errors
from psycopg_pool import ConnectionPool, PoolTimeout

from irdma._errors import Busy, InvalidArgument, IrdmaError, MetadataError

from .base import ROOT_INO
from .sql import FAILOVER_TIMEOUT_S, SqlMeta, log
from .sql_rows import Result, now, redact
from .sql_sync import SYNC_COLUMNS, SYNC_SCHEMA

#: The schema (what SQLite's is, in PostgreSQL's types: BIGINT, BYTEA, identity columns).
SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes(
    ino BIGINT GENERATED ALWAYS AS IDENTITY (START WITH 2) PRIMARY KEY, mode BIGINT NOT NULL,
    uid BIGINT NOT NULL, gid BIGINT NOT NULL, size BIGINT NOT NULL DEFAULT 0, nlink BIGINT NOT NULL,
    atime_ns BIGINT NOT NULL, mtime_ns BIGINT NOT NULL, ctime_ns BIGINT NOT NULL,
    chunk_size BIGINT, stripe TEXT NOT NULL DEFAULT '', update_op TEXT,
    rdev BIGINT NOT NULL DEFAULT 0, target BYTEA, replicas BIGINT NOT NULL DEFAULT 1,
    snap BIGINT NOT NULL DEFAULT 0, place BIGINT NOT NULL DEFAULT 0);
ALTER TABLE inodes ADD COLUMN IF NOT EXISTS snap BIGINT NOT NULL DEFAULT 0;
ALTER TABLE inodes ADD COLUMN IF NOT EXISTS place BIGINT NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS dentries(
    parent BIGINT NOT NULL, name BYTEA NOT NULL, ino BIGINT NOT NULL, PRIMARY KEY(parent, name));
CREATE INDEX IF NOT EXISTS dentries_ino ON dentries(ino);
CREATE TABLE IF NOT EXISTS xattrs(
    ino BIGINT NOT NULL, name BYTEA NOT NULL, value BYTEA NOT NULL, PRIMARY KEY(ino, name));
CREATE TABLE IF NOT EXISTS shards(
    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, address TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL, added_ns BIGINT NOT NULL, incarnation BIGINT NOT NULL DEFAULT 0,
    health TEXT NOT NULL DEFAULT 'unknown', health_ns BIGINT NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS config(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(
    sid BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name TEXT NOT NULL, host TEXT NOT NULL,
    pid BIGINT NOT NULL, started_ns BIGINT NOT NULL, heartbeat_ns BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS open_files(sid BIGINT NOT NULL, ino BIGINT NOT NULL, PRIMARY KEY(sid, ino));
CREATE INDEX IF NOT EXISTS open_files_ino ON open_files(ino);
CREATE TABLE IF NOT EXISTS moves(
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, shard BIGINT NOT NULL, targets TEXT NOT NULL,
    share BIGINT NOT NULL, done BIGINT NOT NULL DEFAULT 0, last_ino BIGINT);
ALTER TABLE moves ADD COLUMN IF NOT EXISTS last_ino BIGINT;
CREATE TABLE IF NOT EXISTS chunks(
    ino BIGINT NOT NULL, idx BIGINT NOT NULL, shard BIGINT NOT NULL, incarnation BIGINT NOT NULL,
    PRIMARY KEY(ino, idx, shard));
CREATE TABLE IF NOT EXISTS snapshots(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, dir BIGINT NOT NULL, name BYTEA NOT NULL,
    root BIGINT NOT NULL DEFAULT 0, src BIGINT NOT NULL, created_ns BIGINT NOT NULL, state TEXT NOT NULL,
    maker_uid BIGINT, UNIQUE(dir, name));
ALTER TABLE snapshots ADD COLUMN IF NOT EXISTS maker_uid BIGINT;
CREATE TABLE IF NOT EXISTS txids(id UUID PRIMARY KEY, at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS txids_at ON txids USING brin(at);
""" + SYNC_SCHEMA + "".join(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {col} {decl};\n"
                            for table, columns in SYNC_COLUMNS.items() for col, decl in columns.items())
#: Serializes schema creation of several processes formatting one database at once.
_SCHEMA_LOCK = 0x1D3A_0001
#: SQLSTATEs after which the whole call runs again: nothing it did was committed.
_RETRY = {"40001", "40P01"}
#: A unique violation under SERIALIZABLE is a concurrent insert of the same key: run again at
#: most this many times (the call's own check then answers Exists), then it is an error.
_UNIQUE_RETRIES = 3
#: SQLSTATEs of a lock or statement waited for too long.
_BUSY = {"55P03", "57014"}
#: SQLSTATEs after which the connection is gone (see the module docstring); also class 08.
_LOST = {"57P01", "57P02", "57P03", "57P05", "25P03", "25006"}
SCHEMES = ("postgresql://", "postgres://")
FORMAT_HINT = "make a namespace there first with `irdma format URL`"
#: The URL query parameter of the failover deadline (taken out before libpq sees the URL).
FAILOVER_PARAM = "failover_timeout"
#: Seconds a transaction id is kept: a call settles a lost commit within its failover_timeout.
TXID_KEEP_S = 600
#: The longest failover_timeout (half of TXID_KEEP_S: another engine's pruning never removes an
#: id a call still needs).
FAILOVER_MAX_S = TXID_KEEP_S / 2
#: Seconds between one engine's deletions of old transaction ids.
TXID_PRUNE_EVERY_S = 60.0
#: Seconds a call waits for a pooled connection while the pool has not shown it reconnected.
_DEGRADED_GETCONN_S = 0.1
#: Seconds one host of a multi-host URL gets to answer a new connection (unless the URL sets
#: connect_timeout): a dead host is skipped after this.
MULTI_HOST_CONNECT_S = 3.0
#: libpq settings that bound how long a vanished server goes unnoticed (unless the URL sets them).
_TCP_DEFAULTS = {"keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "2", "keepalives_count": "3",
                 "tcp_user_timeout": "10000"}


def server_of(url: str) -> str:
    """The ``host:port`` (or socket directory) a URL connects to, as libpq resolves it (no
    I/O); several, comma-separated, in the order libpq tries them, for a multi-host URL."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "?"
    hosts = str(info.get("host") or os.environ.get("PGHOST") or "localhost").split(",")
    ports = str(info.get("port") or os.environ.get("PGPORT") or "5432").split(",")
    if len(ports) == 1:  # libpq: one port for every host, or one port per host
        ports *= len(hosts)
    shown = []
    for host, port in zip(hosts, ports, strict=False):
        host, port = host or "localhost", port or "5432"
        shown.append(f"{host}:{port}" if not host.startswith("/") else f"{host} (unix socket, port {port})")
    return ", ".join(shown)


def split_failover(url: str) -> tuple[str, float | None]:
    """``url`` without its ``failover_timeout`` query parameter, and that parameter's value
    (None when absent). No I/O.

    Raises:
        InvalidArgument: the value is not a number of seconds in (0, :data:`FAILOVER_MAX_S`].
    """
    base, mark, query = url.partition("?")
    if not mark or FAILOVER_PARAM + "=" not in query:
        return url, None
    keep, value = [], None
    for part in query.split("&"):
        if part.startswith(FAILOVER_PARAM + "="):
            value = part[len(FAILOVER_PARAM) + 1:]
        elif part:
            keep.append(part)
    return (base + "?" + "&".join(keep) if keep else base), check_failover_timeout(value)


def check_failover_timeout(value: object) -> float:
    """``value`` as seconds of a failover deadline.

    Raises:
        InvalidArgument: not a number in (0, :data:`FAILOVER_MAX_S`].
    """
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds <= FAILOVER_MAX_S:
        raise InvalidArgument(f"bad {FAILOVER_PARAM} {value!r}: seconds, more than 0 and at most {FAILOVER_MAX_S:g}",
                              f"write it in the URL as ?{FAILOVER_PARAM}=30")
    return seconds


class _Cursor:
    """A psycopg cursor that takes the engine's ``?`` placeholders."""

    __slots__ = ("_cur",)

    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self._cur = cur

    def execute(self, sql: str, params: Any = ()) -> Result:
        return self._cur.execute(_q(sql), params or None)  # type: ignore[return-value]

    def executemany(self, sql: str, params: Any) -> None:
        self._cur.executemany(_q(sql), params)


_QUERIES: dict[str, str] = {}


def _q(sql: str) -> str:
    """``sql`` with ``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled)."""
    q = _QUERIES.get(sql)
    if q is None:
        q = _QUERIES[sql] = sql.replace("%", "%%").replace("?", "%s")
    return q


class PostgresMeta(SqlMeta):
    """The namespace in a PostgreSQL database.

    Args:
        url: ``postgresql://[user[:password]@][host][:port][,host[:port]...]/dbname[?param=value...]``
            (also ``postgres://``; ``?host=/socket/dir`` for a unix socket; several hosts: libpq
            tries them in order, ``?target_session_attrs=read-write`` keeps the primary).
            Whatever the URL leaves out comes from libpq's usual places: ``PGPASSWORD``,
            ``~/.pgpass``, ``PGSSLMODE``, ... ``?failover_timeout=SECONDS`` is irdma's, not
            libpq's: see ``failover_timeout``.
        create: make the schema and the root directory if the database has no irdma tables.
        busy_timeout: seconds a call may wait for locks and retries before :class:`Busy`.
        connect_timeout: seconds to wait for a server when connecting (per host).
        pool_size: the most connections this engine keeps in its pool.
        failover_timeout: seconds a call keeps reconnecting after its connection was lost
            (a restart, a failover) before :class:`MetadataError`; None: the URL's
            ``failover_timeout``, else :data:`~irdma.meta.sql.FAILOVER_TIMEOUT_S` (30).

    Raises:
        IrdmaError: the server cannot be reached or refused the login (the message names the
            hosts and ports, never the password).
        InvalidArgument: the database has no irdma tables and ``create`` is False; a bad
            ``failover_timeout``.
    """

    _BEGIN = "BEGIN ISOLATION LEVEL SERIALIZABLE"
    _DB_ERROR = psycopg.Error
    _TXIDS = True

    def __init__(self, url: str, *, create: bool = False, busy_timeout: float = 10.0,
                 connect_timeout: float = 10.0, pool_size: int = 8, failover_timeout: float | None = None) -> None:
        conninfo, url_failover = split_failover(url)
        self.__conninfo = conninfo  # private: the only place the password is kept
        self.url = redact(url)
        self.server = server_of(conninfo)
        self.busy_timeout = busy_timeout
        self.connect_timeout = connect_timeout
        self.failover_timeout = (check_failover_timeout(failover_timeout) if failover_timeout is not None
                                 else url_failover or FAILOVER_TIMEOUT_S)
        self._host = socket.gethostname()
        self._local = threading.local()
        self._pool: ConnectionPool[Any] | None = None
        #: per connection: the busy_timeout its limits were set for, its server process's pid and start
        self._conn_info: weakref.WeakKeyDictionary[psycopg.Connection[Any], tuple[float, int, object]] = (
            weakref.WeakKeyDictionary())
        self._degraded = False  # a connection was lost and the pool has not shown it reconnected
        self._lost_since: float | None = None  # when the current loss began (for the log)
        self._next_prune = 0.0
        try:
            given = psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error:
            given = {}  # a malformed URL: the first connect says what is wrong with it
        # libpq/psycopg apply connect_timeout to each host of a multi-host URL in turn: a dead
        # first host (the old primary's) costs every new connection that much, so it is short
        # there, and opening allows one attempt per host
        hosts = max(1, len(str(given.get("host") or "").split(",")))
        attempt = connect_timeout if hosts == 1 else min(connect_timeout, MULTI_HOST_CONNECT_S)
        with contextlib.suppress(TypeError, ValueError):
            attempt = float(str(given["connect_timeout"])) if "connect_timeout" in given else attempt  # the URL's
        self._open_timeout = max(connect_timeout, attempt * hosts + 2.0)
        self._kwargs: dict[str, Any] = {"autocommit": True, "application_name": "irdma",
                                        **({} if "connect_timeout" in given else
                                           {"connect_timeout": max(2, round(attempt))}),
                                        **{k: v for k, v in _TCP_DEFAULTS.items() if k not in given}}
        with self._connect() as conn:
            self._init_schema(conn, create)
        pool: ConnectionPool[Any] = ConnectionPool(
            conninfo, min_size=1, max_size=pool_size, open=False, name="irdma-meta", timeout=busy_timeout,
            kwargs=self._kwargs, configure=self._configure, reconnect_timeout=max(60.0, 6 * busy_timeout))
        try:
            pool.open(wait=True, timeout=self._open_timeout)
        except PoolTimeout:
            pool.close(timeout=1.0)
            raise self._unreachable("the connection pool could not connect") from None
        self._pool = pool

    def __repr__(self) -> str:
        return f"PostgresMeta({self.url!r})"

    # ---------------------------------------------------------------- connecting
    def _scrub(self, text: object) -> str:
        """``text`` without the password, should a message ever quote it."""
        text = " ".join(str(text).split())  # libpq's messages span lines: one line per log record
        with contextlib.suppress(psycopg.Error):
            secret = psycopg.conninfo.conninfo_to_dict(self.__conninfo).get("password")
            if secret:
                text = text.replace(str(secret), "***")
        return text

    def _unreachable(self, why: object) -> IrdmaError:
        # libpq's own advice lines ("Is the server running on that host...?") are dropped: the hint says it
        said = "\n".join(line for line in str(why).splitlines() if not line.strip().startswith("Is the server"))
        return IrdmaError(
            f"cannot connect to the PostgreSQL metadata server at {self.server} (database {self.url}): "
            f"{self._scrub(said)}",
            "check that PostgreSQL runs there and accepts this host (listen_addresses, pg_hba.conf), that the"
            " user, password (PGPASSWORD or ~/.pgpass) and database are right, and that no firewall is in the way")

    def _connect(self) -> psycopg.Connection[Any]:
        """One connection, or a clear error within ``connect_timeout``."""
        try:
            return psycopg.connect(self.__conninfo, **self._kwargs)
        except psycopg.Error as exc:
            log.debug("metadata: cannot connect to %s: %s", self.server, self._scrub(exc))  # the error says it
            raise self._unreachable(exc) from None

    def _direct(self) -> psycopg.Connection[Any]:
        """A connection of the call's own, outside the pool, with the pool's settings (a
        ``psycopg.Error`` when no host answers: the call's lost-connection path)."""
        conn = psycopg.connect(self.__conninfo, **self._kwargs)
        try:
            self._set_timeouts(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """Every pooled connection's limits (see the module docstring)."""
        self._set_timeouts(conn)

    def _set_timeouts(self, conn: psycopg.Connection[Any]) -> None:
        """The connection's limits, and which server process serves it (pid and start time:
        what settles a commit whose answer was lost)."""
        ms = max(1, int(self.busy_timeout * 1000))
        conn.execute(f"SET lock_timeout = {ms}; SET statement_timeout = {6 * ms};"
                     f" SET idle_in_transaction_session_timeout = {6 * ms}")
        row = conn.execute("SELECT pg_backend_pid(), backend_start FROM pg_stat_activity"
                           " WHERE pid = pg_backend_pid()").fetchone()
        pid, started = (int(row[0]), row[1]) if row else (conn.info.backend_pid, None)
        self._conn_info[conn] = (self.busy_timeout, pid, started)

    def _init_schema(self, conn: psycopg.Connection[Any], create: bool) -> None:
        try:
            if conn.execute("SELECT to_regclass('inodes')").fetchone()[0] is None:  # type: ignore[index]
                if not create:
                    raise InvalidArgument(f"the PostgreSQL database {self.url} is not an irdma metadata database:"
                                          " it has no irdma tables", FORMAT_HINT)
            elif not create and self._schema_current(conn):
                return  # else: made by an older version: the statements below add what it lacks
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for stmt in SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
                t = now()
                conn.execute(
                    "INSERT INTO inodes(ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns)"
                    " OVERRIDING SYSTEM VALUE VALUES (%s,%s,%s,%s,2,%s,%s,%s) ON CONFLICT DO NOTHING",
                    (ROOT_INO, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), t, t, t))
                conn.execute("INSERT INTO config VALUES ('epoch', '0') ON CONFLICT DO NOTHING")
        except psycopg.Error as exc:
            log.error("metadata: cannot set up %s: %s", self.url, self._scrub(exc))
            raise IrdmaError(f"cannot set up the PostgreSQL metadata database {self.url}: {self._scrub(exc)}",
                             "check that the user may create tables in it (or that it is an irdma database)"
                             ) from None

    @staticmethod
    def _schema_current(conn: psycopg.Connection[Any]) -> bool:
        """Whether every table and added column of :data:`SCHEMA` exists (read-only: an open of
        an up-to-date database takes no DDL lock)."""
        tables = re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA)
        columns = re.findall(r"ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+)", SCHEMA)
        for table in tables:
            if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:  # type: ignore[index]
                return False
        for table, column in columns:
            if conn.execute("SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()"
                            " AND table_name=%s AND column_name=%s", (table, column)).fetchone() is None:
                return False
        return True

    # ---------------------------------------------------------------- the driver's part
    @property
    def _db(self) -> _Cursor:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            raise RuntimeError("PostgresMeta: a statement outside an engine call")
        return _Cursor(conn.cursor())

    @property
    def connection(self) -> Any:
        """The psycopg connection this thread's call holds (see :attr:`SqlMeta.connection`)."""
        return self._local.conn

    def _acquire(self, fresh: bool = False) -> None:
        if self._pool is None:
            raise IrdmaError(f"the metadata engine of {self.url} is closed")
        conn: psycopg.Connection[Any] | None = None
        if not fresh:
            try:
                conn = self._pool.getconn(timeout=_DEGRADED_GETCONN_S if self._degraded else self.busy_timeout)
            except PoolTimeout:
                pass  # every pooled connection busy, or the pool still reconnecting: one of its own
        if conn is None:
            conn = self._direct()
            self._local.own = True
        else:
            self._local.own = False
            info = self._conn_info.get(conn)
            if info is None or info[0] != self.busy_timeout:  # a client changed busy_timeout
                try:
                    self._set_timeouts(conn)
                except psycopg.Error:
                    self._pool.putconn(conn)
                    raise
        self._local.conn = conn

    def _release(self, ok: bool = False) -> None:
        conn = self._local.__dict__.pop("conn", None)
        own = self._local.__dict__.pop("own", False)
        if conn is None:
            return
        if ok and self._lost_since is not None:
            log.warning("metadata: %s answers again, %.1f s after the connection was lost", self.server,
                        time.monotonic() - self._lost_since)
            self._lost_since = None
        if own or self._pool is None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            return
        if ok:
            self._degraded = False  # the pool's connections work again
        self._pool.putconn(conn)  # one in a transaction or broken is rolled back or dropped

    def _connection_lost(self, exc: Exception) -> bool:
        code = getattr(exc, "sqlstate", None)
        lost = (code is None and isinstance(exc, psycopg.OperationalError)) or (
            code is not None and (code.startswith("08") or code in _LOST))
        if lost and self._lost_since is None:
            self._lost_since = time.monotonic()
            log.warning("metadata: lost the connection to %s (%s): reconnecting, for up to %g s per call",
                        self.server, self._scrub(exc), self.failover_timeout)
            pool = self._pool
            if pool is not None:  # the idle connections went to the same server: replace them all
                with contextlib.suppress(Exception):  # (one to a dead host costs a call tcp_user_timeout)
                    pool.drain()
        if lost:
            self._degraded = True
        return lost

    def _commit(self, txid: uuid.UUID) -> None:
        conn = self._local.conn
        info = self._conn_info.get(conn)
        self._local.committing = (info[1], info[2]) if info else (conn.info.backend_pid, None)
        # One message: the id and the COMMIT arrive together (a UUID's text needs no quoting).
        # Under synchronous replication the COMMIT waits for the standby with no statement_timeout
        # (postgres.c's finish_xact_command disables it before committing): a primary that cannot
        # reach one is demoted by Patroni, which ends this connection, and the call settles its
        # id on the new primary (see _landed).
        conn.execute(f"INSERT INTO txids(id) VALUES ('{txid}'); COMMIT")
        self._local.committing = None
        t = time.monotonic()
        if t >= self._next_prune:
            self._next_prune = t + TXID_PRUNE_EVERY_S
            try:
                conn.execute("DELETE FROM txids WHERE at < now() - make_interval(secs => %s)", (TXID_KEEP_S,))
            except psycopg.Error as exc:  # the call's commit stands: pruning waits for the next one
                log.info("metadata: pruning old transaction ids on %s: %s", self.server, self._scrub(exc))

    def _landed(self, txid: uuid.UUID, committing: object, until: float) -> bool:
        assert isinstance(committing, tuple)
        pid, started = committing
        c = self._db
        if c.execute("SELECT pg_is_in_recovery()").fetchone()[0]:  # a standby may lag behind the commit
            raise psycopg.OperationalError("a standby answered: a lost commit is settled on the primary only"
                                           " (use target_session_attrs=read-write in a multi-host URL)")
        pause, first = 0.01, True
        while started is not None:  # the old connection's server process: gone, or stopped first
            row = c.execute("SELECT backend_start, wait_event FROM pg_stat_activity WHERE pid=?", (pid,)).fetchone()
            if row is None or row[0] != started:
                break
            if row[1] != "SyncRep":  # ended while it waits for the standby, its commit would stay local
                if first:
                    first = False
                    log.info("metadata: stopping server process %d of a lost connection to %s before looking up"
                             " its commit", pid, self.server)
                c.execute("SELECT pg_terminate_backend(?)", (pid,))
            if time.monotonic() + pause >= until:
                raise MetadataError(
                    f"metadata database {self.url}: the server process {pid} of a lost connection still runs after"
                    f" {self.failover_timeout:g} s" + (" waiting for a synchronous standby" if row[1] == "SyncRep"
                                                        else "") + ": whether its commit landed is unknown",
                    "check the server's log, pg_stat_activity and the standbys (`irdma status`); then check the"
                    " operation's effect before retrying")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        found = c.execute("SELECT 1 FROM txids WHERE id=?", (txid,)).fetchone() is not None
        if found:
            # on this server; on a synchronous standby too once a later commit's wait is over (its
            # WAL position is past the lost one's): only then is it said to have landed
            c.execute("INSERT INTO txids(id) VALUES (?)", (uuid.uuid4(),))
        return found

    def _lost_failure(self, op: str, exc: Exception, unknown: bool) -> IrdmaError:
        message = self._scrub(exc)
        what = (f"metadata {op}: the PostgreSQL metadata server at {self.server} did not answer again within"
                f" {self.failover_timeout:g} s ({message})")
        if unknown:
            what += "; whether the operation's commit landed is unknown"
        log.error("%s", what)
        return MetadataError(
            what, "check that PostgreSQL runs there and is reachable; with several hosts, that one is the primary"
                  " (`patronictl list`) and that the URL has target_session_attrs=read-write; a longer failover"
                  f" needs a larger deadline: ?{FAILOVER_PARAM}=SECONDS in the URL"
                  + ("; check the operation's effect before retrying it" if unknown else ""))

    def _retryable(self, exc: Exception, attempt: int) -> bool:
        code = getattr(exc, "sqlstate", None)
        return code in _RETRY or (code == "23505" and attempt <= _UNIQUE_RETRIES)

    def _failure(self, op: str, exc: Exception, retried: bool) -> IrdmaError:
        code = getattr(exc, "sqlstate", None)
        if retried or code in _BUSY:
            what = "conflicting transactions" if retried else "locks held by other clients"
            log.warning("metadata %s on %s: %s for over %g s", op, self.server, what, self.busy_timeout)
            return Busy(f"metadata database {self.url}: {op} waited {self.busy_timeout:g} s for {what}",
                        "retry; `irdma status` shows the mounts and sessions that hold the namespace")
        message = self._scrub(exc)
        log.error("metadata %s failed on %s: %s", op, self.server, message)
        if isinstance(exc, psycopg.OperationalError) and code is None:  # the connection, not a statement
            return MetadataError(f"metadata database {self.url} at {self.server}: {message}",
                                 "check that the PostgreSQL server is up and reachable, then retry")
        return MetadataError(f"metadata database {self.url}: {message}")

    def close(self) -> None:
        """Close every connection; safe to call twice."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=5.0)


@dataclasses.dataclass(frozen=True)
class TierMember:
    """One PostgreSQL server of a metadata URL, as :func:`tier_status` found it.

    ``role``: ``primary``, ``standby`` or ``down`` (no answer within the timeout); ``sync``: the
    primary's view of this standby (``sync``, ``potential``, ``async``, ``quorum``), "" if not
    known; ``lag_bytes``: WAL the standby has not replayed yet (primary's view), None if not
    known (the role needs ``pg_monitor`` to see it); ``error``: why it is down.
    """

    server: str
    role: str
    sync: str = ""
    lag_bytes: int | None = None
    error: str = ""


def tier_status(url: str, timeout: float = 3.0) -> list[TierMember]:
    """Every server of ``url`` (each host of a multi-host URL, libpq syntax), probed apart with
    ``target_session_attrs=any``: is it up, the primary or a standby (``pg_is_in_recovery()``),
    and, from the primary's ``pg_stat_replication``, each standby's sync state and replay lag in
    bytes (PostgreSQL docs, "The Statistics Collector": ``pg_stat_replication``). Blocking (run it
    in a worker thread); the password comes from the URL or the libpq password file.

    Raises:
        InvalidArgument: not a PostgreSQL URL libpq can parse.
    """
    base, _ = split_failover(url)
    try:
        info = psycopg.conninfo.conninfo_to_dict(base)
    except psycopg.Error as exc:
        raise InvalidArgument(f"not a PostgreSQL URL libpq can parse: {exc}") from None
    hosts = str(info.get("host") or os.environ.get("PGHOST") or "localhost").split(",")
    ports = str(info.get("port") or os.environ.get("PGPORT") or "5432").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    servers = [server_of(psycopg.conninfo.make_conninfo("", host=h or "localhost", port=p or "5432"))
               for h, p in zip(hosts, ports, strict=False)]
    found: list[tuple[str, str, str, dict[str, tuple[str, int | None]]]] = []
    for server, host, port in zip(servers, hosts, ports, strict=False):
        one = {**info, "host": host, "port": port, "target_session_attrs": "any",
               "connect_timeout": str(max(1, int(timeout)))}
        one.pop("hostaddr", None)
        try:
            with psycopg.connect(psycopg.conninfo.make_conninfo("", **one), autocommit=True) as conn:
                standby = bool(conn.execute("SELECT pg_is_in_recovery()").fetchone()[0])  # type: ignore[index]
                seen: dict[str, tuple[str, int | None]] = {}
                if not standby:
                    for addr, sync, lag in conn.execute(
                            "SELECT host(client_addr), sync_state, pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)"
                            " FROM pg_stat_replication"):
                        if addr:
                            seen[str(addr)] = (str(sync or ""), None if lag is None else int(lag))
                found.append((server, "standby" if standby else "primary", "", seen))
        except psycopg.Error as exc:
            found.append((server, "down", _scrub_text(str(exc).strip().splitlines()[0] if str(exc).strip() else
                                                     type(exc).__name__, url), {}))
    views = {k: v for _, role, _, seen in found if role == "primary" for k, v in seen.items()}
    out = []
    for (server, role, error, _), host in zip(found, hosts, strict=False):
        key = host
        if host not in views:  # a host name: the primary sees the standby's address
            with contextlib.suppress(OSError):
                key = socket.gethostbyname(host)
        sync, lag = views.get(key, ("", None)) if role == "standby" else ("", None)
        out.append(TierMember(server, role, sync, lag, error))
    return out


def _scrub_text(text: str, url: str) -> str:
    """``text`` without the URL's password (if any)."""
    with contextlib.suppress(psycopg.Error):
        secret = psycopg.conninfo.conninfo_to_dict(split_failover(url)[0]).get("password")
        if secret:
            return text.replace(str(secret), "***")
    return text
