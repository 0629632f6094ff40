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
from collections.abc import Callable, Iterator
from typing import IO, Any

from irdma._errors import InvalidArgument, IrdmaError

from .base import ROOT_INO, MetaStore
from .dump_sql import PAGE_ROWS, Side, engine_side, quote

#: The version of the format this module writes and the only one it reads.
FORMAT_VERSION = 1
#: The first key of a dump: tells a dump from any other JSON file.
MAGIC = "irdma_metadata_dump"
#: Tables a dump leaves out (see the module docstring), and a load leaves alone.
TRANSIENT = frozenset({"sessions", "open_files", "txids"})
#: The rows a new, empty namespace holds, which a load replaces: by table, an SQL condition
#: (``""``: every row). A target with any other row is not empty and a load refuses it.
NEW_NAMESPACE_ROWS = {"config": "", "inodes": f"ino = {ROOT_INO}"}
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


def _fits(value: Any, kind: str) -> bool:
    try:
        encode_value(value, kind)
    except TypeError:
        return False
    return True


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


def _failure(meta: MetaStore, exc: Exception, what: str) -> IrdmaError:
    """A database error of a dump or load as an IrdmaError naming the database."""
    url = getattr(meta, "url", "?")
    return IrdmaError(f"{what} {url}: {' '.join(str(exc).split())}",
                      "check that the database is reachable and writable, then run the command again")


def _dump_tables(side: Side) -> dict[str, Table]:
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


def _select(side: Side, t: Table) -> str:
    kinds = dict(t.columns)
    order = t.key or tuple(kinds)
    terms = [side.text_order(c) if kinds[c] == "text" else quote(c) for c in order]
    return (f"SELECT {', '.join(quote(c) for c, _ in t.columns)} FROM {quote(t.name)}"
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
    from irdma._version import __version__

    written = 0

    def emit(data: str) -> None:
        nonlocal written
        raw = data.encode("utf-8")
        out.write(raw)
        written += len(raw)

    with engine_side(meta) as side:
        db_error = getattr(meta, "_DB_ERROR", Exception)
        try:
            side.begin_snapshot()
            try:
                tables = _dump_tables(side)
                counters = {}
                for name, t in list(tables.items()):
                    n = int(side.execute(f"SELECT COUNT(*) FROM {quote(name)}").fetchone()[0])
                    tables[name] = dataclasses.replace(t, rows=n)
                    col = _counter_column(t)
                    if col is not None:
                        top = side.execute(f"SELECT MAX({quote(col)}) FROM {quote(name)}").fetchone()[0]
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
                            col = next(c for (c, k), v in zip(t.columns, row, strict=True)
                                       if not _fits(v, k))
                            raise IrdmaError(f"table {name}, row {n + 1} ({dict(zip(t.key, row, strict=False))}),"
                                             f" column {col}: {exc}", "irdma never writes such a value: fix or delete"
                                             " that row by hand (sqlite3, psql), then dump again") from None
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
def _check_target(side: Side, header: Header, url: str) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
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


def _check_empty(side: Side, header: Header, url: str) -> None:
    """Raise unless every table the dump fills holds nothing but what a new namespace has
    (:data:`NEW_NAMESPACE_ROWS`)."""
    held = []
    for name in header.tables:
        fresh = NEW_NAMESPACE_ROWS.get(name)
        if fresh == "":
            continue
        where = f" WHERE NOT ({fresh})" if fresh else ""
        n = int(side.execute(f"SELECT COUNT(*) FROM {quote(name)}{where}").fetchone()[0])
        if n:
            held.append(f"{n} {name}" + (" besides a new namespace's" if fresh else ""))
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
    with engine_side(meta) as side:
        db_error = getattr(meta, "_DB_ERROR", Exception)
        try:
            side.begin_write()
            committed = False
            try:
                _check_target(side, header, url)
                side.lock(list(header.tables))  # nobody writes them while they are checked and filled
                _check_empty(side, header, url)
                for name in header.tables:
                    side.execute(f"DELETE FROM {quote(name)}")
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
