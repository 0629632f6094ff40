"""What the SQL engines share below the methods: SQL fragments, rows to records, name checks.

Every statement here is written once, in the SQL that SQLite (3.35 or later) and PostgreSQL
(13 or later) both take: ``?`` placeholders (the PostgreSQL driver turns them into ``%s``),
``INSERT ... ON CONFLICT``, ``RETURNING`` for new ids, ``CASE`` where SQLite would sum booleans
or call a two-argument ``MAX``. Nothing in this module does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from irdma._errors import InvalidArgument, NameTooLong

from .base import NAME_MAX, SESSION_EXPIRY_S, XATTR_CHUNK_SIZE, XATTR_UPDATE, Inode, ShardRecord


class Result(Protocol):
    """What a statement gives back (an ``sqlite3.Cursor`` or a ``psycopg.Cursor``)."""

    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Cursor(Protocol):
    """Where the engine runs statements: ``?`` placeholders, a tuple of parameters."""

    def execute(self, sql: str, params: Sequence[Any] = ...) -> Result: ...

    def executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> Any: ...


COLS = ("ino, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe, update_op, rdev, replicas,"
        " snap")
#: :data:`COLS` of the inodes table aliased ``i``.
I_COLS = ", ".join("i." + x.strip() for x in COLS.split(","))
SHARD_COLS = "id, address, state, added_ns, incarnation, health, health_ns"
#: SQL: chunk-map row ``c`` has another replica on memory its shard still has (not lost).
ELSEWHERE = ("EXISTS (SELECT 1 FROM chunks d JOIN shards s ON s.id = d.shard WHERE d.ino = c.ino AND d.idx = c.idx"
             " AND d.shard <> c.shard AND d.incarnation = s.incarnation AND s.state <> 'removed')")
#: Shard health that takes a shard out of its chains (it missed updates, or may have).
NOT_CURRENT = ("down", "syncing")
#: The xattrs kept as columns of the inode.
VIRTUAL = (XATTR_UPDATE, XATTR_CHUNK_SIZE)
#: SQL: add one to the shard map's epoch (kept as text in the config table).
BUMP_EPOCH = "UPDATE config SET value=CAST(CAST(value AS BIGINT)+1 AS TEXT) WHERE key='epoch'"


def now() -> int:
    """Nanoseconds since the Unix epoch."""
    return time.time_ns()


def inode_row(row: Sequence[Any]) -> Inode:
    """An :class:`Inode` from the :data:`COLS` of a row."""
    stripe = tuple(int(s) for s in row[10].split(",") if s)
    ino, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size = row[:10]
    return Inode(int(ino), int(mode), int(uid), int(gid), int(size), int(nlink), int(atime_ns), int(mtime_ns),
                 int(ctime_ns), None if chunk_size is None else int(chunk_size), stripe, row[11], int(row[12]),
                 int(row[13]), int(row[14]))


def shard_row(row: Sequence[Any]) -> ShardRecord:
    """A :class:`ShardRecord` from the :data:`SHARD_COLS` of a row."""
    sid, address, state, added_ns, incarnation, health, health_ns = row
    return ShardRecord(int(sid), str(address), str(state), int(added_ns), int(incarnation), str(health),
                       int(health_ns))


def live_since() -> int:
    """Heartbeats at or after this time (ns) mark a live session."""
    return now() - int(SESSION_EXPIRY_S * 1e9)


def check_name(name: bytes) -> None:
    """Raise unless ``name`` can be a directory entry.

    Raises:
        NameTooLong: over :data:`NAME_MAX` bytes. InvalidArgument: empty, ``.``, ``..``, or with
            a ``/`` or a NUL byte.
    """
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes is longer than {NAME_MAX}")
    if not name or b"/" in name or name in (b".", b"..") or b"\0" in name:
        raise InvalidArgument(f"invalid file name {name!r}")


def redact(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` parameter) replaced by
    ``***``: what users may see (no I/O)."""
    try:
        parts = urlsplit(url)
        if parts.password is None and "password=" not in parts.query:
            return url  # as given (urlunsplit would turn sqlite:///a into sqlite:/a)
        if parts.password is not None:
            parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}")
        if "password=" in parts.query:
            query = "&".join("password=***" if q.startswith("password=") else q for q in parts.query.split("&"))
            parts = parts._replace(query=query)
        return urlunsplit(parts)
    except ValueError:
        return url.split("://", 1)[0] + "://***"
