"""A shard's memory region, its free extents, and the chunks placed in it.

:class:`Region` is the one preallocated memory region of a shard; :class:`Allocator` hands out
its page-aligned extents (first fit, free neighbours coalesced); :class:`Chunk` is one chunk's
extent in it, named by a :data:`ChunkKey` ``(file_id, chunk_index)``. No I/O; the chunk table
and the operations on it are :class:`irdma.server.shard.Shard`'s.

A chunk's *extent* holds its bytes from 0 up to the extent's size; the rest of the chunk, up to
its size, reads as zeros and holds no memory. Extents come in size classes
(:func:`extent_for`): 4 KiB (one page, one slot of the version table) doubling up to the chunk
size, so a 4 KiB file holds one page per replica, and a chunk that grows moves to the next class
(:meth:`irdma.server.shard.Shard._grow`): log2(chunk size / 4 KiB) moves at most, each byte
copied fewer times in all than its final extent holds, and no extent more than twice the bytes
written (or one page). Chosen over packing small tails into shared pages (3FS, JuiceFS do it for
small files): a packed tail would put several files' bytes in one page, where a page is the
unit of the version table, of copy-on-write sharing with snapshots, of RDMA registration and of
hole punching; a size class keeps one chunk per extent, so none of those change, and the
allocator stays the first-fit one it was.
"""

from __future__ import annotations

import bisect
import mmap
from dataclasses import dataclass

PAGE = 4096
#: Largest chunk a shard accepts (bytes).
MAX_CHUNK_SIZE = 256 << 20


def extent_for(end: int, chunk_size: int) -> int:
    """The size class of an extent that holds bytes ``[0, end)`` of a ``chunk_size``-byte chunk:
    the smallest 4096 * 2**k >= ``end``, one page at least, ``chunk_size`` at most (bytes)."""
    if end >= chunk_size:
        return chunk_size
    return min(chunk_size, max(PAGE, 1 << (end - 1).bit_length()))


class Region:
    """A contiguous, writable memory region of ``capacity`` bytes.

    By default an anonymous private ``mmap``: pages cost RAM only once written, and freed
    ranges are handed back with ``madvise(MADV_DONTNEED)``. A transport may supply its own
    buffer instead (verbs registers the region with the device).

    Args:
        capacity: bytes, a multiple of 4096.
        buffer: an existing writable buffer of at least ``capacity`` bytes, or None.
    """

    def __init__(self, capacity: int, buffer: memoryview | None = None) -> None:
        if capacity <= 0 or capacity % PAGE:
            raise ValueError(f"region capacity {capacity} must be a positive multiple of {PAGE}")
        self.capacity = capacity
        self._mmap: mmap.mmap | None = None
        if buffer is None:
            self._mmap = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # 512x fewer page faults on first writes
                try:
                    self._mmap.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # pragma: no cover - THP disabled: fine
                    pass
            self.view = memoryview(self._mmap)
        else:
            if len(buffer) < capacity or buffer.readonly:
                raise ValueError("region buffer must be writable and hold the capacity")
            self.view = buffer[:capacity]

    def zero(self, offset: int, size: int) -> None:
        """Return ``[offset, offset+size)`` to all zeros (and its pages to the OS if we can)."""
        if self._mmap is not None and offset % PAGE == 0 and size % PAGE == 0:
            self._mmap.madvise(mmap.MADV_DONTNEED, offset, size)
        else:
            self.view[offset : offset + size] = bytes(size)

    def close(self) -> None:
        self.view.release()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


class Allocator:
    """First-fit allocator of page-aligned extents with coalescing of free neighbours."""

    def __init__(self, capacity: int) -> None:
        self._starts: list[int] = [0]
        self._sizes: dict[int, int] = {0: capacity}

    def alloc(self, size: int) -> int | None:
        for start in self._starts:
            have = self._sizes[start]
            if have >= size:
                self._starts.remove(start)
                del self._sizes[start]
                if have > size:
                    bisect.insort(self._starts, start + size)
                    self._sizes[start + size] = have - size
                return start
        return None

    def free_parts(self, start: int, size: int) -> list[tuple[int, int]]:
        """The parts of ``[start, start+size)`` that are free now, as ``(start, size)``."""
        end = start + size
        out = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            e = s + self._sizes[s]
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                out.append((lo, hi - lo))
            i += 1
        return out

    def free_extents(self) -> list[tuple[int, int]]:
        return [(s, self._sizes[s]) for s in self._starts]

    def reserve(self, start: int, size: int) -> None:
        """Mark ``[start, start+size)`` used (reloading a persistent shard's chunks).

        Raises:
            ValueError: the range is not inside one free extent (a damaged chunk index).
        """
        if not self.take(start, size):
            raise ValueError(f"extent [{start}, {start + size}) is not free")

    def take(self, start: int, size: int) -> bool:
        """Mark ``[start, start+size)`` used if it lies inside one free extent (True), else
        change nothing (False): a chunk's extent grown in place into the free space after it."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._starts[i] + self._sizes[self._starts[i]] < start + size:
            return False
        ext = self._starts.pop(i)
        have = self._sizes.pop(ext)
        if start > ext:
            bisect.insort(self._starts, ext)
            self._sizes[ext] = start - ext
        end = ext + have
        if end > start + size:
            bisect.insort(self._starts, start + size)
            self._sizes[start + size] = end - start - size
        return True

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        # merge with the next free extent
        if i < len(self._starts) and self._starts[i] == start + size:
            nxt = self._starts.pop(i)
            size += self._sizes.pop(nxt)
        # merge with the previous one
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] += size
                return
        self._starts.insert(i, start)
        self._sizes[start] = size


@dataclass
class Chunk:
    offset: int  # of its extent in the region, bytes
    size: int  # of the chunk, bytes (what requests name)
    #: Bytes of the region its extent holds (:func:`extent_for`); the chunk's bytes past it are
    #: zeros. 0: the whole chunk.
    extent: int = 0
    #: A client was told where it is (LOCATE: the verbs transport's one-sided READs and
    #: WRITEs): its extent is the whole chunk, so it never grows (:meth:`Shard.locate`), and it
    #: never moves while shared (see :meth:`Shard._redirect`).
    located: bool = False

    def __post_init__(self) -> None:
        if not self.extent:
            self.extent = self.size

    @property
    def slot(self) -> int:
        """Index of this chunk's version in the version table."""
        return self.offset // PAGE


ChunkKey = tuple[int, int]  # (file id, chunk index)


class ChunksPending(Exception):
    """A request needs chunks that are not made yet (deferred creation only: see
    :attr:`Shard.defer_creation`). Raised before the request changed anything; apply it again
    once they are made.

    Attributes:
        new: the chunks this attempt reserved (their extents are taken, their version slots
            zero): the caller makes them (:meth:`ShardStore.add_chunks` in a worker thread),
            then :meth:`Shard.install` (or :meth:`Shard.abandon` if that failed).
        waiting: chunks another request reserved and is making: wait until it is done.
    """

    def __init__(self, new: list[tuple[ChunkKey, Chunk]] | None = None, waiting: list[ChunkKey] | None = None) -> None:
        super().__init__("chunks to make first")
        self.new = new or []
        self.waiting = waiting or []

    def add(self, other: ChunksPending) -> None:
        self.new += other.new
        self.waiting += other.waiting

    def __bool__(self) -> bool:
        return bool(self.new or self.waiting)
