"""The engines' side of :mod:`irdma.meta.dump`: each engine's catalog (tables, columns and
their kinds, primary keys), snapshots and write transactions, paged reads, id sequences and
bulk inserts, in SQLite's and PostgreSQL's dialects.

Kinds of columns, from declared types: SQLite by affinity (SQLite documentation, "Datatypes In
SQLite", 3.1 "Determination Of Column Affinity"), PostgreSQL by ``information_schema.columns``'
``data_type``; a type the format cannot hold is ``"?TYPE"`` (a dump refuses it). Paged reads:
SQLite ``fetchmany`` of one statement; PostgreSQL a server-side cursor (``DECLARE``, psycopg's
named cursor) in the snapshot's transaction. Inserts: SQLite ``executemany``; PostgreSQL
``COPY ... FROM STDIN``, which also takes the values of ``GENERATED ALWAYS`` identity columns.
Sequences: SQLite ``sqlite_sequence`` (``AUTOINCREMENT`` tables only); PostgreSQL the sequence
``pg_get_serial_sequence`` names (identity and serial columns), read as ``last_value`` /
``is_called`` and set with ``setval``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from irdma._errors import InvalidArgument

from .base import MetaStore

#: Rows fetched from the database at once (a PostgreSQL cursor's page).
PAGE_ROWS = 1000


def quote(name: str) -> str:
    """An SQL identifier, quoted (both engines take double quotes)."""
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------- the engines' catalogs
class Side:
    """One engine's connection, as dump and load need it (a dialect)."""

    kind = ""

    def tables(self) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
        """Every table: (its columns as (name, kind) in table order, its primary key's columns)."""
        raise NotImplementedError

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def begin_snapshot(self) -> None:
        raise NotImplementedError

    def begin_write(self) -> None:
        """Begin the load's write transaction."""
        raise NotImplementedError

    def lock(self, tables: Sequence[str]) -> None:
        """Keep other writers off ``tables`` until the transaction ends (where the write
        transaction does not already)."""

    def end(self, commit: bool) -> None:
        self.execute("COMMIT" if commit else "ROLLBACK")

    def text_order(self, column: str) -> str:
        """ORDER BY term of a text column, compared as bytes."""
        return quote(column)

    def rows(self, sql: str) -> Iterator[Sequence[Any]]:
        """The rows of a query, fetched in pages (never the whole result in memory)."""
        raise NotImplementedError

    def high_water(self, table: str, column: str) -> int:
        """The highest id the engine's sequence of ``table.column`` handed out (0: none)."""
        raise NotImplementedError

    def set_counter(self, table: str, column: str, value: int) -> None:
        raise NotImplementedError

    def insert(self, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError


_SQLITE_KINDS = (("INT", "int"), ("BOOL", "bool"), ("CHAR", "text"), ("CLOB", "text"), ("TEXT", "text"),
                 ("BLOB", "bytes"), ("REAL", "float"), ("FLOA", "float"), ("DOUB", "float"))


def _sqlite_kind(decl: str) -> str:
    """A SQLite declared type's kind, by its affinity (SQLite documentation, "Datatypes In
    SQLite", 3.1 Determination Of Column Affinity); no type: bytes."""
    decl = decl.upper()
    if not decl:
        return "bytes"
    for part, kind in _SQLITE_KINDS:
        if part in decl:
            return kind
    return "?" + decl


class SqliteSide(Side):
    kind = "sqlite"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._auto: set[str] = set()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.conn.execute(sql, tuple(params))

    def tables(self) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
        out = {}
        for name, sql in self.execute("SELECT name, sql FROM sqlite_master WHERE type='table'"
                                      " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'").fetchall():
            if "AUTOINCREMENT" in (sql or "").upper():
                self._auto.add(name)
            info = self.execute(f"PRAGMA table_info({quote(name)})").fetchall()
            cols = [(str(r[1]), _sqlite_kind(str(r[2] or ""))) for r in info]
            key = [str(r[1]) for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            out[str(name)] = (cols, key)
        return out

    def begin_snapshot(self) -> None:
        self.execute("BEGIN")  # WAL: the first read fixes the snapshot the whole dump sees

    def begin_write(self) -> None:
        self.execute("BEGIN IMMEDIATE")  # the database's write lock: nobody else writes meanwhile

    def rows(self, sql: str) -> Iterator[Sequence[Any]]:
        cur = self.conn.execute(sql)
        while True:
            page = cur.fetchmany(PAGE_ROWS)
            if not page:
                return
            yield from page

    def high_water(self, table: str, column: str) -> int:
        if table not in self._auto:
            return 0
        row = self.execute("SELECT seq FROM sqlite_sequence WHERE name=?", (table,)).fetchone()
        return int(row[0]) if row else 0

    def set_counter(self, table: str, column: str, value: int) -> None:
        if table not in self._auto or value <= 0:
            return  # a rowid table hands out one more than its largest id: nothing to keep
        if not self.execute("UPDATE sqlite_sequence SET seq=? WHERE name=?", (value, table)).rowcount:
            self.execute("INSERT INTO sqlite_sequence(name, seq) VALUES (?, ?)", (table, value))

    def insert(self, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        cols = ", ".join(map(quote, columns))
        self.conn.executemany(f"INSERT INTO {quote(table)}({cols}) VALUES ({', '.join('?' * len(columns))})", rows)


_PG_KINDS = {"bigint": "int", "integer": "int", "smallint": "int", "text": "text", "character varying": "text",
             "character": "text", "bytea": "bytes", "double precision": "float", "real": "float", "boolean": "bool"}


class PostgresSide(Side):
    kind = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._seq: dict[tuple[str, str], str | None] = {}
        self._serial = 0

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.conn.execute(sql, tuple(params) or None)

    def tables(self) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
        out = {}
        names = [r[0] for r in self.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
            " AND table_type = 'BASE TABLE'").fetchall()]
        for name in names:
            cols = [(str(c), _PG_KINDS.get(str(t), "?" + str(t))) for c, t in self.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = current_schema()"
                " AND table_name = %s ORDER BY ordinal_position", (name,)).fetchall()]
            key = [str(r[0]) for r in self.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
                " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary"
                " ORDER BY array_position(i.indkey::int2[], a.attnum)", (quote(name),)).fetchall()]
            out[str(name)] = (cols, key)
        return out

    def begin_snapshot(self) -> None:
        self.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        self._no_timeouts()

    def begin_write(self) -> None:
        self.execute("BEGIN")
        self._no_timeouts()

    def lock(self, tables: Sequence[str]) -> None:
        if tables:
            self.execute(f"LOCK TABLE {', '.join(map(quote, tables))} IN EXCLUSIVE MODE")

    def _no_timeouts(self) -> None:
        # the engine's limits are for short calls; a dump or load is one long transaction
        self.execute("SET LOCAL statement_timeout = 0")
        self.execute("SET LOCAL idle_in_transaction_session_timeout = 0")

    def text_order(self, column: str) -> str:
        return f'{quote(column)} COLLATE "C"'

    def rows(self, sql: str) -> Iterator[Sequence[Any]]:
        self._serial += 1
        with self.conn.cursor(name=f"irdma_dump_{self._serial}") as cur:  # server-side: fetched by pages
            cur.itersize = PAGE_ROWS
            cur.execute(sql)
            yield from cur

    def _sequence(self, table: str, column: str) -> str | None:
        if (table, column) not in self._seq:
            row = self.execute("SELECT pg_get_serial_sequence(%s, %s)", (quote(table), column)).fetchone()
            self._seq[(table, column)] = row[0] if row else None
        return self._seq[(table, column)]

    def high_water(self, table: str, column: str) -> int:
        seq = self._sequence(table, column)
        if seq is None:
            return 0
        last, called = self.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
        return int(last) if called else int(last) - 1

    def set_counter(self, table: str, column: str, value: int) -> None:
        seq = self._sequence(table, column)
        if seq is not None and value >= 1:
            self.execute("SELECT setval(%s::regclass, %s, true)", (seq, value))

    def insert(self, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        # COPY: one stream per batch, and it takes the values of identity columns as given
        with self.conn.cursor() as cur, cur.copy(
                f"COPY {quote(table)} ({', '.join(map(quote, columns))}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


@contextlib.contextmanager
def engine_side(meta: MetaStore) -> Iterator[Side]:
    """A connection of ``meta`` (an SQL engine) held for one dump or load, outside the
    engine's per-call retries (a dump written halfway cannot be run again).

    Raises:
        InvalidArgument: ``meta`` is not one of the SQL engines.
    """
    from .sql import SqlMeta
    from .sqlite import SqliteMeta

    if not isinstance(meta, SqlMeta):
        raise InvalidArgument(f"{type(meta).__name__} cannot be dumped or loaded",
                              "pass an sqlite:// or postgresql:// metadata URL")
    with meta.held() as conn:  # engine calls made meanwhile run on this connection
        yield SqliteSide(conn) if isinstance(meta, SqliteMeta) else PostgresSide(conn)
