"""The local read cache of a client: whole chunks kept in memory and on a local disk.

Like JuiceFS's ``--cache-dir``/``--cache-size`` block cache (https://juicefs.com/docs/community/cache/),
for hot read-mostly files (a frozen embedding table, a dataset shard) that every epoch reads
again: the mount (:mod:`irdma.fs`) and the native client (:class:`irdma.Client`) share this
module; a client holds one :class:`ChunkCache` (``Client.open(..., cache=...)``,
``irdma mount --cache-dir``) and :meth:`irdma.Client.read_into` serves from it.

What is kept: a chunk's bytes ``[0, length)`` (``length`` is the chunk size, or less for the
last chunk of a file: up to the file's size), with the chunk's *version* (what the shard
answered with the bytes), the file's ``ctime_ns`` when the entry was last validated, and the
CRC-32 (zlib) of the whole chunk as a shard computes it (the kept bytes followed by zeros to
the chunk size; computed by the first validation that needs it, never on the read path). Two tiers, each bounded in bytes, least recently used evicted first:

* memory (``memory`` bytes; 0: off), a dict of immutable ``bytes``;
* disk (``directory``, ``size`` bytes; None: off): one file per chunk,
  ``DIR/irdma-<namespace>/<file id>/<chunk index>-<version>``, a 68-byte header
  (:data:`HEADER`: magic, file id, chunk index, version, ctime_ns, length, CRC-32 of the
  chunk, CRC-32 of the header; little-endian), then the CRC-32 of each :data:`CRC_BLOCK`
  bytes of the data (u32, little-endian; the last block may be shorter), then the bytes.
  Written atomically (a ``.tmp`` file, then ``rename(2)``), so a crash leaves either the old
  entry or the new one, and read back at the next start (it survives a remount).
  ``<namespace>`` is a hash of the metadata URL: two clusters never share entries. A hit on
  disk is copied into the memory tier.

Integrity: every read from disk checks the CRC-32 of each block it reads before a byte is
served; an entry that fails (a disk error, a flipped bit, an edit) is dropped, logged once,
and its chunk read from the shards again (and kept anew). An entry whose header does not
check is dropped when the disk tier is opened.

Privacy: cached chunks are the bytes of files whose modes other users may not pass, so the
disk tier is this process's user's alone: ``DIR/irdma-<namespace>`` and the directories under
it are mode 0700 and the entries 0600, owned by the user that runs the mount (or the client).
Opening the disk tier makes a more open ``irdma-<namespace>`` (or per-file directory, or
entry) of this user private again, and refuses one owned by another user or that is not a
directory (a symbolic link). ``DIR`` itself is made 0700 when missing; an existing one must
belong to this user or to root and, if every user may write in it, have the sticky bit (as
``/tmp``): else another user could put their own ``irdma-<namespace>`` in its place.

When a kept chunk may be served (the consistency rule; see :meth:`irdma.Client.cache_open`):
only after it was *validated* at an open of the file (close-to-open, as the mount's page
cache): the chunk's version on an up-to-date replica equals the kept one, and either the file's
``ctime_ns`` is the one the entry was validated at, or the shard's CRC-32 of the chunk equals
the kept one (a CHECKSUM request; the entry is then stamped with the new ctime). The ctime
check is there because a version alone does not name a chunk's bytes: a truncate frees a chunk
and a write makes it again from version 0, so ``truncate + rewrite`` can reach the old version
with other bytes; every truncate and write changes the file's ctime in the metadata engine.
Files with the xattr ``user.irdma.cache=readonly`` are validated at most every
:data:`READONLY_REVALIDATE_S` seconds while their ctime does not change; ``off`` never caches.

Thread safety: the index is guarded by a lock; the disk I/O of :meth:`load` and :meth:`store`
runs in worker threads (never on the trio loop).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import zlib
from dataclasses import dataclass, replace

import trio

from .._errors import InvalidArgument
from ..units import format_size, parse_size

log = logging.getLogger("irdma.cache")

#: Header of a chunk file on disk: magic, file id, chunk index, version, ctime_ns, length,
#: CRC-32 of the chunk (kept bytes + zeros to the chunk size) with bit 32 set, or 0 when not
#: computed yet, chunk size, CRC-32 of the header before it; little-endian, 68 bytes.
HEADER = struct.Struct("<8sQQQqQQQI")
MAGIC = b"IRDMAC03"
#: Entries of an older format (no CRC-32 of the data): dropped when the disk tier is opened.
_OLD_MAGIC = (b"IRDMAC01", b"IRDMAC02")
#: Bytes of an entry's data under one CRC-32 (a read checks only the blocks it reads).
CRC_BLOCK = 64 << 10
_CRC = struct.Struct("<I")
_KNOWN = 1 << 32
#: Seconds a ``user.irdma.cache=readonly`` file goes without its versions checked (while its
#: ctime in the metadata engine does not change).
READONLY_REVALIDATE_S = 60.0
#: Memory tier of a mount given ``--cache-dir`` without ``--cache-memory``.
DEFAULT_MEMORY = 256 << 20
#: Disk tier of ``--cache-dir`` without ``--cache-size``.
DEFAULT_DISK = 10 << 30
#: Disk writes that may wait behind the reads (chunks already in the memory tier).
WRITES_BEHIND = 8
_NAME = re.compile(r"^(\d+)-(\d+)$")
_PAD = bytes(1 << 20)


def chunk_crc(data: bytes | memoryview, chunk_size: int) -> int:
    """zlib CRC-32 of ``data`` followed by zeros up to ``chunk_size`` bytes: what a shard's
    CHECKSUM answers for a chunk whose bytes past ``len(data)`` are zeros."""
    crc = zlib.crc32(data)
    left = chunk_size - len(data)
    while left > 0:
        n = min(left, len(_PAD))
        crc = zlib.crc32(memoryview(_PAD)[:n], crc)
        left -= n
    return crc


@dataclass(frozen=True)
class Entry:
    """What the cache knows of one kept chunk (its bytes are in a tier)."""

    file_id: int
    index: int
    version: int  # the chunk's version when its bytes were read (> 0)
    ctime_ns: int  # the file's ctime when the entry was last validated
    length: int  # bytes kept: [0, length) of the chunk
    crc: int | None  # zlib CRC-32 of the kept bytes and zeros up to chunk_size; None: not computed yet
    chunk_size: int


def _blocks(length: int) -> int:
    """CRC-32s of an entry of ``length`` bytes (one per :data:`CRC_BLOCK`)."""
    return -(-length // CRC_BLOCK)


def block_crcs(data: bytes | memoryview) -> bytes:
    """The table of an entry on disk: the CRC-32 of each :data:`CRC_BLOCK` bytes of ``data``
    (u32 little-endian each)."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return b"".join(_CRC.pack(zlib.crc32(mv[k : k + CRC_BLOCK])) for k in range(0, len(mv), CRC_BLOCK))


