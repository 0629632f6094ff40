"""Metadata backup and migration: a streamed JSON dump of every persistent table, and its load
into an empty engine of either kind (the shape of ``juicefs dump`` / ``juicefs load``, JuiceFS
documentation, "Metadata Backup & Recovery").

What a dump holds: every table of the engine's schema, found in the database's own catalog
(SQLite ``sqlite_master`` and ``PRAGMA table_info``; PostgreSQL ``information_schema`` and
``pg_index``), so a table added to the schema is dumped and loaded with no change here: the
namespace (``inodes`` with symlink targets, ``dentries``, ``xattrs``), the chunk maps
(``chunks``: per chunk, each replica's shard and in-sync incarnation), the shard map
(``shards``: ids, addresses, states, incarnations, health), ``config`` (the shard map's epoch,
the replication setting), data moves in progress (``moves``), the training jobs' coordination
state (``sync``, ``sync_owners``, ``clocks``, ``members``, ``arrivals``), and the id counters.
Left out (:data:`TRANSIENT`): ``sessions`` and ``open_files`` (the mounts and clients of the
source engine, which do not follow it: a file with no name that a session held open is an
orphan for ``irdma gc`` after a load) and PostgreSQL's ``txids`` (ids of its own commits).
The cluster key is not metadata (it is the key file, ``cluster.key``) and the shards' bytes
are not either: a dump restores the metadata only, and the chunks it names must still be on
the shards (or come back with their data directories).

The format, version :data:`FORMAT_VERSION`: one JSON document, UTF-8, written one row per
line so that it is written and read back in a stream (neither side holds a table in memory)::

    {"irdma_metadata_dump":1,
    "header":{"irdma":"0.1.0","engine":"sqlite","source":"sqlite:///...","dumped_at":"...Z",
              "tables":{"chunks":{"columns":[["ino","int"],...],"key":["ino","idx","shard"],"rows":2},...},
              "counters":{"inodes.ino":57,...},"rows":123,"left_out":["open_files","sessions","txids"]},
    "rows":{
    "chunks":[
    [2,0,1,1],
    [2,0,2,1]
    ],
    ...
    "xattrs":[
    ]
    },
    "end":{"rows":123}}

(the header is one line). Tables come in name order; a table's columns are its primary key's,
in key order, then the others in name order; rows are in primary-key order, text compared as
bytes (SQLite's BINARY collation, PostgreSQL's ``COLLATE "C"``). So the same namespace gives
the same lines on either engine, apart from the header's ``engine``, ``source`` and
``dumped_at``. Values by column kind: ``int`` (JSON integers), ``float``, ``bool``, ``text``
(JSON strings) and ``bytes`` (names, xattr values, symlink targets): a JSON string when the
bytes are valid UTF-8 (the string's UTF-8 encoding is the bytes), else ``{"b64": "..."}``
(standard base64, RFC 4648 section 4, with padding); ``null`` is SQL NULL. A counter
``TABLE.COLUMN`` is the highest id the table's single-integer-column primary key has handed
out (the larger of the engine's sequence, SQLite ``sqlite_sequence`` or a PostgreSQL identity
sequence, and the largest id present): a load sets the target's sequence to it, so new files,
shards and moves never take an id again (SQLite keeps it for ``AUTOINCREMENT`` tables; its
other tables hand out one more than the largest id present).

A dump reads one snapshot (SQLite: one read transaction, WAL; PostgreSQL: one ``REPEATABLE
READ READ ONLY`` transaction, rows fetched by a server-side cursor in pages of
:data:`PAGE_ROWS`): writers may go on, and the dump is the state at one instant. A load is one
write transaction: it refuses a target that holds anything but a new, empty namespace (the
root directory and ``config``) and, for any error (an unknown format version, a damaged or
truncated file, a table or column the target does not have), rolls back: the target is as it was.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime
import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from irdma._errors import InvalidArgument, IrdmaError

from .base import ROOT_INO, MetaStore

#: The version of the format this module writes and the only one it reads.
FORMAT_VERSION = 1
#: The first key of a dump: tells a dump from any other JSON file.
MAGIC = "irdma_metadata_dump"
#: Tables a dump leaves out (see the module docstring), and a load leaves alone.
TRANSIENT = frozenset({"sessions", "open_files", "txids"})
#: Rows fetched from the database at once (a PostgreSQL dump's cursor page) and rows per
#: insert batch of a load.
PAGE_ROWS = 1000
#: Column kinds of the format.
KINDS = ("int", "float", "bool", "text", "bytes")

#: ``progress(header, rows_done, bytes_done)``: called with 0, 0 once the header is known, then
#: after every page of rows and at the end (bytes: of the dump file, written or read).
Progress = Callable[["Header", int, int], None]


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of a dump: ``columns`` as (name, kind) in the dump's order, ``key`` the primary
    key's columns, ``rows`` how many rows the dump holds."""

    name: str
    columns: tuple[tuple[str, str], ...]
    key: tuple[str, ...]
    rows: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"columns": [list(c) for c in self.columns], "key": list(self.key), "rows": self.rows}


