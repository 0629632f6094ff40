"""Snapshots' shared extents: clones that copy no byte, and copy-on-write when one key changes.

A clone (a snapshot's CLONE, :meth:`SharedExtents.clone_files`) makes each chunk of a file also
a chunk of a new file id, sharing the extent; the first later update of either key parts them
(:meth:`SharedExtents._unshare`, or :meth:`SharedExtents._redirect` for the live file's write).
A whole-chunk copy received (REPLACE) of bytes copied here before shares that extent too
(:meth:`SharedExtents._share_copy`). A chunk that outgrows its extent moves too, or grows in
place (:meth:`SharedExtents._grow`). :class:`SharedExtents` is that part of
:class:`irdma.server.shard.Shard`; the attributes are the shard's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from irdma._errors import BadRequest
from irdma.wire.protocol import UpdateOp

from .lost import RefusedChunks
from .region import PAGE, Allocator, Chunk, ChunkKey, Region, extent_for

if TYPE_CHECKING:
    from .store import ShardStore


class SharedExtents(RefusedChunks):
    """The extents several chunk keys share, of a :class:`~irdma.server.shard.Shard` (a mixin:
    the shard's ``__init__`` sets every attribute named here)."""

    region: Region
    store: ShardStore | None
    versions: np.ndarray
    copies: int
    grown: int
    used: int
    _alloc: Allocator
    _parked: collections.deque[tuple[int, float, int, int]]
    _parks: int
    _by_file: dict[int, set[int]]
    _sharers: dict[int, list[ChunkKey]]
    _received: collections.OrderedDict[tuple[int, int, int, int], ChunkKey]

    if TYPE_CHECKING:
        @property
        def capacity(self) -> int: ...

        def _alloc_extent(self, size: int, what: str) -> int: ...

        def _release(self, offset: int, size: int) -> None: ...

    def _share_copy(self, key: ChunkKey, sig: tuple[int, int, int, int], data: memoryview | bytes) -> bool:
        """Make ``key`` (not here yet) share the extent of a chunk copied here before with the
        same bytes and version (``sig``: :attr:`_received`; ``data``: the chunk's bytes up to
        its extent, zeros after them), instead of taking a new extent: a
        drain or rebalance moving a file and its snapshots copies each shared extent once and
        keeps it shared (copy-on-write then parts them on their next write, as on the shard
        they came from). Only when the bytes are equal, compared whole, and the version too
        (keys sharing an extent share its version), and the chunk was never LOCATEd (a verbs
        client may write it in place). Returns whether it did.

        Raises:
            sqlite3.Error: the chunk index could not be written; nothing changed.
        """
        twin_key = self._received.get(sig)
        twin = self._chunks.get(twin_key) if twin_key is not None else None
        if twin is None or twin_key is None or twin.located or twin_key in self.lost:
            return False
        _, size, version, _ = sig
        n = len(data)
        view = self.region.view
        if twin.size != size or twin.extent < n or int(self.versions[twin.slot]) != version or \
                view[twin.offset : twin.offset + n] != memoryview(data).cast("B") or \
                view[twin.offset + n : twin.offset + twin.extent] != bytes(twin.extent - n):
            return False
        if self.store is not None:
            self.store.record_chunks([(key[0], key[1], twin.offset, size, twin.extent)])
        self._chunks[key] = Chunk(twin.offset, size, twin.extent)
        self._sharers.setdefault(twin.offset, [twin_key]).append(key)
        self._by_file.setdefault(key[0], set()).add(key[1])
        return True

    def clone(self, src_file: int, dst_file: int) -> int:
        """Make every chunk of ``src_file`` here (and its optimizer state) also a chunk of
        ``dst_file``, sharing the extent: no byte is copied (a snapshot's clone, O(chunks)).
        The first later update of either key copies the extent (:meth:`_unshare`).

        Returns:
            How many chunk keys were made (state chunks included).

        Raises:
            BadRequest: ``dst_file`` already has chunks here, or is ``src_file``. Nothing changed.
        """
        return self.clone_files([(src_file, dst_file)])

    def clone_files(self, pairs: Sequence[tuple[int, int]]) -> int:
        """:meth:`clone` of each ``(source, clone)`` pair, with one chunk-index transaction for
        them all (a snapshot's CLONE names every file of its tree). Returns the chunk keys made.

        Raises:
            BadRequest: a clone's file id already has chunks here, is a source, or comes twice.
                Nothing changed.
        """
        dsts = [d for _, d in pairs]
        srcs = {s for s, _ in pairs}
        for src_file, dst_file in pairs:
            if dst_file == src_file or dst_file in self._by_file or dst_file in srcs:
                raise BadRequest(f"file {dst_file} already has chunks on shard {self.shard_id}: a clone needs a new"
                                 " file id")
        if len(set(dsts)) != len(dsts):
            raise BadRequest("a clone names the same new file id twice")
        for src_file, _ in pairs:  # a clone of bytes the shard cannot vouch for would pass them off
            for i in self._by_file.get(src_file, ()):
                self._refuse_lost(src_file, i)
        made = [(src_file, dst_file, i, self._chunks[(src_file, i)]) for src_file, dst_file in pairs
                for i in sorted(self._by_file.get(src_file, ()))]
        if self.store is not None and made:
            self.store.record_chunks([(d, i, c.offset, c.size, c.extent) for _, d, i, c in made])
        for src_file, d, i, c in made:
            self._chunks[(d, i)] = Chunk(c.offset, c.size, c.extent)
            self._sharers.setdefault(c.offset, [(src_file, i)]).append((d, i))
            self._by_file.setdefault(d, set()).add(i)
        return len(made)

    def _redirect(self, key: ChunkKey, chunk: Chunk, offset: int, n: int, kind: UpdateOp,
                  data: memoryview | bytes) -> bool:
        """Copy-on-write by redirection: the update of a shared chunk is written into a new
        extent (the old bytes with the update applied, one pass: ``add`` reads the old floats and
        the delta and writes the sum there), and the writer's key moves to it; the snapshot's
        keys keep the old extent untouched. Half the memory traffic of copying first and
        updating in place (:meth:`_unshare`), and crash-safe by order: the new extent is
        written before the chunk index moves the key to it.

        Only for the extent's owner (the live file), a chunk no client was told the place of
        (never LOCATEd: a verbs client may have cached it) and an update inside the extent (the
        caller grows it otherwise); returns False, having changed nothing, when it does not
        apply (the caller copies with :meth:`_unshare`).

        Raises:
            NoSpace: no free extent; nothing changed.
        """
        keys = self._sharers[chunk.offset]
        if key != keys[0] or chunk.located or offset + n > chunk.extent:
            return False
        to = self._alloc_extent(chunk.extent, "to copy a chunk a snapshot shares into")
        old, size = chunk.offset, chunk.extent
        view = self.region.view
        src, dst = view[old : old + size], view[to : to + size]
        if offset:
            dst[:offset] = src[:offset]
        if offset + n < size:
            dst[offset + n :] = src[offset + n :]
        if kind == UpdateOp.ASSIGN:
            dst[offset : offset + n] = data
        else:
            np.add(np.frombuffer(src[offset : offset + n], dtype="<f4"), np.frombuffer(data, dtype="<f4"),
                   out=np.frombuffer(dst[offset : offset + n], dtype="<f4"))
        self._moved([key], chunk, to, size)
        rest = keys[1:]
        if len(rest) > 1:
            self._sharers[old] = rest
        else:
            del self._sharers[old]
        chunk.offset = to
        self.copies += 1
        return True

    def _unshare(self, key: ChunkKey) -> None:
        """Copy-on-write before ``key``'s chunk changes, when its extent is shared: the extent's
        owner stays where it is and the others move to a copy of it (bytes and version), so the
        update reaches ``key`` alone. Written by its owner (the live file under a snapshot),
        the other keys move; written by another (a writable clone), that key moves alone. A
        key that moves was shared, and a shared chunk's place is never cached by a client
        (:class:`irdma.wire.protocol.LocateReply` ``shared``), so no cached one-sided location
        ever points at bytes that are no longer its chunk's.

        Raises:
            NoSpace: no free extent for the copy. Nothing changed.
        """
        chunk = self._chunks.get(key)
        if chunk is None or chunk.offset not in self._sharers:
            return
        keys = self._sharers[chunk.offset]
        movers = [k for k in keys if k != key] if key == keys[0] else [key]
        size = chunk.extent
        to = self._alloc_extent(size, "to copy a chunk a snapshot shares into")
        self.region.view[to : to + size] = self.region.view[chunk.offset : chunk.offset + size]
        self._moved(movers, chunk, to, size)
        stay = [k for k in keys if k not in movers]
        if len(stay) > 1:
            self._sharers[chunk.offset] = stay
        else:
            del self._sharers[chunk.offset]
        if len(movers) > 1:
            self._sharers[to] = movers
        for k in movers:
            self._chunks[k].offset = to
        self.copies += 1

    def _grow(self, key: ChunkKey, chunk: Chunk, end: int) -> None:
        """Make ``chunk``'s extent hold bytes ``[0, end)`` at least: an extent of the size class
        of ``end`` (:func:`extent_for`). In place when the space after the extent is free and
        no snapshot shares it (the new part zeroed, nothing copied or freed); else moved to a
        new extent, its bytes copied and the rest zeroed, its version with it. Either is
        journaled as a copy-on-write move is (:meth:`ShardStore.move_chunks`: the new extent is
        written before the index moves the key to it). A moved chunk's old extent is freed
        (parked until the next sync with durability ``fsync``: :attr:`_parked`); one a snapshot
        shares stays with its other keys. A chunk a client LOCATEd holds its whole size already
        and never gets here.

        Raises:
            NoSpace: no free extent of the new size; nothing changed.
        """
        need = extent_for(end, chunk.size)
        if need <= chunk.extent:
            return
        assert not chunk.located, "a located chunk holds its whole size"
        if self._grow_in_place(key, chunk, need):
            self.grown += 1
            return
        old, have = chunk.offset, chunk.extent
        to = self._alloc_extent(need, f"to grow a chunk of {have} bytes into")
        view = self.region.view
        view[to : to + have] = view[old : old + have]
        if self.store is not None:  # a free extent may hold old bytes until trimmed
            view[to + have : to + need] = bytes(need - have)
        self._moved([key], chunk, to, need)
        keys = self._sharers.get(old)
        if keys is not None:  # the others keep the old extent
            keys.remove(key)
            if len(keys) < 2:
                del self._sharers[old]
        elif self.store is not None and self.store.durability == "fsync":
            self._parked.append((self._parks, time.monotonic(), old, have))
            self._parks += 1
        else:
            self._release(old, have)
        chunk.offset, chunk.extent = to, need
        self.grown += 1

    def _grow_in_place(self, key: ChunkKey, chunk: Chunk, need: int) -> bool:
        """Grow ``chunk``'s extent to ``need`` bytes where it is, if the region space right after
        it is free and no snapshot shares it (a file written front to back): the new part zeroed
        (a free range may hold old bytes until trimmed), its disk blocks reserved, the growth
        journaled at the same offset. False, having changed nothing, when it does not apply or
        the disk has no room for it (the caller moves the chunk, and says NoSpace if it cannot).

        Raises:
            OSError, sqlite3.Error: zeroing or journaling failed; nothing changed.
        """
        start, n = chunk.offset + chunk.extent, need - chunk.extent
        if chunk.offset in self._sharers or not self._alloc.take(start, n):
            return False
        try:
            if self.store is not None:
                self.store.zero(start, n)
                if not self.store.reserve(start, n):
                    self._alloc.free(start, n)
                    return False
                self.store.move_chunks([key], chunk.offset, chunk.size, need)
        except BaseException:
            self._alloc.free(start, n)
            raise
        self.used += n
        chunk.extent = need
        return True

    def _moved(self, keys: list[ChunkKey], chunk: Chunk, to: int, size: int) -> None:
        """``chunk``'s bytes now written to the ``size``-byte extent at ``to`` (taken from the
        allocator) for ``keys``: its version follows, the extent counts as used, the move of the
        keys is journaled (:meth:`ShardStore.move_chunks`). The caller then points them at it.

        Raises:
            OSError, sqlite3.Error: the journal could not be written; the extent is free again
                and nothing is counted.
        """
        self.versions[to // PAGE] = self.versions[chunk.slot]
        self.used += size
        if self.store is not None:
            try:
                self.store.move_chunks(keys, to, chunk.size, size)
            except BaseException:
                self._alloc.free(to, size)
                self.used -= size
                raise

    def is_shared(self, chunk: Chunk) -> bool:
        return chunk.offset in self._sharers

    def exclusive_bytes(self, file_id: int) -> tuple[int, int]:
        """``(bytes held by file_id alone, bytes it shares with other keys)`` on this shard
        (its chunks' extents)."""
        alone = shared = 0
        for i in self._by_file.get(file_id, ()):
            c = self._chunks[(file_id, i)]
            if c.offset in self._sharers:
                shared += c.extent
            else:
                alone += c.extent
        return alone, shared
