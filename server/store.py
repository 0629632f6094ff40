"""A shard's data directory: its memory region, version table and chunk index on disk.

Layout of ``--data-dir DIR`` (one directory per shard)::

    shard.json   {"format": 2, "shard_id": N, "capacity": BYTES, "incarnation": U63,
                  "cluster_id": HEX}  (the cluster it belongs to, when it runs with a key)
    region       the memory region: a sparse file of ``capacity`` bytes, memory-mapped
                 MAP_SHARED; chunk bytes live at their region offset
    versions     the chunk version table: little-endian u64, one slot per 4 KiB page of the
                 region (slot = region offset // 4096), memory-mapped MAP_SHARED
    chunks.db    the chunk index (SQLite): (file id, chunk index) -> (region offset, chunk size,
                 extent size: the bytes of the region it holds from that offset, a size class
                 of :func:`irdma.server.region.extent_for`; 0 in rows of format 1: the whole
                 chunk); several keys at one offset share that extent (a snapshot's clone,
                 copied on the next write: :meth:`irdma.server.shard.Shard.clone`)
    moves.log    the moves journal: the keys moved to a copy-on-write copy or to a bigger
                 extent (a chunk that grew) since the index's last transaction, 44-byte records (:data:`MOVE_RECORD`), replayed into the
                 index when the shard opens the directory; empty after a clean close. A torn
                 tail (a cut record or zero records at the end: a machine crash in mid-append)
                 is dropped; a journal with any other bad record is kept as
                 ``moves.log.damaged`` (``.damaged.N``), and the chunks it may have moved are
                 refused (``lost`` in chunks.db, :meth:`ShardStore.lost`)

Why this layout: the region stays one contiguous mapping of plain memory, so the TCP path
copies straight into it and RDMA registers it as it did the anonymous region (one-sided
READs and WRITEs keep working, iRDMA's point); the page cache holds the bytes, so a shard
process that dies (SIGKILL) loses nothing, and ``sync`` (``msync(2)`` of both mappings,
``fsync`` of the index) makes them durable against a machine crash. The chunk index changes
when a chunk is created or freed (rare next to writes), so it is a small transactional
table rather than a log to replay. It also changes on the first write to each chunk after a
snapshot (copy-on-write moves the live key to a new extent): one SQLite transaction per move
cost 40 us of a shard's event loop, a third of the copy itself, so a move is an append to the
moves journal (one ``write(2)``, no fsync: it survives the process, like the region) that the
next index transaction folds in (the intent log of ZFS, the ZIL; the journal of ext4). Freed extents are punched out of the file
(``fallocate(2)`` FALLOC_FL_PUNCH_HOLE) some seconds after they are freed, if no chunk took them
meanwhile (:meth:`irdma.server.shard.Shard.trim`; at start for all free space), so free space
costs no disk for long; a new chunk's extent is punched again before use, so a crash between
the index and the region can never leave old bytes in a new chunk. Rejected: a file per chunk (no single region to
register for RDMA, one mmap per chunk), and an append-only log of writes (replay time grows
with the writes, not with the data).

The shard's *incarnation* is kept in ``shard.json``: a shard that restarts on its directory
comes back with the same incarnation, so clients see that nothing was lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import mmap
import os
import sqlite3
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence

from irdma._errors import IrdmaError

log = logging.getLogger("irdma.server")
PAGE = 4096
FORMAT = 2
#: Data formats this code opens: 1 (every extent a whole chunk) is upgraded to 2 in place (the
#: index gains its ``extent`` column) and is then no longer opened by an irdma of format 1.
FORMATS = (1, 2)
#: ``sync`` makes data durable (msync + fsync) in this mode; ``memory`` keeps it in the page
#: cache only (it survives the shard process, not the machine): for scratch data.
DURABILITY_MODES = ("fsync", "memory")

#: A moves-journal record: sequence number, file id, chunk index, new region offset, sizes
#: (little-endian u64 each: the chunk size in bytes in the low 32 bits, its extent's in the high
#: 32, 0 there for the whole chunk), then the CRC-32 (zlib) of those 40 bytes (u32). Records
#: whose sequence number is not past the index's ``journal.seq`` are in the index already.
_MOVE_BODY = struct.Struct("<QQQQQ")
MOVE_RECORD = struct.Struct(_MOVE_BODY.format + "I")
#: Moves the journal holds before :meth:`ShardStore.move_chunks` folds them into the index
#: itself (most are folded sooner, by the next clone, free or new chunk).
JOURNAL_FOLD = 4096

_RECORD = "INSERT OR REPLACE INTO chunks(file, idx, offset, size, extent) VALUES (?,?,?,?,?)"
#: A chunk-index row: (file id, chunk index, region offset, chunk size, extent size), bytes; the
#: extent may be left out, or 0, for the whole chunk.
Row = tuple[int, int, int, int] | tuple[int, int, int, int, int]


def _rows(chunks: Sequence[Row]) -> list[tuple[int, int, int, int, int]]:
    return [(r[0], r[1], r[2], r[3], (r[4:5] or (0,))[0]) for r in chunks]

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate ``[offset, offset+length)`` of a file: it reads as zeros (fallocate(2)).

    Raises:
        OSError: the filesystem cannot punch holes.
    """
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def allocate(fd: int, offset: int, length: int) -> bool:
    """Give ``[offset, offset+length)`` of a file its disk blocks now (fallocate(2) mode 0 with
    FALLOC_FL_KEEP_SIZE: blocks not written yet read as zeros, what was there stays). A page
    of a shared mapping whose block the filesystem cannot allocate at the first write kills
    the writer with SIGBUS; allocated ahead, a full disk is this call's ENOSPC instead.
    Returns False when the filesystem cannot allocate ahead (EOPNOTSUPP, ENOSYS).

    Raises:
        OSError: the disk has no room for the range (ENOSPC), or another failure.
    """
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, f"fallocate of {length} bytes failed: {os.strerror(err)}")
    return True