@dataclasses.dataclass(frozen=True)
class Header:
    """What a dump says about itself (its first lines): the irdma version and engine kind
    (``sqlite`` or ``postgresql``) that made it, the source URL (no password), when (ISO 8601,
    UTC), its tables, the id counters and the total rows."""

    irdma: str
    engine: str
    source: str
    dumped_at: str
    tables: dict[str, Table]
    counters: dict[str, int]
    left_out: tuple[str, ...] = ()
    version: int = FORMAT_VERSION

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables.values())

    def to_json(self) -> dict[str, Any]:
        return {"irdma": self.irdma, "engine": self.engine, "source": self.source, "dumped_at": self.dumped_at,
                "tables": {n: t.to_json() for n, t in sorted(self.tables.items())},
                "counters": dict(sorted(self.counters.items())), "rows": self.rows,
                "left_out": list(self.left_out)}

    @classmethod
    def from_json(cls, doc: Any, version: int, where: str) -> Header:
        """Raises InvalidArgument: not a header of this format."""
        try:
            tables = {}
            for name, t in doc["tables"].items():
                columns = tuple((str(c), str(k)) for c, k in t["columns"])
                bad = [k for _, k in columns if k not in KINDS]
                if bad:
                    raise InvalidArgument(f"{where}: table {name} has columns of unknown kind {bad[0]!r}",
                                          "load it with the irdma version that made it, or a newer one")
                tables[str(name)] = Table(str(name), columns, tuple(map(str, t["key"])), int(t["rows"]))
            return cls(str(doc["irdma"]), str(doc["engine"]), str(doc["source"]), str(doc["dumped_at"]), tables,
                       {str(k): int(v) for k, v in doc["counters"].items()}, tuple(doc.get("left_out", ())), version)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"{where}: the dump's header is malformed ({type(exc).__name__}: {exc})",
                                  "the file is damaged: use another copy of the dump") from None


# ---------------------------------------------------------------- values
def encode_value(value: Any, kind: str) -> Any:
    """A column value as the JSON value of the format (see the module docstring).

    Raises:
        TypeError: ``value`` is not of the column's kind.
    """
    if value is None:
        return None
    if kind == "bytes":
        if isinstance(value, memoryview):
            value = value.tobytes()
        if not isinstance(value, bytes):
            raise TypeError(f"{type(value).__name__} in a bytes column")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"b64": base64.b64encode(value).decode("ascii")}
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "text" and isinstance(value, str):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "bool" and isinstance(value, (bool, int)):
        return bool(value)
    raise TypeError(f"{type(value).__name__} in a {kind} column")


def decode_value(value: Any, kind: str) -> Any:
    """The column value a JSON value of the format stands for.

    Raises:
        ValueError: ``value`` is not a value of the column's kind.
    """
    if value is None:
        return None
    if kind == "bytes":
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, dict) and set(value) == {"b64"} and isinstance(value["b64"], str):
            try:
                return base64.b64decode(value["b64"], validate=True)
            except binascii.Error as exc:
                raise ValueError(f"bad base64: {exc}") from None
        raise ValueError(f"{value!r} is no bytes value (a string or {{\"b64\": ...}})")
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "text" and isinstance(value, str):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    raise ValueError(f"{value!r} is no {kind} value")


def _quote(name: str) -> str:
    """An SQL identifier, quoted (both engines take double quotes)."""
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------- the engines' catalogs
class _Side:
    """One engine's connection, as dump and load need it (a dialect)."""

    kind = ""

    def tables(self) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
        """Every table: (its columns as (name, kind) in table order, its primary key's columns)."""
        raise NotImplementedError

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def begin_snapshot(self) -> None:
        raise NotImplementedError

    def begin_write(self, tables: Sequence[str]) -> None:
        raise NotImplementedError

    def end(self, commit: bool) -> None:
        self.execute("COMMIT" if commit else "ROLLBACK")

    def text_order(self, column: str) -> str:
        """ORDER BY term of a text column, compared as bytes."""
        return _quote(column)

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