class CorruptEntry(Exception):
    """An entry on disk whose bytes do not match their CRC-32 (dropped and read from the shards)."""


def namespace_id(meta_url: str) -> str:
    """The directory name of a namespace's entries: a hash of its metadata URL (normalized)."""
    return hashlib.sha256(meta_url.strip().rstrip("/").encode()).hexdigest()[:16]


def make_cache(directory: str | None = None, size: int | str | None = None,
               memory: int | str | None = None) -> ChunkCache | None:
    """The cache ``--cache-dir``, ``--cache-size`` and ``--cache-memory`` ask for, or None: a
    disk tier when ``directory`` is given (``size`` bytes, default :data:`DEFAULT_DISK`), and a
    memory tier of ``memory`` bytes (default :data:`DEFAULT_MEMORY` with a directory, else 0).

    Raises:
        InvalidArgument: a bad size, ``size`` without a directory, or a directory that cannot
            be made or written.
    """
    if memory is None:
        memory = DEFAULT_MEMORY if directory else 0
    cache = ChunkCache(memory, directory, size)
    if cache.directory:
        check_directory(cache.directory)
    return cache if cache.enabled else None


def check_directory(directory: str) -> None:
    """Make ``directory`` if missing (mode 0700) and check that this user can create files in
    it and that no other user can replace what this user keeps there: it belongs to this user
    or to root, and if every user may write in it it has the sticky bit (as ``/tmp``).

    Raises:
        InvalidArgument: it cannot be made or written, or it is another user's or open to
            every user to write without the sticky bit (the error names why).
    """
    probe = os.path.join(directory, f".irdma-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidArgument(f"cache directory {directory} is not writable: {exc.strerror or exc}",
                              "give --cache-dir a directory this user can create files in") from None
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise InvalidArgument(f"cache directory {directory} belongs to uid {st.st_uid}, not to this user (uid {me})"
                              " or root: that user could read or replace the cached chunks",
                              "give --cache-dir a directory of this user's (it is made mode 0700 if missing)")
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise InvalidArgument(f"cache directory {directory} is writable by every user (mode"
                              f" {stat.S_IMODE(st.st_mode):04o}, no sticky bit): they could replace the cached chunks",
                              f"chmod o-w {directory} (or chmod +t, as /tmp), or give --cache-dir another directory")


