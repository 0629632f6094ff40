"""The mount's data caching: write-behind, read-ahead, and the residuals of compressed pushes.

:mod:`irdma.fs.operations` translates POSIX requests; the bytes of every file open on the mount
go through the objects here: one :class:`WriteBehind` and one :class:`ReadAhead` per open file
(made at its first open, dropped at its last close), one :class:`Residuals` per mount. They hold
bytes in flight and bytes read ahead, never the file's truth: the size and chunk map a drain
records in the metadata engine, and the bytes the shards acknowledged, are that.

* Write-behind (:class:`WriteBehind`): a ``write`` hands its bytes to a task that pushes them to
  the shards (:meth:`WriteBehind.push`) and returns at once; at most ``MAX_INFLIGHT_WRITES``
  pushes per file are in flight, then a write waits for a slot. Writes of ``assign`` smaller
  than ``GATHER_WRITE_MAX`` are first *gathered* (:class:`Gather`, as the kernel's page cache gathers dirty pages): a write that
  starts inside or at the end of a gathered byte range of its file joins it (overwriting in place
  what it covers), and the range is pushed as one request once it reaches the end of its aligned
  block of ``GATHER_BYTES`` (the chunk size when smaller), so ``dd bs=4k`` sends 4 MiB pushes,
  several in flight together. A gathered range is also pushed when a write that cannot join it
  overlaps it, when its file starts a ``GATHERS_PER_FILE``-th one (the oldest goes), when a read
  through any handle of this mount (or a read-ahead fetch) overlaps it, at every drain, when it
  is ``GATHER_AGE_S`` old (:meth:`WriteBehind.flush_older_than`), and when the mount's gathered
  and gathered-in-flight bytes would pass ``MOUNT_WRITE_BYTES`` (:class:`WriteBudget`: a write
  waits for pushes to end, pushing the oldest gathered ranges first when none is in flight). A
  gathered write is acknowledged at once, like any write-behind write, and its errors come as a
  push's do (below). A push is a :class:`Pending`
  byte range ``[start, end)`` of the file until its shards acknowledged it or it failed, and it
  leaves its record for the next *drain* (``flush`` at every ``close``, ``fsync``, the last
  ``release``, a truncate): the end of an acknowledged push, the chunks it created, the offset of
  a failed one. A drain waits for every push, persists the size of what the shards acknowledged
  (never a byte past a failed push) and the chunks created, and forgets only the records the
  metadata engine now has (:meth:`WriteBehind.seen`, then :meth:`WriteBehind.forget`).
* Read-ahead (:class:`ReadAhead`), as the kernel's on-demand read-ahead (mm/readahead.c): per open
  handle, a read that starts where the handle's last one ended is *sequential*. A sequential read
  is served from aligned windows (a power of two of bytes, aligned to its size) that start at
  ``READAHEAD_MIN`` and double with every sequential hit up to ``READAHEAD_WINDOW``, and the next
  window is fetched while the kernel consumes this one (the next ``READAHEAD_DEPTH`` together
  once the windows are full-size). Any other read (random, strided) is one
  exact pull of the bytes asked for, unless a window already holds them. At most
  ``READAHEAD_BYTES`` of windows are kept per file, the oldest dropped first. Windows and exact
  pulls go through :meth:`irdma.Client.read_into`, so a mount with a local read cache
  (``--cache-dir``, ``--cache-memory``: :mod:`irdma.client.cache`) serves them from it.
* Residuals (:class:`Residuals`), error feedback of compressed pushes (Applied Sciences 2020's
  local residual cache; :mod:`irdma.wire.compress`): one residual per inode, float32, element ``i``
  for bytes ``[4i, 4i+4)`` of the file, made on the first compressed write and grown (zeros) to
  cover what is written. A write of gradient ``g`` (little-endian float32) at byte ``off`` pushes
  ``g + residual[off/4 : ...]`` and keeps what the compression dropped in its place, so error
  feedback works through plain ``pwrite``. The residual of a write that failed is left as it was
  (the write's error is reported as for any push). It lives as long as the kernel knows the
  inode (dropped at ``forget``, or once the file has no name left): across opens and closes, not
  across mounts.

Invariants.

* A buffer handed to a transfer is not reused before its completion. A push owns the bytes of
  its write (pyfuse3's ``bytes``, or a new float32 array when compressed, with a copy of the
  residual it started from) until it ends; a read-ahead window is a new buffer that ``read_into``
  fills and that is never written after its fetch (read replies slice it: pyfuse3 copies a reply
  at once); an exact read pulls into a new buffer of its own.
* Overlapping writes stay in order: a write that is not gathered first pushes the gathered
  ranges it overlaps and waits for every push in flight that overlaps it before it is admitted
  (under the file's ``admit`` lock, which also orders writes against the clearing of a gap), so
  its residual and its bytes land after theirs. A gathered write pushes every other gathered range
  it overlaps (gathered ranges of a file never overlap), and a gathered range's push waits for
  every push admitted before it that it overlaps, so a newer byte never lands first. A read
  pushes the gathered ranges it overlaps and waits for the pushes it overlaps, and a window's
  fetch does so for its window: this mount reads its writes, through any handle.
* No window outlives a write: every write, truncate and open invalidates the file's windows and
  its fetches in flight (:meth:`ReadAhead.invalidate`), so a read issued after a write never
  joins a fetch that may have read the shards before the write landed.
* Errors are reported errseq-style (Linux's ``errseq_t``). A failed push is the file's ``error``
  (the first one since the last drain: a later write fails with it, and it is kept) and is told
  to every handle open for writing at that moment, which hears of it at its next flush, fsync or
  close however many other handles drain the file first. FUSE_FLUSH (every ``close`` of any
  descriptor of the open file, also one a forked child inherited) reports it and keeps it, as
  ``filemap_check_wb_err``; only ``fsync`` forgets it, as ``file_check_and_advance_wb_err``. See
  :meth:`irdma.fs.operations.IrdmaFS._drain`, ``_tell_writers`` and ``_sync``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from irdma._errors import Busy, IrdmaError, MetadataError
from irdma.client.native import ChunkMap, Client, NewChunk
from irdma.placement import Layout
from irdma.wire.compress import Compression
from irdma.wire.protocol import Update

log = logging.getLogger("irdma.fs")

#: Write requests in flight per file before a write waits.
MAX_INFLIGHT_WRITES = 64
#: Bytes of the aligned block one gathered range of adjacent writes fills before it is pushed as
#: one request (a file's chunk size when smaller: a gathered push is one chunk's part).
GATHER_BYTES = 4 << 20
#: Bytes from which a write is pushed alone, never gathered: its request's cost is small beside
#: its bytes, and pushes of its size in flight together beat one larger push (FUSE's largest
#: request is 1 MiB: ``--direct-io`` and O_DIRECT writers send that).
GATHER_WRITE_MAX = 256 << 10
#: Gathered ranges one file holds at once (one per stream of writes): a write that starts another
#: pushes the oldest. With GATHER_BYTES, at most about 4 x (4 MiB + one write) gathered per file.
GATHERS_PER_FILE = 4
#: Seconds a gathered range waits for more writes before it is pushed anyway.
GATHER_AGE_S = 1.0
#: Bytes gathered, or being pushed from gathered ranges, on one mount (all files together).
MOUNT_WRITE_BYTES = 64 << 20
#: Bytes of the first read-ahead window of a sequential read (it doubles with every hit).
READAHEAD_MIN = 128 << 10
#: Bytes of the largest read-ahead window.
READAHEAD_WINDOW = 4 << 20
#: Bytes of windows kept per open file (the oldest dropped first).
READAHEAD_BYTES = 6 * READAHEAD_WINDOW
#: Full-size windows fetched ahead of a sequential read, together (a large file's chunks lie on
#: different shards, so they are pulled in parallel). ``dd bs=4M`` of 100 MiB through a page-cache
#: mount, 4 shards, alternated A/B in one run: 958-982 MB/s (median) with 1, 1185-1276 with 3.
READAHEAD_DEPTH = 3


class Residuals:
    """The residuals of compressed pushes on this mount, per inode (see the module docstring).

    Each is a float32 array (native byte order), element ``i`` for bytes ``[4i, 4i+4)`` of the
    file.
    """

    def __init__(self) -> None:
        self._by_ino: dict[int, np.ndarray] = {}

    def grown(self, ino: int, elements: int) -> np.ndarray:
        """The residual of ``ino``, grown (zeros) to at least ``elements``."""
        res = self._by_ino.get(ino)
        if res is None or len(res) < elements:
            grown = np.zeros(max(elements, 0 if res is None else len(res) + len(res) // 2), dtype=np.float32)
            if res is not None:
                grown[: len(res)] = res
            res = self._by_ino[ino] = grown
        return res

    def add_to(self, ino: int, off: int, buf: bytes) -> tuple[np.ndarray, np.ndarray]:
        """``(g + residual, residual)`` over the bytes ``[off, off + len(buf))`` of ``ino``:
        what a compressed push of gradient ``buf`` (little-endian float32; ``off`` and its
        length multiples of 4) sends, and a copy of the residual there as it is now (the
        push's ``feedback``)."""
        end = off + len(buf)
        res = self.grown(ino, end // 4)
        data = np.frombuffer(buf, dtype="<f4") + res[off // 4 : end // 4]
        return data, res[off // 4 : end // 4].copy()

    def keep(self, ino: int, off: int, end: int, feedback: np.ndarray) -> None:
        """Make ``feedback`` the residual of bytes ``[off, end)`` of ``ino``."""
        self.grown(ino, end // 4)[off // 4 : end // 4] = feedback

    def drop(self, ino: int) -> None:
        """Forget the residual of ``ino`` (the kernel forgot the inode, or it has no name left)."""
        self._by_ino.pop(ino, None)


@dataclass
class Pending:
    """One push in flight: bytes ``[start, end)`` of the file. ``done`` is set once the shards
    acknowledged it or it failed, its record and its residual kept."""

    start: int
    end: int
    done: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False)
class Gather:
    """Adjacent writes of ``assign`` gathered into one push: bytes ``[start, start + len(buf))``
    of the file, pushed with ``op`` once they reach ``limit`` (the end of the aligned block of
    ``GATHER_BYTES``, or of the chunk, that ``start`` is in). ``born``: :func:`trio.current_time`
    of its first write."""

    start: int
    limit: int
    op: Update
    born: float
    buf: bytearray = field(default_factory=bytearray)

    @property
    def end(self) -> int:
        return self.start + len(self.buf)


class WriteBudget:
    """The bytes one mount's gathered writes hold, gathered or being pushed, all files together,
    at most ``limit`` (``MOUNT_WRITE_BYTES``): a write that would pass it waits (see
    :meth:`take`).

    Args:
        limit: bytes.
    """

    def __init__(self, limit: int = MOUNT_WRITE_BYTES) -> None:
        self.limit = limit
        self.used = 0  # bytes gathered or in flight from gathered ranges
        self.gathered = 0  # of those, bytes gathered and not yet pushed
        #: the write-behinds holding gathered ranges, the one that began gathering first first
        self.holders: dict[WriteBehind, None] = {}
        self._freed = trio.Event()

    async def take(self, n: int) -> None:
        """Count ``n`` more bytes (a write about to be gathered), once they fit: while they do
        not, wait for a gathered push to end, pushing every gathered range of the oldest holder
        first when nothing is in flight (else nothing would end). Every push has the client's
        request deadline, so the wait ends."""
        while self.used and self.used + n > self.limit:
            if self.used == self.gathered and self.holders:
                next(iter(self.holders)).flush_gathers()
                continue
            freed = self._freed
            await freed.wait()
        self.used += n
        self.gathered += n

    def take_nowait(self, n: int) -> bool:
        """Count ``n`` more bytes if they fit now (True), else nothing (False)."""
        if self.used and self.used + n > self.limit:
            return False
        self.used += n
        self.gathered += n
        return True

    def untake(self, n: int) -> None:
        """Give back ``n`` bytes :meth:`take` counted that no gathered range holds (a write
        that overwrote gathered bytes in place)."""
        self.used -= n
        self.gathered -= n

    def pushing(self, n: int) -> None:
        """``n`` gathered bytes are being pushed now."""
        self.gathered -= n

    def pushed(self, n: int) -> None:
        """The push of ``n`` gathered bytes ended (acknowledged or failed): wake the writers
        waiting for room."""
        self.used -= n
        self._freed.set()
        self._freed = trio.Event()


@dataclass(frozen=True)
class Seen:
    """What a drain saw of a file's write-behind records (:meth:`WriteBehind.seen`): the
    first ``acked``, ``new`` and ``failed`` of them, and ``writes`` admitted so far."""

    writes: int
    acked: int
    new: int
    failed: int
    #: bytes: the file's size as the shards acknowledged it (the persisted size, or the end of
    #: an acknowledged push, never one past a failed push)
    size: int
    #: the chunks created: ``(chunk index, shard, incarnation)``
    chunks: tuple[NewChunk, ...]


class WriteBehind:
    """The pushes of one open file: in flight, and their records since the last drain.

    Args:
        client: the mount's client; pushes go through it.
        layout: the file's layout.
        chunks: the file's chunk map as this mount knows it, shared with the mount's file state
            (a push that creates chunks adds them in place).
        residuals: the mount's residuals (a compressed push keeps what its compression dropped).
        tell_writers: called with ``(inode, error)`` when a push fails: every handle of the
            file open for writing hears of it (errseq).
        budget: the mount's :class:`WriteBudget` (None: gathered bytes are not counted).
        nursery: the nursery that runs the pushes of gathered ranges (the mount's), looked up
            at each push.
    """

    def __init__(self, client: Client, layout: Layout, chunks: ChunkMap, residuals: Residuals,
                 tell_writers: Callable[[int, IrdmaError], None], budget: WriteBudget | None = None,
                 nursery: Callable[[], trio.Nursery | None] = lambda: None) -> None:
        self.client = client
        self.layout = layout
        self.chunks = chunks
        self.residuals = residuals
        self._tell_writers = tell_writers
        self.pending: list[Pending] = []  # pushes in flight, in the order they were admitted
        self.error: IrdmaError | None = None  # the first push that failed since the last drain
        self.new_chunks: list[NewChunk] = []  # created since the last drain
        self.acked_ends: list[int] = []  # ends of pushes acknowledged since then
        self.failed_starts: list[int] = []  # offsets of pushes that failed since then
        self.writes = 0  # writes admitted so far (a drain knows whether one came in while it persisted)
        self.persist = trio.Lock()  # one drain records the size and chunks at a time
        self.slots = trio.Semaphore(MAX_INFLIGHT_WRITES)
        self.admit = trio.Lock()  # orders writes against gap clearing
        self.gathers: list[Gather] = []  # gathered ranges not pushed yet, disjoint, oldest first
        self.gather_bytes = min(GATHER_BYTES, layout.chunk_size)
        self.budget = budget
        self._nursery = nursery

    async def wait_all(self) -> None:
        """Push every gathered range, then wait until no push of the file is in flight (those
        admitted meanwhile too)."""
        self.flush_gathers()
        while self.pending:
            await self.pending[0].done.wait()

    async def settle(self, start: int, end: int) -> None:
        """Make bytes ``[start, end)`` readable from the shards as this mount wrote them: push
        the gathered ranges that overlap them, then wait for every push that does."""
        for g in [g for g in self.gathers if g.start < end and start < g.end]:
            self._push_gather(g)
        await self.wait_overlapping(start, end)

    async def gather(self, off: int, buf: bytes, op: Update) -> None:
        """Gather a write of ``buf`` at ``off`` with update op ``op`` (``assign``): into the
        gathered range it starts inside or at the end of, else a new one (see the module
        docstring); push what it fills. Waits only for room in the mount's budget."""
        if self.budget is not None:
            await self.budget.take(len(buf))
        self._gather(off, buf, op)

    def gather_nowait(self, off: int, buf: bytes, op: Update) -> bool:
        """:meth:`gather` if the mount's budget has room now (True), else nothing (False)."""
        if self.budget is not None:
            if not self.budget.take_nowait(len(buf)):
                return False
        self._gather(off, buf, op)
        return True

    def _gather(self, off: int, buf: bytes, op: Update) -> None:
        """Gather a write whose bytes the budget counted already (see :meth:`gather`)."""
        n = len(buf)
        end = off + n
        into = None
        for g in list(self.gathers):
            if into is None and g.start <= off <= g.end and off < g.limit and g.op == op:
                into = g
            elif g.start < end and off < g.end:  # overlapped: its bytes are older, pushed first
                self._push_gather(g)
        if into is None:
            if len(self.gathers) >= GATHERS_PER_FILE:
                self._push_gather(self.gathers[0])
            into = Gather(off, off - off % self.gather_bytes + self.gather_bytes, op, trio.current_time())
            if not self.gathers and self.budget is not None:
                self.budget.holders[self] = None
            self.gathers.append(into)
        before = len(into.buf)
        rel = off - into.start
        into.buf[rel : rel + n] = buf  # in place where it overlaps, the rest appended
        if self.budget is not None:
            self.budget.untake(n - (len(into.buf) - before))
        self.writes += 1
        if into.end >= into.limit:
            self._push_gather(into)

    def flush_gathers(self) -> None:
        """Push every gathered range of the file now (the pushes run in the mount's nursery)."""
        for g in list(self.gathers):
            self._push_gather(g)

    def flush_older_than(self, born: float) -> None:
        """Push the gathered ranges whose first write came before ``born`` (trio time)."""
        for g in [g for g in self.gathers if g.born < born]:
            self._push_gather(g)

    def _push_gather(self, g: Gather) -> None:
        """Admit the push of gathered range ``g`` (a :class:`Pending` at once: reads and drains
        wait for it) and start it in the mount's nursery."""
        nursery = self._nursery()
        assert nursery is not None, "gathered writes need the mount's nursery"
        self.gathers.remove(g)
        if not self.gathers and self.budget is not None:
            self.budget.holders.pop(self, None)
        entry = Pending(g.start, g.end)
        self.pending.append(entry)
        if self.budget is not None:
            self.budget.pushing(len(g.buf))
        nursery.start_soon(self._push_gathered, entry, g)

    async def _push_gathered(self, entry: Pending, g: Gather) -> None:
        """Push gathered range ``g`` (``entry``) after every push admitted before it that it
        overlaps (its bytes are newer), in a slot; :meth:`push` records how it ended."""
        started = False
        try:
            for p in self.pending[: self.pending.index(entry)]:
                if p.start < entry.end and entry.start < p.end:
                    await p.done.wait()
            await self.slots.acquire()
            started = True
            await self.push(entry, g.start, memoryview(g.buf), g.op)
        finally:
            if not started:  # cancelled before it was sent (the mount ends): nothing to record
                self.pending.remove(entry)
                entry.done.set()
            if self.budget is not None:
                self.budget.pushed(len(g.buf))

    async def wait_overlapping(self, start: int, end: int) -> None:
        """Wait for every push in flight now that overlaps bytes ``[start, end)``."""
        for p in list(self.pending):
            if p.start < end and start < p.end:
                await p.done.wait()

    async def admit_push(self, start: int, end: int) -> Pending:
        """Take a slot (waits while ``MAX_INFLIGHT_WRITES`` pushes are in flight) and record a
        push of bytes ``[start, end)``; :meth:`push` it next, at once."""
        await self.slots.acquire()
        entry = Pending(start, end)
        self.pending.append(entry)
        self.writes += 1
        return entry

    async def push(self, entry: Pending, off: int, buf: bytes | memoryview | np.ndarray, op: Update,
                   coded: Compression | None = None, feedback: np.ndarray | None = None) -> None:
        """Push one write (``entry``, admitted by :meth:`admit_push`; bytes ``buf`` at ``off``)
        with update op ``op``, then record how it ended. ``coded``: compressed, what its
        compression dropped put in ``feedback`` (the inode's residual over the write's range as
        it was: a piece that failed keeps it), which becomes the residual there before the write
        counts as done. Never raises: a failure is logged, recorded and told to the writers (a
        bug fails as ``IrdmaError("internal error: ...")``)."""
        try:
            created = await self.client.write_from(self.layout, off, buf, op, self.chunks, compress=coded,
                                                   feedback=feedback)
            for idx, shard, incarnation in created:
                self.chunks.setdefault(idx, {}).setdefault(shard, incarnation)
            self.new_chunks.extend(created)
            self.acked_ends.append(entry.end)
        except Exception as exc:
            if isinstance(exc, IrdmaError):
                log.warning("push of %d bytes at %d to file %d failed: %s", entry.end - off, off, self.layout.file_id,
                            exc)
                err = exc
                if isinstance(exc, Busy):
                    # a metadata write on the push's path (a replica withdrawn, a shard's
                    # incarnation noted) found the engine locked: these bytes are lost, not
                    # kept for a retry. EBUSY from a drain means its records wait for the next
                    # drain (nothing lost): a caller retries on it, and the fsync after that
                    # returns 0 (errseq), so a lost push must never be told as EBUSY
                    err = MetadataError(f"push of {entry.end - off} bytes at {off} to file {self.layout.file_id}"
                                        f" failed and is lost: {exc}", "write those bytes again")
            else:  # a bug: this push fails, the mount lives on
                log.exception("push of %d bytes at %d to file %d failed unexpectedly", entry.end - off, off,
                              self.layout.file_id)
                err = IrdmaError(f"internal error: {exc!r}")
            self.failed_starts.append(off)
            if self.error is None:
                self.error = err
            self._tell_writers(self.layout.file_id, err)
        finally:
            if feedback is not None:  # what the compression dropped waits for the next write
                self.residuals.keep(self.layout.file_id, off, entry.end, feedback)
            self.pending.remove(entry)
            entry.done.set()
            self.slots.release()

    def seen(self, persisted_size: int) -> Seen:
        """What a drain records now: the records so far, and the size they give a file whose
        metadata says ``persisted_size`` bytes. Pushes that end later append after them."""
        n_acked, n_new, n_failed = len(self.acked_ends), len(self.new_chunks), len(self.failed_starts)
        acked = self.acked_ends[:n_acked]
        if n_failed:  # never count bytes past a failed push
            fail = min(self.failed_starts[:n_failed])
            acked = [e for e in acked if e <= fail]
        # each new chunk once: concurrent pushes into one new chunk each report it
        return Seen(self.writes, n_acked, n_new, n_failed, max([persisted_size, *acked]),
                    tuple(dict.fromkeys(self.new_chunks[:n_new])))

    def forget(self, seen: Seen) -> bool:
        """Forget the records ``seen`` (the metadata engine has them now). Returns whether the
        file still has something to record: a write admitted since, a push in flight, or a
        record of one that ended since."""
        del self.acked_ends[: seen.acked]
        del self.new_chunks[: seen.new]
        del self.failed_starts[: seen.failed]
        return self.writes != seen.writes or bool(self.pending or self.gathers or self.acked_ends
                                                  or self.new_chunks or self.failed_starts)

    def take_error(self) -> IrdmaError | None:
        """The first error a push met since the last drain, forgotten (a drain for no handle)."""
        err, self.error = self.error, None
        return err


@dataclass
class Fetch:
    """One read-ahead window being pulled; waiters take its result from here, so a window
    evicted meanwhile is never looked up again (the old KeyError)."""

    done: trio.Event = field(default_factory=trio.Event)
    data: memoryview | None = None
    error: IrdmaError | None = None


class ReadAhead:
    """The read-ahead windows of one open file, kept and in flight (see the module docstring).

    Args:
        client: the mount's client; pulls go through it.
        layout: the file's layout.
        chunks: the file's chunk map as this mount knows it (shared with the mount's file state).
        write_behind: the file's pushes: a fetch waits for those into its window.
    """

    def __init__(self, client: Client, layout: Layout, chunks: ChunkMap, write_behind: WriteBehind) -> None:
        self.client = client
        self.layout = layout
        self.chunks = chunks
        self.write_behind = write_behind
        # (start offset, size) -> bytes, oldest first; fetches in flight
        self.windows: dict[tuple[int, int], memoryview] = {}
        self.fetching: dict[tuple[int, int], Fetch] = {}
        self.generation = 0  # bumped by every write, truncate and open: older windows are dropped

    def invalidate(self) -> None:
        """Drop every window: the file changed (a write, a truncate) or was opened again."""
        self.generation += 1
        self.windows.clear()
        # and fetches in flight: one started before a write may have read the shards before
        # the write landed, so a read issued after the write must never join it (it would
        # return the old bytes, zeros where the write filled a hole); its readers from before
        # keep waiting on it, and it is not kept as a window (its generation is old)
        self.fetching.clear()

    def held(self, pos: int) -> tuple[tuple[int, int], memoryview | Fetch] | None:
        """The window (cached or in flight) that holds byte ``pos``, if any."""
        size = READAHEAD_MIN
        while size <= READAHEAD_WINDOW:
            key = (pos - pos % size, size)
            buf = self.windows.get(key)
            if buf is not None:
                return key, buf
            fetch = self.fetching.get(key)
            if fetch is not None:
                return key, fetch
            size <<= 1
        return None

    async def read_exact(self, off: int, n: int) -> bytearray | memoryview:
        """A read that is not sequential: from a window that holds all of it, else one pull of
        exactly these bytes (a 4 KiB read is one small request to one shard).

        Raises:
            IrdmaError: the pull failed.
        """
        held = self.held(off) if self.windows else None
        if held is not None:
            (start, _), buf = held
            if isinstance(buf, memoryview) and off + n <= start + len(buf):
                return buf[off - start : off - start + n]
        out = bytearray(n)
        await self.client.read_into(self.layout, off, memoryview(out), self.chunks)
        return out

    async def read_windows(self, nursery: trio.Nursery, off: int, n: int, file_size: int,
                           hits: int) -> bytes | bytearray | memoryview:
        """Serve a sequential read of ``n`` bytes at ``off`` (``n`` > 0, within ``file_size``)
        from read-ahead windows of ``READAHEAD_MIN << hits`` bytes (at most READAHEAD_WINDOW,
        at least the read), fetching the missing ones and the next (in tasks of ``nursery``).

        Raises:
            IrdmaError: a window failed and so did an exact pull of the bytes asked for.
        """
        want = min(READAHEAD_WINDOW, READAHEAD_MIN << min(hits - 1, 16))
        while want < n and want < READAHEAD_WINDOW:
            want <<= 1
        parts: list[memoryview] = []
        pos, end, nxt = off, off + n, off
        while pos < end:
            held = self.held(pos)
            if held is None:
                key = self.window_at(pos, want)
                held = key, self.start_fetch(nursery, key, file_size)
            (start, _), got = held
            try:
                buf = got if isinstance(got, memoryview) else await self.wait_fetch(got)
                if start + len(buf) <= pos:  # cut short by the file size it saw
                    raise IrdmaError("short window")
            except IrdmaError:
                # the window may span a lost chunk or a down shard that this read does not
                # touch: read exactly the range asked for (and fail only if it fails)
                out = bytearray(n)
                await self.client.read_into(self.layout, off, memoryview(out), self.chunks)
                return out
            hi = min(end, start + len(buf))
            parts.append(buf[pos - start : hi - start])
            pos, nxt = hi, start + len(buf)
        # the next windows, while the kernel takes this one: one while the windows ramp up, then
        # READAHEAD_DEPTH in flight together (a large file's chunks lie on different shards)
        for _ in range(READAHEAD_DEPTH if want == READAHEAD_WINDOW else 1):
            if nxt >= file_size:
                break
            ahead = self.held(nxt)
            if ahead is None:
                key = self.window_at(nxt, want)
                self.start_fetch(nursery, key, file_size)
            else:
                key = ahead[0]
            nxt = key[0] + key[1]
        # a read inside one window is answered from the window itself (pyfuse3 copies it into
        # the reply at once; a window is never written after its fetch): no copy of ours
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @staticmethod
    def window_at(pos: int, want: int) -> tuple[int, int]:
        """The window to fetch for byte ``pos``: the largest power of two up to ``want`` bytes
        that ``pos`` is aligned to (windows never overlap in a scan), at least READAHEAD_MIN."""
        size = want
        while pos % size and size > READAHEAD_MIN:
            size >>= 1
        return pos - pos % size, size

    @staticmethod
    async def wait_fetch(fetch: Fetch) -> memoryview:
        """The window ``fetch`` pulls, once pulled.

        Raises:
            IrdmaError: the pull failed.
        """
        await fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        assert fetch.data is not None
        return fetch.data

    def start_fetch(self, nursery: trio.Nursery, key: tuple[int, int], file_size: int) -> Fetch:
        """The fetch of window ``key`` (``(start offset, size)``), started in ``nursery``
        unless one is in flight; it pulls no byte at or past ``file_size``."""
        fetch = self.fetching.get(key)
        if fetch is not None:
            return fetch
        fetch = self.fetching[key] = Fetch()
        nursery.start_soon(self._fetch, key, max(0, min(key[1], file_size - key[0])), fetch)
        return fetch

    async def _fetch(self, key: tuple[int, int], length: int, fetch: Fetch) -> None:
        """Pull ``length`` bytes of window ``key`` into a new buffer; keep it as a window unless
        the file changed meanwhile. Never raises: the error goes to ``fetch``'s waiters."""
        start = key[0]
        gen = self.generation
        # this mount's writes into the window (gathered or in flight) land before it is pulled
        await self.write_behind.settle(start, start + length)
        # not zeroed first: read_into fills every byte (zeros for holes) or raises, and a
        # failed fetch's buffer is never served
        buf = memoryview(np.empty(length, dtype=np.uint8))  # type: ignore[arg-type]
        try:
            await self.client.read_into(self.layout, start, buf, self.chunks)
            fetch.data = buf
            if gen == self.generation:
                self.windows[key] = buf
                held = sum(len(b) for b in self.windows.values())
                while held > READAHEAD_BYTES:
                    held -= len(self.windows.pop(next(iter(self.windows))))
        except IrdmaError as exc:
            log.warning("read of %d bytes at %d of file %d failed: %s", length, start, self.layout.file_id, exc)
            fetch.error = exc
        except Exception as exc:  # a bug: this read fails, the mount lives on
            log.exception("read of %d bytes at %d of file %d failed unexpectedly", length, start, self.layout.file_id)
            fetch.error = IrdmaError(f"internal error: {exc!r}")
        finally:
            if self.fetching.get(key) is fetch:
                del self.fetching[key]
            fetch.done.set()