class _SqliteSide(_Side):
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
            info = self.execute(f"PRAGMA table_info({_quote(name)})").fetchall()
            cols = [(str(r[1]), _sqlite_kind(str(r[2] or ""))) for r in info]
            key = [str(r[1]) for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            out[str(name)] = (cols, key)
        return out

    def begin_snapshot(self) -> None:
        self.execute("BEGIN")  # WAL: the first read fixes the snapshot the whole dump sees

    def begin_write(self, tables: Sequence[str]) -> None:
        self.execute("BEGIN IMMEDIATE")

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
        cols = ", ".join(map(_quote, columns))
        self.conn.executemany(f"INSERT INTO {_quote(table)}({cols}) VALUES ({', '.join('?' * len(columns))})", rows)


_PG_KINDS = {"bigint": "int", "integer": "int", "smallint": "int", "text": "text", "character varying": "text",
             "character": "text", "bytea": "bytes", "double precision": "float", "real": "float", "boolean": "bool"}


class _PostgresSide(_Side):
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
                " ORDER BY array_position(i.indkey::int2[], a.attnum)", (_quote(name),)).fetchall()]
            out[str(name)] = (cols, key)
        return out

    def begin_snapshot(self) -> None:
        self.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        self._no_timeouts()

    def begin_write(self, tables: Sequence[str]) -> None:
        self.execute("BEGIN")
        self._no_timeouts()
        if tables:  # nobody writes the target while it is checked and filled
            self.execute(f"LOCK TABLE {', '.join(map(_quote, tables))} IN EXCLUSIVE MODE")

    def _no_timeouts(self) -> None:
        # the engine's limits are for short calls; a dump or load is one long transaction
        self.execute("SET LOCAL statement_timeout = 0")
        self.execute("SET LOCAL idle_in_transaction_session_timeout = 0")

    def text_order(self, column: str) -> str:
        return f'{_quote(column)} COLLATE "C"'

    def rows(self, sql: str) -> Iterator[Sequence[Any]]:
        self._serial += 1
        with self.conn.cursor(name=f"irdma_dump_{self._serial}") as cur:  # server-side: fetched by pages
            cur.itersize = PAGE_ROWS
            cur.execute(sql)
            yield from cur

    def _sequence(self, table: str, column: str) -> str | None:
        if (table, column) not in self._seq:
            row = self.execute("SELECT pg_get_serial_sequence(%s, %s)", (_quote(table), column)).fetchone()
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
                f"COPY {_quote(table)} ({', '.join(map(_quote, columns))}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


@contextlib.contextmanager
def _side(meta: MetaStore) -> Iterator[_Side]:
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
    meta._acquire()
    ok = False
    meta._local.depth = 1  # engine calls made meanwhile run on this connection
    try:
        if isinstance(meta, SqliteMeta):
            yield _SqliteSide(meta._db)
        else:
            yield _PostgresSide(meta._local.conn)
        ok = True
    finally:
        meta._local.depth = 0
        meta._release(ok)


def _failure(meta: MetaStore, exc: Exception, what: str) -> IrdmaError:
    """A database error of a dump or load as an IrdmaError naming the database."""
    url = getattr(meta, "url", "?")
    return IrdmaError(f"{what} {url}: {' '.join(str(exc).split())}",
                      "check that the database is reachable and writable, then run the command again")


def _dump_tables(side: _Side) -> dict[str, Table]:
    """The tables a dump holds, with their columns in the dump's order (no counts yet).

    Raises:
        InvalidArgument: a column of a kind the format has no encoding for.
    """
    out = {}
    for name, (cols, key) in sorted(side.tables().items()):
        if name in TRANSIENT:
            continue
        bad = [f"{c} ({k[1:]})" for c, k in cols if k.startswith("?")]
        if bad:
            raise InvalidArgument(f"table {name} has columns of a type a dump cannot hold: {', '.join(bad)}",
                                  f"add the type to irdma.meta.dump (kinds {', '.join(KINDS)})")
        kinds = dict(cols)
        order = list(key) + sorted(c for c in kinds if c not in key)
        out[name] = Table(name, tuple((c, kinds[c]) for c in order), tuple(key))
    return out


def _counter_column(t: Table) -> str | None:
    """The id column of a table whose primary key is one integer column, else None."""
    if len(t.key) == 1 and dict(t.columns)[t.key[0]] == "int":
        return t.key[0]
    return None