def is_hole(fd: int, offset: int, length: int) -> bool:
    """Whether ``[offset, offset+length)`` of a file holds no data: no block and no page the
    page cache holds for it (``lseek(2)`` SEEK_DATA, which counts delayed-allocation and dirty
    pages as data), so it reads as zeros with nothing to punch. False when the filesystem
    cannot tell (it then reports everything as data) or the call fails."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data at or past ``offset``: a hole to the end


def address_of(mm: mmap.mmap) -> int:
    """The address of a mapping (to register it with an RDMA device)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def stored_shard_id(path: str) -> int | None:
    """The shard id kept in the data directory ``path`` (its ``shard.json``), or None when the
    directory holds no shard yet.

    Raises:
        IrdmaError: ``shard.json`` is there but unreadable or damaged.
    """
    info_path = os.path.join(path, "shard.json")
    if not os.path.exists(info_path):
        return None
    try:
        with open(info_path) as f:
            return int(json.load(f)["shard_id"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IrdmaError(f"{info_path} is damaged or unreadable ({exc})", "restore it, or remove the directory") from None


class ShardStore:
    """Open (or create) a shard's data directory.

    Args:
        path: the directory (created if missing).
        shard_id: the shard's id; must match the directory's if it has one.
        capacity: region bytes (a multiple of 4096) for a new directory; for an existing one
            None (use its own) or the same value.
        durability: ``fsync`` or ``memory`` (see :data:`DURABILITY_MODES`).

    Raises:
        IrdmaError: the directory belongs to another shard, was made with another capacity or
            format, or cannot be created or mapped (the message says which and what to do).
    """

    def __init__(self, path: str, shard_id: int, capacity: int | None, durability: str = "fsync",
                 cluster_id: str | None = None) -> None:
        if durability not in DURABILITY_MODES:
            raise IrdmaError(f"unknown durability {durability!r}", f"use one of {', '.join(DURABILITY_MODES)}")
        self.path = os.path.abspath(path)
        self.durability = durability
        #: Free extents are punched out of the region file; an RDMA transport that registered
        #: the mapping turns this off: a punched page leaves the mapping while the device keeps
        #: the pinned old one, so the CPU and the device would see different bytes. Extents
        #: are then zeroed by writing zeros.
        self.punch = True
        #: New chunks' extents get their disk blocks ahead of their first writes
        #: (:func:`allocate`); turned off when the filesystem cannot.
        self.allocate = True
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise IrdmaError(f"cannot make the shard data directory {self.path}: {exc.strerror}",
                             "pass --data-dir a directory you can write") from None
        meta_path = os.path.join(self.path, "shard.json")
        self.fresh = not os.path.exists(meta_path)
        self._upgrade = False
        if self.fresh:
            if capacity is None:
                raise IrdmaError(f"{self.path} holds no shard", "pass --capacity to make a new one there")
            self.shard_id = shard_id
            self.capacity = capacity
            self.incarnation = (int.from_bytes(os.urandom(8), "big") >> 1) or 1
            self.cluster_id = cluster_id
        else:
            with open(meta_path) as f:
                try:
                    info = json.load(f)
                    fmt, sid, cap, inc = info["format"], info["shard_id"], info["capacity"], info["incarnation"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise IrdmaError(f"{meta_path} is damaged ({exc})", "restore it, or remove the directory") from None
            if fmt not in FORMATS:
                raise IrdmaError(f"{self.path} has data format {fmt}; this irdma reads formats"
                                 f" {', '.join(map(str, FORMATS))}", "open it with the irdma that made it")
            self._upgrade = fmt != FORMAT
            if sid != shard_id:
                raise IrdmaError(f"{self.path} holds shard {sid}, not shard {shard_id}",
                                 f"pass --shard-id {sid}, or another --data-dir")
            if capacity is not None and capacity != cap:
                raise IrdmaError(f"{self.path} holds a shard of {cap} bytes, not {capacity}",
                                 "leave out --capacity to use the shard's own")
            self.shard_id, self.capacity, self.incarnation = sid, cap, inc
            self.cluster_id = info.get("cluster_id")
            if cluster_id is not None and self.cluster_id is not None and cluster_id != self.cluster_id:
                raise IrdmaError(f"{self.path} holds a shard of cluster {self.cluster_id}, not of cluster {cluster_id}"
                                 " (the key file's)", "pass that cluster's --key-file, or another --data-dir")
            if cluster_id is not None and self.cluster_id is None:
                self.cluster_id = cluster_id
                self._write_info(meta_path)  # from now on it belongs to this cluster
        if self.capacity <= 0 or self.capacity % PAGE:
            raise IrdmaError(f"region capacity {self.capacity} must be a positive multiple of {PAGE}")
        try:
            self.region_fd, self.region = self._map("region", self.capacity)
            self.versions_fd, self.versions = self._map("versions", 8 * (self.capacity // PAGE))
            # a version may be written at any page: its blocks all now (8 bytes a page of the
            # region: 2 MiB a GiB), not a SIGBUS at the first version a full disk cannot hold
            allocate(self.versions_fd, 0, 8 * (self.capacity // PAGE))
        except OSError as exc:
            raise IrdmaError(f"cannot map the shard's files in {self.path}: {exc.strerror or exc}",
                             "check the disk has room and the directory is writable") from None
        self._db = sqlite3.connect(os.path.join(self.path, "chunks.db"), isolation_level=None, check_same_thread=False)
        self._db_lock = threading.Lock()  # sync() runs in a worker thread beside the event loop's calls
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives the process, and :meth:`sync` checkpoints it to disk; no
        # fsync per chunk created on the shard's event loop
        self._db.execute("PRAGMA synchronous=NORMAL")
        # checkpoints come with sync(); between them the WAL may grow to ~40 MB rather than
        # checkpoint every 4 MB on the event loop (copy-on-write records one row per chunk copied)
        self._db.execute("PRAGMA wal_autocheckpoint=10000")
        self._db.execute("CREATE TABLE IF NOT EXISTS chunks(file INTEGER NOT NULL, idx INTEGER NOT NULL,"
                         " offset INTEGER NOT NULL, size INTEGER NOT NULL, extent INTEGER NOT NULL DEFAULT 0,"
                         " PRIMARY KEY(file, idx))")
        if "extent" not in [r[1] for r in self._db.execute("PRAGMA table_info(chunks)")]:  # format 1
            self._db.execute("ALTER TABLE chunks ADD COLUMN extent INTEGER NOT NULL DEFAULT 0")
        # the moves journal: the last record folded into the index
        self._db.execute("CREATE TABLE IF NOT EXISTS journal(seq INTEGER NOT NULL)")
        # chunks the shard refuses to serve: a damaged moves-journal record may have moved them
        self._db.execute("CREATE TABLE IF NOT EXISTS lost(file INTEGER NOT NULL, idx INTEGER NOT NULL,"
                         " why TEXT NOT NULL, PRIMARY KEY(file, idx))")
        self._db.execute("CREATE TRIGGER IF NOT EXISTS lost_freed AFTER DELETE ON chunks BEGIN"
                         " DELETE FROM lost WHERE file = OLD.file AND idx = OLD.idx; END")  # a freed key is done
        row = self._db.execute("SELECT seq FROM journal").fetchone()
        if row is None:
            self._db.execute("INSERT INTO journal VALUES (0)")
        self._seq = int(row[0]) if row is not None else 0  # the last sequence number spent
        self._folded = self._seq  # the index's journal.seq: records up to it are in the index
        # (file id, chunk index, offset, size, extent, sequence number): in the journal, not yet in the index
        self._moves: list[tuple[int, int, int, int, int, int]] = []
        self._direct = False  # the journal failed: moves go to the index, one transaction each
        self._log_path = os.path.join(self.path, "moves.log")
        #: Where this open kept a damaged journal (None: the journal replayed whole).
        self.damaged_journal: str | None = None
        try:
            self._log_fd = os.open(self._log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            self._log_len = os.fstat(self._log_fd).st_size
            self._replay()
        except sqlite3.Error as exc:
            raise IrdmaError(f"cannot replay the moves journal {self._log_path} into {self.path}/chunks.db: {exc}",
                             "check the disk has room; the journal is kept until it replays") from None
        except OSError as exc:
            raise IrdmaError(f"cannot open the moves journal {self._log_path}: {exc.strerror or exc}",
                             "check the disk has room and the directory is writable") from None
        if self.fresh or self._upgrade:  # written last: a directory with shard.json is complete
            self._write_info(meta_path)

    def _write_info(self, meta_path: str) -> None:
        info: dict[str, object] = {"format": FORMAT, "shard_id": self.shard_id, "capacity": self.capacity,
                "incarnation": self.incarnation}
        if self.cluster_id is not None:
            info["cluster_id"] = self.cluster_id
        tmp = meta_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, meta_path)

    def _map(self, name: str, size: int) -> tuple[int, mmap.mmap]:
        fd = os.open(os.path.join(self.path, name), os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)  # sparse: costs no disk until written
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)

    # the chunk index
    def chunks(self) -> Iterator[tuple[int, int, int, int]]:
        """Every chunk as ``(file id, chunk index, region offset, chunk size)``."""
        for f, i, o, size, _ in self.extents():
            yield f, i, o, size

    def extents(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Every chunk as ``(file id, chunk index, region offset, chunk size, extent size)``
        (bytes; the extent is the chunk size in rows of format 1)."""
        for f, i, o, size, extent in self._db.execute("SELECT file, idx, offset, size, extent FROM chunks"):
            yield f, i, o, size, extent or size

    def add_chunk(self, file_id: int, chunk_index: int, offset: int, size: int, extent: int = 0) -> None:
        self.add_chunks([(file_id, chunk_index, offset, size, extent)])

    def add_chunks(self, chunks: Sequence[Row]) -> None:
        """Make new chunks ``(file id, chunk index, region offset, chunk size[, extent size])``
        (:data:`Row`): zero their extents (only those: the rest of a chunk holds nothing), then
        record them in the chunk index, all in one transaction. Disk I/O: a shard server calls
        it in a worker thread (the extents are reserved, nothing else touches them).

        Raises:
            OSError: an extent could not be zeroed. sqlite3.Error: the index could not be
                written. Nothing was recorded in either case.
        """
        rows = _rows(chunks)
        for _, _, offset, size, extent in rows:
            self._zero(offset, extent or size)  # a new chunk starts as zeros, whatever a crash left
            if not self.reserve(offset, extent or size):  # again: a punch above gave its blocks back
                raise OSError(errno.ENOSPC, f"no room on the disk for a new chunk of {extent or size} bytes")
        self.record_chunks(rows)

    def record_chunks(self, chunks: Sequence[Row]) -> None:
        """Record chunk keys (:data:`Row`) at extents whose
        bytes are already there (a snapshot's clone sharing an extent, or keys moved to a
        copy-on-write copy), in one transaction; the region is not touched.

        Raises:
            sqlite3.Error: the index could not be written; nothing was recorded.
        """
        with self._db_lock:
            self._transact(_RECORD, _rows(chunks))

    def move_chunks(self, keys: Sequence[tuple[int, int]], offset: int, size: int, extent: int = 0) -> None:
        """Record that chunk keys ``(file id, chunk index)`` of ``size`` bytes now live at the
        extent at ``offset`` (``extent`` bytes: a copy-on-write copy, or a bigger extent the
        chunk grew into, already written; 0: the whole chunk): one append to the moves
        journal, folded into the chunk index by its next transaction. It survives the shard
        process once this returns (the page cache holds it, as it holds the region); ``sync``
        makes it durable against a machine crash.

        Raises:
            OSError: the journal could not be written; nothing was recorded.
            sqlite3.Error: the journal was full and folding it failed, or the index could not be
                written; nothing was recorded.
        """
        with self._db_lock:
            if self._direct:
                self._transact(_RECORD, [(f, i, offset, size, extent) for f, i in keys])
                return
            if len(self._moves) >= JOURNAL_FOLD:
                self._transact(None, ())  # before the append: if it fails, nothing is recorded
            first = self._seq + 1
            self._seq += len(keys)  # spent, whatever happens below: a number is never used twice
            recs = bytearray()
            for n, (f, i) in enumerate(keys):
                body = _MOVE_BODY.pack(first + n, f, i, offset, size | extent << 32)
                recs += body + zlib.crc32(body).to_bytes(4, "little")
            try:
                if os.write(self._log_fd, recs) != len(recs):
                    raise OSError(28, "short write to the moves journal (disk full?)")
            except BaseException:
                # none of these records may replay: the caller frees the extent they name
                try:
                    os.ftruncate(self._log_fd, self._log_len)
                except OSError:
                    # they may stay in the journal: the index passes their numbers now, and
                    # the journal is not used again by this process
                    self._direct = True
                    self._transact(None, ())
                raise
            self._log_len += len(recs)
            self._moves.extend((f, i, offset, size, extent, first + n) for n, (f, i) in enumerate(keys))

    def unrecord_chunks(self, keys: Sequence[tuple[int, int]]) -> None:
        """Forget chunk keys ``(file id, chunk index)``, in one transaction; their bytes stay
        (the shard zeroes an extent no key holds any more later: :meth:`Shard.trim`)."""
        with self._db_lock:
            self._transact("DELETE FROM chunks WHERE file=? AND idx=?", keys)

    def _transact(self, sql: str | None, rows: Sequence[tuple[int | str, ...]], upto: int | None = None) -> None:
        """One index transaction (call with ``_db_lock`` held): the journal's moves folded in
        first (they came before; those numbered ``upto`` or less only, when given), and
        ``journal.seq`` past every number spent (or ``upto``), then ``sql`` for each of
        ``rows``; the journal is emptied once it commits and holds nothing unfolded. Raises
        sqlite3.Error (nothing changed: the moves stay journaled)."""
        seq = self._seq if upto is None else upto
        fold = self._moves if upto is None else [m for m in self._moves if m[5] <= upto]
        if sql is None and not fold and seq <= self._folded:
            return
        self._db.execute("BEGIN")
        try:
            if fold:
                self._db.executemany(_RECORD, [m[:5] for m in fold])
            if seq > self._folded:
                self._db.execute("UPDATE journal SET seq=?", (seq,))
            if sql is not None:
                self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._folded = max(self._folded, seq)
        del self._moves[: len(fold)]  # (a prefix: numbered in order)
        if not self._moves and self._log_len:
            self._truncate_log()

    def _truncate_log(self) -> None:
        """Empty the journal once the index has its records (a failure is harmless: what is
        left has sequence numbers the index passed, so it never replays; later records go
        after it)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._log_fd, 0)
            self._log_len = 0

    def lost(self) -> dict[tuple[int, int], str]:
        """The chunk keys ``(file id, chunk index)`` the shard must refuse to serve (a damaged
        moves-journal record may have moved them: their bytes in the index may be a snapshot's,
        not theirs), each with why. Kept until the key is freed or replaced whole
        (:meth:`forget_lost`)."""
        with self._db_lock:
            rows = self._db.execute("SELECT l.file, l.idx, l.why FROM lost l JOIN chunks c"
                                    " ON c.file = l.file AND c.idx = l.idx").fetchall()
        return {(int(f), int(i)): str(why) for f, i, why in rows}

    def forget_lost(self, keys: Sequence[tuple[int, int]]) -> None:
        """Serve chunk keys ``(file id, chunk index)`` again (their bytes were replaced whole, or
        they were freed), in one transaction.

        Raises:
            sqlite3.Error: the index could not be written; nothing changed.
        """
        with self._db_lock:
            self._transact("DELETE FROM lost WHERE file=? AND idx=?", keys)

    def _replay(self) -> None:
        """Fold into the index the journal's records past ``journal.seq`` (moves made after the
        index's last transaction by a shard process that then died), then empty the journal.

        A torn tail is what a machine crash in mid-append leaves: a record cut short, or whole
        records of zero bytes (the file grew, its data never came) after the last good one;
        it is dropped, with a warning. A SIGKILL cannot tear one ``write(2)``, so any other
        record with a bad CRC-32 is damage (a flipped bit, a bad block), wherever it is: the
        last record and a journal of bad records only too (a zero record before a good one as
        well). It names a move that cannot be read, so the key it moved would read its old
        extent (a snapshot's bytes) as if no write had been acknowledged since. Then the good
        records are folded in, the journal is copied whole to ``moves.log.damaged`` first (the
        evidence, never truncated), and every key the damaged records may have moved is
        recorded as lost (:meth:`lost`): the keys that share an extent in the index (a
        copy-on-write move is of a key sharing its extent, and the keys it left keep that
        extent; which one moved cannot be told) and the keys whose extent is smaller than their
        chunk (a growth moves a key alone to a bigger extent). A damaged record is taken as past ``journal.seq`` unless a good
        record after it shows it is not (numbers rise by at least one a record): one older
        than that (a journal left unemptied) changes nothing.

        Raises:
            OSError: the damaged journal could not be copied (nothing was changed: the next
                open tries again). sqlite3.Error: the index could not be written.
        """
        data = os.pread(self._log_fd, self._log_len, 0) if self._log_len else b""
        size = MOVE_RECORD.size
        recs = [MOVE_RECORD.unpack_from(data, pos) for pos in range(0, len(data) - size + 1, size)]
        good = [zlib.crc32(data[n * size : n * size + _MOVE_BODY.size]) == r[5] for n, r in enumerate(recs)]
        last = max((n for n, ok in enumerate(good) if ok), default=-1)
        folded = self._seq
        damaged: list[int] = []  # record numbers
        torn = len(data) - len(recs) * size  # a record cut short
        following = None  # the next good record's number, walking back
        for n in range(len(recs) - 1, -1, -1):
            if good[n]:
                following = n
            elif following is None and not any(data[n * size : (n + 1) * size]):
                torn += size  # zeros after the last good record: a crash before the data came
            elif following is None or recs[following][0] - (following - n) > folded:
                damaged.append(n)  # its number may be past the index's: a move the index lacks
        moves = []
        for n in range(last + 1):
            seq, f_id, idx, offset, sizes, _ = recs[n]
            if good[n] and seq > self._seq:
                size = sizes & 0xFFFFFFFF
                moves.append((f_id, idx, offset, size, sizes >> 32 or size, seq))
                self._seq = seq
        if torn:
            log.warning("%s: dropped a torn tail of %d bytes (a cut record or zeros after the last good one: a"
                        " crash in mid-append; the moves it held were never flushed)", self._log_path, torn)
        lost: list[tuple[int, int, str]] = []
        if damaged:
            self.damaged_journal = self._keep_damaged(data)
            why = (f"record {min(damaged)} of the moves journal is damaged (kept as {self.damaged_journal}):"
                   " this chunk may have been moved to a copy the index does not know")
            lost = [(f, i, why) for f, i in self._sharing(moves)]
            log.error("%s: %d damaged records (records %s of %d, numbered from 0); the journal is kept as %s;"
                      " %d chunks that a lost move may have left on a snapshot's bytes are refused (DataLost)",
                      self._log_path, len(damaged), sorted(damaged), len(recs), self.damaged_journal, len(lost))
        self._moves = moves
        with self._db_lock:
            self._transact("INSERT OR REPLACE INTO lost VALUES (?,?,?)" if lost else None, lost)
        if self._log_len:
            self._truncate_log()

    def _sharing(self, moves: Sequence[tuple[int, int, int, int, int, int]]) -> list[tuple[int, int]]:
        """The keys that share an extent, or hold less than their chunk, in the index with
        ``moves`` folded in: the keys a lost move may have moved."""
        where = {(int(f), int(i)): (int(o), int(n), int(e) or int(n))
                 for f, i, o, n, e in self._db.execute("SELECT file, idx, offset, size, extent FROM chunks")}
        where.update({(f, i): (o, n, e) for f, i, o, n, e, _ in moves})
        at: dict[int, list[tuple[int, int]]] = {}
        for key, (offset, _, _) in where.items():
            at.setdefault(offset, []).append(key)
        small = {k for k, (_, n, e) in where.items() if e < n}
        return sorted({k for keys in at.values() if len(keys) > 1 for k in keys} | small)

    def _keep_damaged(self, data: bytes) -> str:
        """Copy a damaged journal beside it (``moves.log.damaged``, or ``.damaged.N`` if that
        is taken), fsynced; returns its path. Raises OSError."""
        path, n = self._log_path + ".damaged", 1
        while os.path.exists(path):
            with open(path, "rb") as f:
                if f.read() == data:
                    return path  # kept by an open that died before the index took the loss
            path, n = f"{self._log_path}.damaged.{n}", n + 1
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def written(self, offset: int, size: int) -> list[tuple[int, int]]:
        """The pages of ``[offset, offset+size)`` of the region (page-aligned) that hold a byte
        other than zero, as ``(start, size)`` runs, neighbours merged. Holes of the region file
        are skipped unread (``SEEK_DATA``); a shard reads the rest once, at an open that kept a
        damaged moves journal (:meth:`irdma.server.shard.Shard.hold`)."""
        out: list[tuple[int, int]] = []
        end, pos = offset + size, offset
        block = 1 << 20
        zeros = bytes(block)
        while pos < end:
            try:
                start = os.lseek(self.region_fd, pos, os.SEEK_DATA)
                stop = min(end, os.lseek(self.region_fd, start, os.SEEK_HOLE))
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # a hole from pos to the end of the file
                start, stop = pos, end  # no SEEK_DATA on this filesystem: read it all
            if start >= end:
                break
            start -= start % PAGE
            stop = min(end, stop + -stop % PAGE)
            for at in range(start, stop, block):
                n = min(block, stop - at)
                if self.region[at : at + n] == zeros[:n]:
                    continue
                for page in range(at, at + n, PAGE):
                    if self.region[page : page + PAGE] != zeros[:PAGE]:
                        if out and sum(out[-1]) == page:
                            out[-1] = (out[-1][0], out[-1][1] + PAGE)
                        else:
                            out.append((page, PAGE))
            pos = stop
        return out

    def reserve(self, offset: int, size: int) -> bool:
        """Give ``[offset, offset+size)`` of the region its disk blocks before anything writes
        there (:func:`allocate`): every extent a chunk takes is reserved so, and a full disk is
        an error for the request that wanted the extent, never a SIGBUS that stops the shard
        in the middle of a copy. Returns False when the disk has no room (ENOSPC; nothing that
        matters was allocated: the range stays free). A no-op (True) on a filesystem that
        cannot allocate ahead, and on a region an RDMA transport registered (its pages are
        pinned, so held already).

        Raises:
            OSError: another failure of fallocate(2).
        """
        if self.punch and self.allocate:
            try:
                self.allocate = allocate(self.region_fd, offset, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    return False
                raise
        return True

    def zero(self, offset: int, size: int) -> None:
        """Make ``[offset, offset+size)`` of the region read as zeros (a hole punched in the
        region file, or zeros written where holes cannot be punched)."""
        self._zero(offset, size)

    def _zero(self, offset: int, size: int) -> None:
        if self.punch:
            # a hole already (a fresh region, a trimmed extent): nothing to punch. A punch takes
            # the file's invalidate lock, which stops every page fault on the region (the event
            # loop's writes into other chunks) while it waits for the journal: seconds when the
            # kernel writes back gigabytes (make bench's 1.5 GiB drain on a slow disk)
            if not is_hole(self.region_fd, offset, size):
                punch_hole(self.region_fd, offset, size)
            return
        zeros = bytes(min(size, 1 << 20))
        for pos in range(offset, offset + size, len(zeros)):
            n = min(len(zeros), offset + size - pos)
            self.region[pos : pos + n] = zeros[:n]

    def sync(self) -> None:
        """Make every byte written so far durable (no-op with durability ``memory``)."""
        if self.durability == "fsync":
            with self._db_lock:
                upto = self._seq  # the moves whose bytes the flush below has (written before them)
            self.region.flush()
            self.versions.flush()
            with self._db_lock:
                self._transact(None, (), upto)  # those moves into the index, after their bytes
            # the chunk index durable: its write-ahead log fsynced (every commit so far is in it;
            # SQLite fsyncs the database itself at each checkpoint, synchronous=NORMAL), outside
            # the index's lock: a checkpoint's fsyncs held it, and the event loop's own index
            # writes (a chunk's move, a free) with it, for seconds when the disk was busy
            wal = os.path.join(self.path, "chunks.db-wal")
            try:
                fd = os.open(wal, os.O_RDONLY)
            except FileNotFoundError:  # no log yet: every commit is in the database file
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Unmap and close (safe twice). Bytes already written stay in the files; the moves
        journal is folded into the chunk index (left for the next open if that fails)."""
        if self._db is not None:
            try:
                with self._db_lock:
                    self._transact(None, ())
            except sqlite3.Error:
                pass
            os.close(self._log_fd)
            self._db.close()
            self._db = None  # type: ignore[assignment]
            for mm, fd in ((self.region, self.region_fd), (self.versions, self.versions_fd)):
                try:
                    mm.close()
                except BufferError:  # a view is still exported (RDMA registration): the OS unmaps at exit
                    pass
                os.close(fd)