def private_directory(path: str, quiet: bool = False) -> bool:
    """Make ``path`` a directory only this user may enter: made mode 0700 if missing; one of
    this user's with a more open mode is made 0700 (logged unless ``quiet``); never through a
    symbolic link. Blocking. Returns whether an existing directory's mode was changed.

    Raises:
        InvalidArgument: ``path`` is not a directory (a file, a symbolic link), belongs to
            another user, or cannot be made or changed.
    """
    fix = "remove it (it is made again, private) or give --cache-dir another directory"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidArgument(f"cache directory {path} cannot be opened as a directory: {exc.strerror or exc}",
                              fix) from None
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me:
            raise InvalidArgument(f"cache directory {path} belongs to uid {st.st_uid}, not to this user (uid {me}):"
                                  " that user could read or replace the cached chunks", fix)
        if not st.st_mode & 0o077:
            return False
        os.fchmod(fd, 0o700)
        if not quiet:
            log.warning("cache: %s was mode %04o, others could read cached chunks: now 0700", path,
                        stat.S_IMODE(st.st_mode))
        return True
    except OSError as exc:
        raise InvalidArgument(f"cache directory {path} cannot be made private: {exc.strerror or exc}", fix) from None
    finally:
        os.close(fd)


class ChunkCache:
    """A two-tier LRU cache of whole chunks (see the module docstring).

    Args:
        memory: bytes of the memory tier (a size such as ``"256MiB"``, or an int; 0: off).
        directory: the disk tier's directory (made if missing), or None for none.
        size: bytes of the disk tier (default :data:`DEFAULT_DISK`).

    Raises:
        InvalidArgument: a size that does not parse or is negative, a disk size without a
            directory, or a directory that cannot be made or written (checked by :meth:`attach`).
    """

    def __init__(self, memory: int | str = 0, directory: str | None = None, size: int | str | None = None) -> None:
        try:
            self.memory_limit = parse_size(memory)
            self.disk_limit = parse_size(size) if size is not None else (DEFAULT_DISK if directory else 0)
        except ValueError as exc:
            raise InvalidArgument(f"bad cache size: {exc}", "write sizes such as 512MiB or 10G") from None
        if self.memory_limit < 0 or self.disk_limit < 0:
            raise InvalidArgument("a cache size must not be negative", "write sizes such as 512MiB or 10G")
        if directory is None and size is not None and self.disk_limit:
            raise InvalidArgument("--cache-size needs --cache-dir", "name the directory of the disk cache")
        self.directory = os.path.abspath(directory) if directory else None
        self._root: str | None = None  # DIR/irdma-<namespace>, once attached
        self._lock = threading.Lock()
        self._mem: collections.OrderedDict[tuple[int, int], tuple[Entry, bytes | memoryview]] = collections.OrderedDict()
        self._disk: collections.OrderedDict[tuple[int, int], Entry] = collections.OrderedDict()
        self.mem_bytes = 0
        self.disk_bytes = 0
        # disk writes behind the reads: a chunk kept in memory is written by these threads while
        # its readers go on; at most WRITES_BEHIND wait, then a store waits for its own write
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._behind = 0
        from ..metrics import cache_metrics

        self.metrics = cache_metrics()

    @property
    def enabled(self) -> bool:
        return bool(self.memory_limit or (self.directory and self.disk_limit))

    def __repr__(self) -> str:
        disk = f"{self.directory} {format_size(self.disk_limit)}" if self.directory else "none"
        return f"ChunkCache(memory {format_size(self.memory_limit)}, disk {disk})"

    # ------------------------------------------------------------ the disk tier
    def attach(self, meta_url: str) -> None:
        """Open the disk tier for the namespace at ``meta_url``: make its directory, check it
        can be written, and read the index of what an earlier run kept (evicting down to the
        size). Blocking: call from a worker thread.

        Raises:
            InvalidArgument: the directory cannot be made or written, or it or the namespace's
                directory in it may be read or replaced by another user (see
                :func:`check_directory`, :func:`private_directory`).
        """
        if not self.directory or not self.disk_limit:
            return
        root = os.path.join(self.directory, "irdma-" + namespace_id(meta_url))
        check_directory(self.directory)
        private_directory(root)
        check_directory(root)
        found: list[tuple[float, Entry]] = []
        old_format = opened = 0
        me = os.geteuid()
        with os.scandir(root) as it:
            subs = [d for d in it if d.is_dir(follow_symlinks=False) and d.name.isdigit()]
        for sub in subs:
            opened += private_directory(sub.path, quiet=True)
            with os.scandir(sub.path) as it:
                names = list(it)
            for f in names:
                m = _NAME.match(f.name)
                if f.name.endswith(".tmp") or m is None:  # a write a crash cut short
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
                    log.warning("cache: dropping %s (not a file of this user's)", f.path)
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
                    continue
                e = self._read_header(f.path)
                if e is None or (e.file_id, e.index, e.version) != (int(sub.name), int(m[1]), int(m[2])):
                    if e is None and self._old_format(f.path):
                        old_format += 1
                    else:
                        log.warning("cache: dropping %s (bad header)", f.path)
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
                    continue
                if st.st_mode & 0o077:
                    try:
                        os.chmod(f.path, 0o600)
                        opened += 1
                    except OSError as exc:  # never served open: dropped
                        log.warning("cache: dropping %s: cannot make it private: %s", f.path, exc)
                        with contextlib.suppress(OSError):
                            os.unlink(f.path)
                        continue
                found.append((st.st_mtime, e))
        if opened:
            log.warning("cache: %d directories and entries in %s were open to other users: now 0700 and 0600",
                        opened, root)
        if old_format:
            log.info("cache: dropped %d entries of an older format in %s", old_format, root)
        with self._lock:
            self._root = root
            for _, e in sorted(found, key=lambda t: t[0]):
                old = self._disk.pop((e.file_id, e.index), None)
                if old is not None:  # two versions of one chunk: keep the newer
                    self._unlink(old)
                    self.disk_bytes -= old.length
                self._disk[(e.file_id, e.index)] = e
                self.disk_bytes += e.length
            evicted = self._evict_disk()
        self._remove(evicted)
        self._gauges()
        if found:
            log.info("cache: %d chunks (%s) kept on disk in %s", len(self._disk), format_size(self.disk_bytes), root)

    def _path(self, e: Entry) -> str:
        assert self._root is not None
        return os.path.join(self._root, str(e.file_id), f"{e.index}-{e.version}")

    @staticmethod
    def _header(e: Entry) -> bytes:
        crc = 0 if e.crc is None else e.crc | _KNOWN
        head = HEADER.pack(MAGIC, e.file_id, e.index, e.version, e.ctime_ns, e.length, crc, e.chunk_size, 0)
        return head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))

    @staticmethod
    def _old_format(path: str) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) in _OLD_MAGIC
        except OSError:
            return False

    @staticmethod
    def _read_header(path: str) -> Entry | None:
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return None
        if len(head) != HEADER.size:
            return None
        magic, fid, idx, ver, ctime, length, crc, csize, hcrc = HEADER.unpack(head)
        if (magic != MAGIC or hcrc != zlib.crc32(head[:-4]) or size != HEADER.size + 4 * _blocks(length) + length
                or ver <= 0):
            return None
        return Entry(fid, idx, ver, ctime, length, crc & 0xFFFFFFFF if crc & _KNOWN else None, csize)

    def _unlink(self, e: Entry) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._path(e))

    def _remove(self, entries: list[Entry]) -> None:
        for e in entries:
            self._unlink(e)

    def _evict_disk(self) -> list[Entry]:
        """Under the lock: take entries out of the disk index, oldest first, down to the limit."""
        out = []
        while self.disk_bytes > self.disk_limit and self._disk:
            _, e = self._disk.popitem(last=False)
            self.disk_bytes -= e.length
            out.append(e)
        if out:
            self.metrics.evictions.labels("disk").inc(len(out))
        return out

    def _evict_mem(self) -> None:
        n = 0
        while self.mem_bytes > self.memory_limit and self._mem:
            _, (e, _) = self._mem.popitem(last=False)
            self.mem_bytes -= e.length
            n += 1
        if n:
            self.metrics.evictions.labels("memory").inc(n)

    def _gauges(self) -> None:
        self.metrics.bytes.labels("memory").set(self.mem_bytes)
        self.metrics.bytes.labels("disk").set(self.disk_bytes)

    # ------------------------------------------------------------ the index
    def entry(self, file_id: int, index: int) -> Entry | None:
        """What is kept of a chunk, in either tier (not a use: the LRU order stays)."""
        with self._lock:
            got = self._mem.get((file_id, index))
            return got[0] if got is not None else self._disk.get((file_id, index))

    def entries(self, file_id: int) -> dict[int, Entry]:
        """Every kept chunk of a file, by chunk index."""
        with self._lock:
            out = {i: e for (f, i), e in self._disk.items() if f == file_id}
            out.update({i: e for (f, i), (e, _) in self._mem.items() if f == file_id})
            return out

    def drop(self, file_id: int, index: int) -> None:
        """Forget a chunk in both tiers (its kept bytes are no longer the shard's)."""
        with self._lock:
            got = self._mem.pop((file_id, index), None)
            if got is not None:
                self.mem_bytes -= got[0].length
            e = self._disk.pop((file_id, index), None)
            if e is not None:
                self.disk_bytes -= e.length
        if e is not None:
            self._unlink(e)
        self._gauges()

    def _drop_corrupt(self, e: Entry, why: str) -> None:
        """Forget disk entry ``e`` whose bytes failed their CRC-32 (both tiers; logged once:
        by the reader that took it out of the index)."""
        with self._lock:
            cur = self._disk.get((e.file_id, e.index))
            if cur is None or cur.version != e.version:
                return  # another reader dropped it (and said so), or a newer entry took its place
            del self._disk[(e.file_id, e.index)]
            self.disk_bytes -= e.length
            got = self._mem.get((e.file_id, e.index))
            if got is not None and got[0].version == e.version:
                del self._mem[(e.file_id, e.index)]
                self.mem_bytes -= got[0].length
        self._unlink(e)
        self._gauges()
        log.warning("cache: dropped %s: %s; chunk %d of file %d is read from the shards again", self._path(e), why,
                    e.index, e.file_id)

    def restamp(self, file_id: int, index: int, ctime_ns: int) -> None:
        """Record that a chunk was validated at the file's ``ctime_ns`` (blocking: the disk
        entry's header is rewritten in place; a torn header drops the entry at the next start)."""
        with self._lock:
            got = self._mem.get((file_id, index))
            if got is not None:
                self._mem[(file_id, index)] = (replace(got[0], ctime_ns=ctime_ns), got[1])
            e = self._disk.get((file_id, index))
            if e is not None:
                e = self._disk[(file_id, index)] = replace(e, ctime_ns=ctime_ns)
        if e is not None:
            try:
                fd = os.open(self._path(e), os.O_WRONLY)
                try:
                    os.pwrite(fd, self._header(e), 0)
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("cache: cannot restamp %s: %s", self._path(e), exc)

    def crc_of(self, e: Entry) -> int | None:
        """The CRC-32 of kept chunk ``e`` (see :func:`chunk_crc`): recorded, else computed from
        the bytes in memory (blocking: call from a worker thread); None if no longer kept."""
        if e.crc is not None:
            return e.crc
        key = (e.file_id, e.index)
        with self._lock:
            disk = self._disk.get(key)
            got = self._mem.get(key)
        if disk is not None and disk.version == e.version and disk.crc is not None:
            return disk.crc
        if got is not None and got[0].version == e.version:
            crc = chunk_crc(got[1], e.chunk_size)
        elif disk is not None and disk.version == e.version:
            try:
                data = self._read_data(disk, 0, disk.length)
            except CorruptEntry as exc:
                self._drop_corrupt(disk, str(exc))
                return None
            if data is None:
                return None
            crc = chunk_crc(data, e.chunk_size)
        else:
            return None
        with self._lock:  # recorded (on disk by the restamp that follows a match)
            now = self._mem.get(key)
            if now is not None and now[0].version == e.version:
                self._mem[key] = (replace(now[0], crc=crc), now[1])
            d = self._disk.get(key)
            if d is not None and d.version == e.version:
                self._disk[key] = replace(d, crc=crc)
        return crc

    # ------------------------------------------------------------ bytes
    async def load(self, file_id: int, index: int, version: int, lo: int, hi: int) -> memoryview | bytes | None:
        """Bytes ``[lo, hi)`` of a chunk kept at ``version``, or None (not kept, another
        version, or fewer bytes kept). From memory, else from disk in a worker thread: the
        whole chunk when there is a memory tier (then kept there), else only the range. Counts
        a hit by tier; the caller counts the miss when it reads the shards. Bytes read from
        disk are served only once their blocks' CRC-32 match: an entry that fails is dropped
        (logged once) and None returned, so the caller reads the chunk from the shards."""
        key = (file_id, index)
        with self._lock:
            got = self._mem.get(key)
            if got is not None and got[0].version == version and hi <= got[0].length:
                self._mem.move_to_end(key)
                self.metrics.hits.labels("memory").inc()
                return memoryview(got[1])[lo:hi]
            e = self._disk.get(key)
            if e is None or e.version != version or hi > e.length:
                return None
            self._disk.move_to_end(key)
        whole = bool(self.memory_limit) and e.length <= self.memory_limit
        try:
            data = await trio.to_thread.run_sync(self._read_data, e, 0 if whole else lo, e.length if whole else hi)
        except CorruptEntry as exc:
            await trio.to_thread.run_sync(self._drop_corrupt, e, str(exc))
            return None
        if data is None:
            self.drop(file_id, index)
            return None
        self.metrics.hits.labels("disk").inc()
        if whole:
            self._put_mem(e, data)
            return memoryview(data)[lo:hi]
        return data

    def _read_data(self, e: Entry, lo: int, hi: int) -> bytes | None:
        """Bytes ``[lo, hi)`` of disk entry ``e``, read whole blocks at a time and checked
        against their CRC-32 (blocking); None if the file cannot be read (logged).

        Raises:
            CorruptEntry: a block read does not match its CRC-32, or the file is short.
        """
        first, last = lo // CRC_BLOCK, max(lo, hi - 1) // CRC_BLOCK
        start, end = first * CRC_BLOCK, min(e.length, (last + 1) * CRC_BLOCK)
        table = HEADER.size + 4 * first
        try:
            with open(self._path(e), "rb") as f:
                crcs = os.pread(f.fileno(), 4 * (last - first + 1), table)
                data = os.pread(f.fileno(), end - start, HEADER.size + 4 * _blocks(e.length) + start)
        except OSError as exc:
            log.warning("cache: cannot read %s: %s", self._path(e), exc)
            return None
        if len(crcs) != 4 * (last - first + 1) or len(data) != end - start:
            raise CorruptEntry("shorter than its header says")
        mv = memoryview(data)
        for k in range(last - first + 1):
            if zlib.crc32(mv[k * CRC_BLOCK : (k + 1) * CRC_BLOCK]) != _CRC.unpack_from(crcs, 4 * k)[0]:
                raise CorruptEntry(f"bytes {start + k * CRC_BLOCK} to {min(end, start + (k + 1) * CRC_BLOCK)} do not"
                                   " match their CRC-32")
        return data if (start, end) == (lo, hi) else data[lo - start : hi - start]

    def _put_mem(self, e: Entry, data: bytes | memoryview) -> bool:
        """Keep a chunk in the memory tier; False when it does not fit there."""
        if not self.memory_limit or e.length > self.memory_limit:
            return False
        with self._lock:
            old = self._mem.pop((e.file_id, e.index), None)
            if old is not None:
                self.mem_bytes -= old[0].length
            self._mem[(e.file_id, e.index)] = (e, data)
            self.mem_bytes += e.length
            self._evict_mem()
        self._gauges()
        return True

    async def store(self, e: Entry, data: bytes | memoryview) -> None:
        """Keep ``data`` (``e.length`` bytes, never written again by the caller) as chunk
        ``(e.file_id, e.index)`` at ``e.version``, in memory and on disk (written atomically in a
        worker thread: behind, when the memory tier took it and fewer than
        :data:`WRITES_BEHIND` writes wait; :meth:`close` waits for them). Never raises: a disk
        that fails is logged and the entry kept in memory only."""
        in_mem = self._put_mem(e, data)
        if self._root is None or e.length > self.disk_limit:
            return
        with self._lock:
            behind = in_mem and self._behind < WRITES_BEHIND
            if behind:
                self._behind += 1
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="irdma-cache")
                self._writer.submit(self._write_behind, e, data)
        if not behind:
            await trio.to_thread.run_sync(self._write, e, data)

    def _write_behind(self, e: Entry, data: bytes | memoryview) -> None:
        try:
            self._write(e, data)
        finally:
            with self._lock:
                self._behind -= 1

    def close(self) -> None:
        """Wait for the disk writes behind (blocking: call from a worker thread). Safe twice."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def _write(self, e: Entry, data: bytes | memoryview) -> None:
        path = self._path(e)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path), 0o700)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # left by a write that failed: made anew, private
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(self._header(e))
                f.write(block_crcs(data))
                f.write(data)
            os.rename(tmp, path)
        except OSError as exc:
            log.warning("cache: cannot write %s: %s (kept in memory only)", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        with self._lock:
            old = self._disk.pop((e.file_id, e.index), None)
            if old is not None:
                self.disk_bytes -= old.length
            self._disk[(e.file_id, e.index)] = e
            self.disk_bytes += e.length
            evicted = self._evict_disk()
        if old is not None and old.version != e.version:
            self._unlink(old)
        self._remove(evicted)
        self._gauges()

    def clear_memory(self) -> None:
        """Drop the memory tier (the disk tier stays)."""
        with self._lock:
            self._mem.clear()
            self.mem_bytes = 0
        self._gauges()


__all__ = ["ChunkCache", "Entry", "make_cache", "check_directory", "private_directory", "block_crcs", "chunk_crc",
           "CorruptEntry", "CRC_BLOCK", "namespace_id", "HEADER", "READONLY_REVALIDATE_S", "DEFAULT_MEMORY",
           "DEFAULT_DISK"]