def _select(side: _Side, t: Table) -> str:
    kinds = dict(t.columns)
    order = t.key or tuple(kinds)
    terms = [side.text_order(c) if kinds[c] == "text" else _quote(c) for c in order]
    return (f"SELECT {', '.join(_quote(c) for c, _ in t.columns)} FROM {_quote(t.name)}"
            f" ORDER BY {', '.join(terms)}")


def dump(meta: MetaStore, out: IO[bytes], *, source: str | None = None, progress: Progress | None = None) -> Header:
    """Write a dump of ``meta`` (an SQLite or PostgreSQL engine) to the binary stream ``out``.

    One snapshot of the database (see the module docstring); rows are read in pages and
    written as they come. ``progress`` (see :data:`Progress`) is called after every page.

    Args:
        meta: the engine to dump (left open).
        out: where the dump goes (bytes; UTF-8 JSON).
        source: the source's URL as the header shows it [default: ``meta.url``].

    Returns:
        The dump's header.

    Raises:
        InvalidArgument: a table has a column type the format has no encoding for (nothing
            written).
        IrdmaError: the database failed while it was read (``out`` holds part of a dump, which
            a load refuses).
        OSError: ``out`` could not be written.
    """
    from irdma import __version__

    written = 0

    def emit(data: str) -> None:
        nonlocal written
        raw = data.encode("utf-8")
        out.write(raw)
        written += len(raw)

    with _side(meta) as side:
        db_error = getattr(meta, "_DB_ERROR", Exception)
        try:
            side.begin_snapshot()
            try:
                tables = _dump_tables(side)
                counters = {}
                for name, t in list(tables.items()):
                    n = int(side.execute(f"SELECT COUNT(*) FROM {_quote(name)}").fetchone()[0])
                    tables[name] = dataclasses.replace(t, rows=n)
                    col = _counter_column(t)
                    if col is not None:
                        top = side.execute(f"SELECT MAX({_quote(col)}) FROM {_quote(name)}").fetchone()[0]
                        counters[f"{name}.{col}"] = max(side.high_water(name, col), int(top or 0))
                at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                header = Header(__version__, side.kind, source or str(getattr(meta, "url", "")), at, tables, counters,
                                tuple(sorted(TRANSIENT)))
                emit(f'{{"{MAGIC}":{FORMAT_VERSION},\n')
                emit('"header":' + json.dumps(header.to_json(), ensure_ascii=False, separators=(",", ":")) + ",\n")
                emit('"rows":{\n')
                if progress:
                    progress(header, 0, written)
                done = 0
                names = list(tables)
                for i, name in enumerate(names):
                    t = tables[name]
                    emit(json.dumps(name) + ":[\n")
                    kinds = [k for _, k in t.columns]
                    prev: str | None = None
                    n = 0
                    for row in side.rows(_select(side, t)):
                        try:
                            line = json.dumps([encode_value(v, k) for v, k in zip(row, kinds, strict=True)],
                                              ensure_ascii=False, separators=(",", ":"))
                        except TypeError as exc:
                            raise IrdmaError(f"table {name}, row {n + 1}: {exc}",
                                             "the database holds a value of an unexpected type: check it with"
                                             " `irdma fsck`") from None
                        if prev is not None:
                            emit(prev + ",\n")
                        prev = line
                        n += 1
                        if n % PAGE_ROWS == 0 and progress:
                            progress(header, done + n, written)
                    if prev is not None:
                        emit(prev + "\n")
                    if n != t.rows:  # cannot happen in one snapshot: refuse to write a wrong dump
                        raise IrdmaError(f"table {name} gave {n} rows, its count said {t.rows}",
                                         "run the dump again")
                    done += n
                    emit("]" + ("," if i < len(names) - 1 else "") + "\n")
                    if progress:
                        progress(header, done, written)
                emit('},\n"end":' + json.dumps({"rows": done}, separators=(",", ":")) + "}\n")
                if progress:
                    progress(header, done, written)
            finally:
                with contextlib.suppress(db_error):
                    side.end(commit=False)
        except db_error as exc:
            raise _failure(meta, exc, "dump of") from None
    return header


