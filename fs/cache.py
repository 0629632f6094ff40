"""The mount's data caching: write-behind, read-ahead, and the residuals of compressed pushes.

:mod:`irdma.fs.operations` translates POSIX requests; the bytes of every file open on the mount
go through the objects here: one :class:`WriteBehind` and one :class:`ReadAhead` per open file
(made at its first open, dropped at its last close), one :class:`Residuals` per mount. They hold
bytes in flight and bytes read ahead, never the file's truth: the size and chunk map a drain
records in the metadata engine, and the bytes the shards acknowledged, are that.

* Write-behind (:class:`WriteBehind`): a ``write`` hands its bytes to a task that pushes them to
  the shards (:meth:`WriteBehind.push`) and returns at once; at most ``MAX_INFLIGHT_WRITES``
  pushes per file are in flight, then a write waits for a slot. A push is a :class:`Pending`
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
  window is fetched while the kernel consumes this one. Any other read (random, strided) is one
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
* Overlapping writes stay in order: a write waits for every push in flight that overlaps it
  before it is admitted (under the file's ``admit`` lock, which also orders writes against the
  clearing of a gap), so its residual and its bytes land after theirs. A read waits for the
  pushes it overlaps, and a window's fetch for those in its window: this mount reads its writes.
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
#: Bytes of the first read-ahead window of a sequential read (it doubles with every hit).
READAHEAD_MIN = 128 << 10
#: Bytes of the largest read-ahead window.
READAHEAD_WINDOW = 4 << 20
#: Bytes of windows kept per open file (the oldest dropped first).
READAHEAD_BYTES = 6 * READAHEAD_WINDOW


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
    """

    def __init__(self, client: Client, layout: Layout, chunks: ChunkMap, residuals: Residuals,
                 tell_writers: Callable[[int, IrdmaError], None]) -> None:
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

    async def wait_all(self) -> None:
        """Wait until no push of the file is in flight (those admitted meanwhile too)."""
        while self.pending:
            await self.pending[0].done.wait()

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

    async def push(self, entry: Pending, off: int, buf: bytes | np.ndarray, op: Update,
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
        return self.writes != seen.writes or bool(self.pending or self.acked_ends or self.new_chunks
                                                  or self.failed_starts)

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
        if nxt < file_size and self.held(nxt) is None:  # the next window, while the kernel takes this one
            self.start_fetch(nursery, self.window_at(nxt, want), file_size)
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
        # this mount's pushes into the window land before it is pulled
        await self.write_behind.wait_overlapping(start, start + length)
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