# ---------------------------------------------------------------- reading a dump
class DumpReader:
    """A dump read back line by line (see the module docstring), header first.

    Args:
        stream: the dump (binary).
        name: how messages name the stream (a file name, or ``-`` for standard input).

    Attributes:
        header: the dump's header.
        bytes_read: bytes read so far.

    Raises:
        InvalidArgument: not an irdma metadata dump, a format version other than
            :data:`FORMAT_VERSION`, or a malformed header.
    """

    def __init__(self, stream: IO[bytes], name: str = "the dump") -> None:
        self._stream = stream
        self.name = name
        self.bytes_read = 0
        self._lineno = 0
        raw = stream.readline(len(MAGIC) + 32)  # bounded: a file with no newline is not read whole
        self.bytes_read, self._lineno = len(raw), 1
        first = raw.decode("utf-8", "replace").rstrip("\r\n")
        m = re.fullmatch(rf'\{{"{MAGIC}":(\d+),', first)
        if m is None:
            raise InvalidArgument(f"{name} is not an irdma metadata dump (its first line is {first[:60]!r})",
                                  "pass a file `irdma dump` wrote")
        version = int(m.group(1))
        if version != FORMAT_VERSION:
            raise InvalidArgument(
                f"{name} is a metadata dump of format version {version}; this irdma reads version {FORMAT_VERSION}",
                "load it with the irdma version that made it (or a newer one); nothing was changed")
        line = self._line()
        if not (line.startswith('"header":') and line.endswith(",")):
            raise self._damaged("the header")
        try:
            doc = json.loads(line[len('"header":'):-1])
        except ValueError:
            raise self._damaged("the header") from None
        self.header = Header.from_json(doc, version, name)
        self._state = "header"

    def _line(self) -> str:
        raw = self._stream.readline()
        self.bytes_read += len(raw)
        self._lineno += 1
        if not raw:
            return ""
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise self._damaged("valid UTF-8") from None

    def _damaged(self, expected: str) -> InvalidArgument:
        return InvalidArgument(f"{self.name}, line {self._lineno}: expected {expected}: the dump is damaged or"
                               " truncated", "use a complete copy of the dump (a dump ends with an \"end\" line);"
                               " nothing was loaded")

    def tables(self) -> Iterator[tuple[Table, Iterator[list[Any]]]]:
        """Each table of the dump, in order, with an iterator of its rows (JSON values, not yet
        decoded); each iterator must be used up before the next table.

        Raises:
            InvalidArgument: the file is damaged or truncated (a table missing, out of order,
                with more or fewer rows than its header says, or no end line).
        """
        if self._state != "header":
            raise RuntimeError("DumpReader.tables() runs once")
        self._state = "rows"
        if self._line() != '"rows":{':
            raise self._damaged('"rows":{')
        names = list(self.header.tables)
        for i, name in enumerate(names):
            if self._line() != json.dumps(name) + ":[":
                raise self._damaged(f"the rows of table {name}")
            t = self.header.tables[name]
            yield t, self._rows(t, last=i == len(names) - 1)
        if self._line() != "},":
            raise self._damaged("the end of the rows")
        line = self._line()
        if not (line.startswith('"end":') and line.endswith("}")):
            raise self._damaged("the end line")
        try:
            end = json.loads(line[len('"end":'):-1])
        except ValueError:
            raise self._damaged("the end line") from None
        if not isinstance(end, dict) or end.get("rows") != self.header.rows:
            raise self._damaged(f"the end line with {self.header.rows} rows")
        if any(x.strip() for x in iter(self._line, "")):
            raise self._damaged("nothing after the end line")

    def _rows(self, t: Table, last: bool) -> Iterator[list[Any]]:
        n = 0
        width = len(t.columns)
        while True:
            line = self._line()
            if line in ("]", "],"):
                if line != ("]" if last else "],") or n != t.rows:
                    raise self._damaged(f"{t.rows} rows of table {t.name} (found {n})")
                return
            text = line[:-1] if line.endswith(",") else line
            try:
                row = json.loads(text)
            except ValueError:
                raise self._damaged(f"a row of table {t.name}") from None
            if not isinstance(row, list) or len(row) != width:
                raise self._damaged(f"a row of {width} values of table {t.name}")
            n += 1
            yield row


# ---------------------------------------------------------------- loading
def _check_target(side: _Side, header: Header, url: str) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
    """Refuse a target that cannot take this dump: a table or column it lacks, of another kind,
    or one of its columns the dump lacks that has no default."""
    have = side.tables()
    missing = [n for n in header.tables if n not in have]
    if missing:
        raise InvalidArgument(
            f"{url} has no table {', '.join(missing)} of the dump (made by irdma {header.irdma})",
            "load it with an irdma at least as new as the one that made it; nothing was changed")
    for name, t in header.tables.items():
        kinds = dict(have[name][0])
        for col, kind in t.columns:
            if col not in kinds:
                raise InvalidArgument(f"{url}: table {name} has no column {col} of the dump (made by irdma"
                                      f" {header.irdma})", "load it with an irdma at least as new as the one that"
                                      " made it; nothing was changed")
            if kinds[col] != kind:
                raise InvalidArgument(f"{url}: column {name}.{col} holds {kinds[col]}, the dump's {kind}",
                                      "load it with the irdma version that made it; nothing was changed")
    return have


def _check_empty(side: _Side, header: Header, url: str) -> None:
    """Raise unless every table the dump fills holds nothing but what a new namespace has (the
    root directory, ``config``)."""
    held = []
    for name in header.tables:
        if name == "config":
            continue
        where = f" WHERE ino <> {ROOT_INO}" if name == "inodes" else ""
        n = int(side.execute(f"SELECT COUNT(*) FROM {_quote(name)}{where}").fetchone()[0])
        if n:
            held.append(f"{n} {name}" if name != "inodes" else f"{n} inodes besides the root")
    if held:
        raise InvalidArgument(
            f"{url} already holds a namespace ({', '.join(held[:4])}): a dump loads only into an empty one",
            "load into a new SQLite file or an empty PostgreSQL database (createdb); to replace this namespace,"
            " remove it first (`irdma destroy`, or DROP DATABASE); nothing was changed")


def load(meta: MetaStore, reader: DumpReader, *, target: str | None = None,
         progress: Progress | None = None) -> Header:
    """Load the dump ``reader`` reads into ``meta``, an engine that holds a new, empty namespace
    (:func:`irdma.meta.open_meta` with ``create=True`` makes one).

    One write transaction: the target's tables are checked (every table and column of the dump
    must exist, of the same kind), it must be empty (the root directory and ``config`` only,
    which the dump's rows replace), every row is inserted in batches of :data:`PAGE_ROWS` as it
    is read, the id counters are set (SQLite ``sqlite_sequence``, PostgreSQL ``setval``), and
    only then is it committed. Tables of the target that the dump has not (newer than the dump)
    stay empty; :data:`TRANSIENT` tables are left alone.

    Args:
        meta: the target engine (left open).
        reader: the dump, its header already read.
        target: the target's URL as messages show it [default: ``meta.url``].
        progress: see :data:`Progress` (bytes: of the dump read so far).

    Returns:
        The dump's header.

    Raises:
        InvalidArgument: the target is not empty, lacks a table or column of the dump, or the
            dump is damaged or truncated; nothing was changed.
        IrdmaError: the database failed; nothing was changed (the transaction was rolled back).
    """
    header = reader.header
    url = target or str(getattr(meta, "url", "the target"))
    with _side(meta) as side:
        db_error = getattr(meta, "_DB_ERROR", Exception)
        try:
            side.begin_write(list(header.tables))
            committed = False
            try:
                _check_target(side, header, url)
                _check_empty(side, header, url)
                for name in header.tables:
                    side.execute(f"DELETE FROM {_quote(name)}")
                if progress:
                    progress(header, 0, reader.bytes_read)
                done = 0
                for t, rows in reader.tables():
                    cols = [c for c, _ in t.columns]
                    kinds = [k for _, k in t.columns]
                    batch: list[tuple[Any, ...]] = []
                    for n, row in enumerate(rows, 1):
                        try:
                            batch.append(tuple(decode_value(v, k) for v, k in zip(row, kinds, strict=True)))
                        except ValueError as exc:
                            raise InvalidArgument(f"{reader.name}: table {t.name}, row {n}: {exc}",
                                                  "the dump is damaged: use another copy; nothing was loaded") from None
                        if len(batch) >= PAGE_ROWS:
                            side.insert(t.name, cols, batch)
                            done += len(batch)
                            batch = []
                            if progress:
                                progress(header, done, reader.bytes_read)
                    if batch:
                        side.insert(t.name, cols, batch)
                        done += len(batch)
                    if progress:
                        progress(header, done, reader.bytes_read)
                for key, value in header.counters.items():
                    table, _, column = key.partition(".")
                    if table in header.tables:
                        side.set_counter(table, column, value)
                side.end(commit=True)
                committed = True
            finally:
                if not committed:
                    with contextlib.suppress(db_error):
                        side.end(commit=False)
        except db_error as exc:
            raise _failure(meta, exc, "load into") from None
    if progress:
        progress(header, header.rows, reader.bytes_read)
    return header
