"""One shard's memory: a single preallocated memory region carved into chunks.

A chunk is the unit of striping, ``chunk_size`` bytes of one file, named by
``(file_id, chunk_index)``. It is allocated, zero-filled, on its first write, as an extent of
the size class that holds the bytes written (:func:`irdma.server.region.extent_for`: 4 KiB
doubling up to ``chunk_size``; its bytes past the extent read as zeros), and a write past the
extent's end gives it a bigger one, in place when the space after it is free, else moved
(:meth:`Shard._grow`, journaled as copy-on-write moves are). A chunk a client LOCATEs (a remote reader addresses it directly: the one-sided RDMA READ
of iRDMA, HPCC 2017) is grown to its whole ``chunk_size`` first and never grows again, so no
cached place ever goes stale by growth. Free space in a region without a data directory is
always zero.

Update ops are applied synchronously, so under trio they are atomic per chunk: no other
request of any connection runs between the read and the write of an ``add``. Each applied
update bumps the chunk's version by one.

:class:`Shard` is the chunk table and the operations on it (read, write, update ops, versions,
free, trim), over its parts, bottom up (each a mixin of the one below it; the attributes are
the shard's):

* :mod:`.region`: the memory region, its free extents, :class:`Chunk` (re-exported here);
* :mod:`.lost`: the chunks refused after a damaged moves journal and the free extents held;
* :mod:`.cow`: the extents snapshots' clones share, and copy-on-write;
* :mod:`.rows`: GATHER and SCATTER of extents (sparse rows), :func:`split_extents`.
"""

from __future__ import annotations

import collections
import errno
import heapq
import logging
import os
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from irdma._errors import BadRequest, DataLost, NoSpace
from irdma.wire import (
    compress,
    optimizers,  # the optimizer-state layout, shared with the client
)
from irdma.wire.protocol import Encoding, Update, UpdateOp, op_kind

from . import optim
from .region import MAX_CHUNK_SIZE, PAGE, Allocator, Chunk, ChunkKey, ChunksPending, Region, extent_for
from .rows import SparseRows, split_extents

if TYPE_CHECKING:
    from .store import ShardStore

__all__ = ["COPIES_REMEMBERED", "MAX_CHUNK_SIZE", "PAGE", "PARK_SYNC_S", "TRIM_DELAY_S", "Chunk", "ChunkKey", "ChunksPending",
           "Region", "Shard", "extent_for", "split_extents"]

log = logging.getLogger("irdma.server")
_ZEROS = memoryview(bytes(1 << 20))
#: Whole-chunk copies (REPLACE) a shard remembers the signature of, so that a later copy of the
#: same bytes shares that chunk's extent (:meth:`Shard.replace`); the oldest are forgotten first.
COPIES_REMEMBERED = 65536
#: Seconds a freed extent of a shard with a data directory keeps its pages before it is
#: zeroed (punched out of the region file) if no chunk took it meanwhile (:meth:`Shard.trim`).
TRIM_DELAY_S = 60.0
#: Seconds an extent a chunk grew out of waits for a sync (:meth:`Shard.parked_since`) before
#: the shard server syncs by itself to free it (the kernel's own writeback runs every 5 s).
PARK_SYNC_S = 1.0


class Shard(SparseRows):
    """The chunks of one shard and the update ops on them.

    Chunk versions live in a table of little-endian u64, one slot per 4 KiB page of the
    region (slot ``chunk.offset // 4096``), so that the verbs transport can expose it to
    one-sided RDMA READs. A free slot holds 0.

    ``incarnation`` is a random non-zero u64 made with the shard's memory: a shard that restarts
    on fresh memory has a new one, so clients and ``irdma status`` tell lost chunks from holes.

    Args:
        shard_id: this shard's id in the shard map.
        name: how logs name the shard (default ``shard ID``; a shard started by hand with no
            id, no ``--meta`` and no data directory that holds one says ``unregistered shard``).
        region: the memory region that holds every chunk.
        versions: a writable buffer of ``8 * capacity // 4096`` bytes for the version table,
            or None to allocate one.
        store: the shard's data directory (:class:`irdma.server.store.ShardStore`), whose
            region and version table ``region`` and ``versions`` map: chunks are reloaded from
            its index, created and freed chunks recorded there, and its incarnation kept.
    """

    def __init__(self, shard_id: int, region: Region, versions: memoryview | None = None,
                 store: ShardStore | None = None, name: str | None = None) -> None:
        self.shard_id = shard_id
        self.name = name or f"shard {shard_id}"
        self.region = region
        self.store = store
        n = region.capacity // PAGE
        if versions is None:
            self.versions = np.zeros(n, dtype="<u8")
        else:
            self.versions = np.frombuffer(versions, dtype="<u8", count=n)
            if store is None or store.fresh:
                self.versions[:] = 0
        self._alloc = Allocator(region.capacity)
        self._chunks: dict[tuple[int, int], Chunk] = {}
        #: Creation with a data directory does I/O (zeroing the extent, recording it in the
        #: chunk index): when True, a request that needs a new chunk reserves it and raises
        #: ChunksPending instead, so a server does that I/O in a worker thread and applies the
        #: request again (:class:`irdma.server.serve.ShardServer` turns it on). False: made at
        #: once, in the caller's thread.
        self.defer_creation = False
        self._making: dict[ChunkKey, Chunk] = {}  # reserved, being made
        self._by_file: dict[int, set[int]] = {}
        #: Extents that several chunk keys share (a snapshot's clone of a file, :meth:`clone`):
        #: region offset -> the keys, the extent's *owner* first (the key that had it first).
        #: Absent for an extent held by one key (the usual case).
        self._sharers: dict[int, list[ChunkKey]] = {}
        #: Bytes of the region the chunks' extents hold (shared extents once), what STAT answers.
        self.used = 0
        self.copies = 0  # copy-on-write copies made (a metric)
        self.grown = 0  # chunks grown into a bigger extent, in place or moved (a metric)
        #: Extents chunks grew out of on a shard with durability ``fsync``: ``(number, time.monotonic()
        #: when parked, offset, size)``, counted as used and kept out of use until a sync made the
        #: move durable (:meth:`reclaim`): before that a machine crash may bring back an index
        #: that has the chunk there, and the extent must still hold its bytes. A server syncs
        #: within :data:`PARK_SYNC_S` of a park if no client does (:meth:`parked_since`).
        self._parked: collections.deque[tuple[int, float, int, int]] = collections.deque()
        self._parks = 0  # extents parked so far
        #: ``time.monotonic()`` of the first update applied since the last sync began (None:
        #: none); the dispatcher sets it (:meth:`note_update`), :meth:`sync` clears it.
        self.unsynced_since: float | None = None
        self._synced_parks = 0  # of those, how many a finished sync made durable
        #: Whole-chunk copies received (REPLACE: a resync's, a drain's, a rebalance's): (chunk
        #: index, size, version, CRC-32 of the bytes) -> the key that took them. A copy of a
        #: snapshot's or clone's key comes with the bytes and version of the key it shares an
        #: extent with on the shard it comes from: it shares that key's extent here too.
        self._received: collections.OrderedDict[tuple[int, int, int, int], ChunkKey] = collections.OrderedDict()
        #: Extents freed on a shard with a data directory, not zeroed yet: ``(time.monotonic()
        #: when freed, offset, size)``, oldest first (:meth:`trim`).
        self._freed: collections.deque[tuple[float, int, int]] = collections.deque()
        #: While set (:meth:`free_files`), the chunk-index rows dropped chunks leave go here
        #: and are deleted in one transaction at the end.
        self._unrecord: list[ChunkKey] | None = None
        self.incarnation = (int.from_bytes(os.urandom(8), "big") >> 1) or 1  # 63 bits: fits SQL integers
        #: Chunk keys refused to every request (DataLost) until freed or replaced whole: a damaged
        #: moves-journal record may have moved them (:meth:`ShardStore.lost`); key -> why.
        self.lost: dict[ChunkKey, str] = {}
        #: Free extents kept out of use while :attr:`lost` is not empty (:meth:`hold`):
        #: ``(offset, size)``, neither zeroed nor allocated.
        self.held: list[tuple[int, int]] = []
        if store is not None:
            self.incarnation = store.incarnation
            first: dict[int, ChunkKey] = {}  # extent -> the first key found at it
            for file_id, index, offset, size, extent in store.extents():
                key = (file_id, index)
                if offset in first:  # an extent shared with a snapshot's clone
                    self._sharers.setdefault(offset, [first[offset]]).append(key)
                else:
                    first[offset] = key
                    self._alloc.reserve(offset, extent)
                    self.used += extent
                self._chunks[key] = Chunk(offset, size, extent)
                self._by_file.setdefault(file_id, set()).add(index)
            self.lost = store.lost()
            if self.lost:
                self.hold(store)
            for offset, size in self._alloc.free_extents():  # what was freed before a restart, not trimmed yet
                store.zero(offset, size)
            if self.lost:
                self._report_lost()

    def sync(self) -> None:
        """Make every update applied so far durable (a shard with a data directory and
        durability ``fsync``); otherwise nothing to do. May run in a worker thread: it only
        counts the parked extents it covers; the event loop frees them (:meth:`reclaim`)."""
        if self.store is not None:
            covered = self._parks  # read first: the moves of these were journaled before the sync
            since, self.unsynced_since = self.unsynced_since, None  # updates from here on: the next sync's
            try:
                self.store.sync()
            except BaseException:
                if since is not None:
                    self.unsynced_since = min(since, self.unsynced_since or since)
                raise
            self._synced_parks = max(self._synced_parks, covered)

    def note_update(self) -> None:
        """An update (or a request that may change the region or the chunk index) is being
        applied: the server syncs it within :data:`irdma.wire.protocol.SYNC_INTERVAL_S` if no client does."""
        if self.unsynced_since is None and self.store is not None and self.store.durability == "fsync":
            self.unsynced_since = time.monotonic()

    def reclaim(self) -> int:
        """Free the extents chunks grew out of whose moves a sync made durable (call it on the
        event loop once :meth:`sync` returned); returns bytes."""
        done = 0
        while self._parked and self._parked[0][0] < self._synced_parks:
            _, _, offset, size = self._parked.popleft()
            self._release(offset, size)
            done += size
        return done

    def parked_since(self) -> float | None:
        """``time.monotonic()`` when the oldest extent a chunk grew out of was parked (waiting
        for a sync: :attr:`_parked`), or None."""
        return self._parked[0][1] if self._parked else None

    def _release(self, offset: int, size: int) -> None:
        """An extent no key holds any more goes back to the allocator (zeroed now without a data
        directory, some seconds later with one: :meth:`trim`)."""
        if self.store is not None:
            self._freed.append((time.monotonic(), offset, size))
        else:
            self.region.zero(offset, size)
        self.versions[offset // PAGE] = 0
        self._alloc.free(offset, size)
        self.used -= size

    def _alloc_extent(self, size: int, what: str) -> int:
        """A free extent of ``size`` bytes (parked ones a sync released taken back first), its
        disk blocks reserved. Raises NoSpace: none, or no disk room for it; nothing changed."""
        to = self._alloc.alloc(size)
        if to is None and self.reclaim():
            to = self._alloc.alloc(size)
        if to is None:
            parked = sum(n for _, _, _, n in self._parked)
            raise NoSpace(f"shard {self.shard_id} is full: {self.used} of {self.capacity} bytes used, no free extent"
                          f" of {size} bytes {what}" + (f" ({parked} bytes that chunks grew out of come back at the"
                                                        " next sync, within seconds)" if parked else ""))
        try:  # a full disk: the trimmable extents' blocks given back, then once more
            if self.store and not (self.store.reserve(to, size) or self.trim(0.0) and self.store.reserve(to, size)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            self._alloc.free(to, size)
            raise NoSpace(f"shard {self.shard_id} cannot hold {size} more bytes {what}: the disk of its data directory"
                          f" {self.store.path if self.store else ''} is full ({exc.strerror or exc}; other files on"
                          " that disk count too)") from None
        return to

    @property
    def capacity(self) -> int:
        return self.region.capacity

    @property
    def chunk_count(self) -> int:
        return len(self._chunks)

    def _get_or_create(self, file_id: int, chunk_index: int, chunk_size: int, existing: bool = False,
                       reach: int | None = None) -> Chunk:
        """The chunk, made if missing (unless ``existing``) with an extent that holds bytes
        ``[0, reach)`` (the whole chunk when None); an existing chunk is not grown here
        (:meth:`_grow`)."""
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is not None:
            self._refuse_lost(file_id, chunk_index)
            if chunk.size != chunk_size:
                raise BadRequest(
                    f"chunk ({file_id}, {chunk_index}) has size {chunk.size}, request says {chunk_size}"
                )
            return chunk
        if existing:
            raise DataLost(f"chunk ({file_id}, {chunk_index}) is not on shard {self.shard_id}")
        if chunk_size <= 0 or chunk_size % PAGE or chunk_size > MAX_CHUNK_SIZE:
            raise BadRequest(f"chunk size {chunk_size} must be a multiple of {PAGE} up to {MAX_CHUNK_SIZE}")
        deferred = self.defer_creation and self.store is not None
        if deferred and (file_id, chunk_index) in self._making:
            raise ChunksPending(waiting=[(file_id, chunk_index)])  # made by another request now
        extent = extent_for(chunk_size if reach is None else reach, chunk_size)
        offset = self._alloc_extent(extent, f"for a new chunk of {chunk_size}")
        chunk = Chunk(offset, chunk_size, extent)
        if deferred:
            self._making[(file_id, chunk_index)] = chunk
            self.versions[chunk.slot] = 0
            self.used += extent
            raise ChunksPending(new=[((file_id, chunk_index), chunk)])
        if self.store is not None:
            try:
                self.store.add_chunk(file_id, chunk_index, offset, chunk_size, extent)
            except BaseException:
                self._alloc.free(offset, extent)
                raise
        self.versions[chunk.slot] = 0
        self._chunks[(file_id, chunk_index)] = chunk
        self._by_file.setdefault(file_id, set()).add(chunk_index)
        self.used += extent
        return chunk

    def install(self, made: list[tuple[ChunkKey, Chunk]]) -> None:
        """Take reserved chunks into service once made (zeroed and recorded in the data
        directory): from now on requests find them (version 0, all zeros)."""
        for key, chunk in made:
            if self._making.get(key) is chunk:
                del self._making[key]
                self._chunks[key] = chunk
                self._by_file.setdefault(key[0], set()).add(key[1])

    def abandon(self, reserved: list[tuple[ChunkKey, Chunk]]) -> None:
        """Give back reserved chunks that could not be made: their extents are free again."""
        for key, chunk in reserved:
            if self._making.get(key) is chunk:
                del self._making[key]
                self._alloc.free(chunk.offset, chunk.extent)
                self.used -= chunk.extent

    def read(self, file_id: int, chunk_index: int, offset: int, length: int) -> tuple[int, memoryview | None]:
        """Bytes ``[offset, offset+length)`` of a chunk.

        Returns:
            ``(version, view)``; ``view`` is None when the chunk does not exist (a hole: zeros,
            version 0). The view aliases the region (it is not a snapshot) when the range lies
            in the chunk's extent; a range past the extent's end is a copy, zeros past it.

        Raises:
            BadRequest: the range leaves the chunk.
        """
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None:
            return 0, None
        self._refuse_lost(file_id, chunk_index)
        if offset < 0 or length < 0 or offset + length > chunk.size:
            raise BadRequest(f"range [{offset}, {offset + length}) leaves the {chunk.size}-byte chunk")
        start = chunk.offset + offset
        if offset + length <= chunk.extent:
            return int(self.versions[chunk.slot]), self.region.view[start : start + length]
        out = bytearray(length)
        inside = max(0, chunk.extent - offset)
        out[:inside] = self.region.view[start : start + inside]
        return int(self.versions[chunk.slot]), memoryview(out)

    def write(
        self,
        file_id: int,
        chunk_index: int,
        chunk_size: int,
        offset: int,
        op: UpdateOp | Update,
        data: memoryview | bytes,
        existing: bool = False,
    ) -> int:
        """Apply an update op to ``[offset, offset+len(data))`` of a chunk, creating it if needed
        (unless ``existing``: then a missing chunk raises DataLost and nothing is created).

        ``data`` for ``ADD`` is little-endian float32; the sum is float32 (IEEE-754, round to
        nearest even), the same as numpy's ``+=``. For an optimizer (:class:`Update` of SGD,
        ADAM, ADAGRAD, RMSPROP, FTRL) ``data`` is a float32 gradient and one step is applied with the
        chunk's state chunk (created on the first step; :mod:`irdma.server.optim`). A state
        chunk (index ``optimizers.STATE_BASE + i``) takes only ``assign`` (restoring a checkpoint).
        An :class:`Update` with an ``encoding`` (protocol 8) carries a compressed gradient:
        ``data`` is decoded first (:func:`irdma.wire.compress.decode`, into a new buffer: a payload
        in a staging buffer is never applied in place) and the op applied to the ``4 * n``
        decoded bytes at ``offset``, by the same code as a dense write of them.

        Returns:
            The chunk's version after the update.

        Raises:
            BadRequest: the range leaves the chunk, the chunk size disagrees with the chunk's,
                an ``ADD`` is not 4-byte aligned, or an encoded payload is malformed or decodes
                past the chunk. Nothing changed.
            NoSpace: the chunk is new and the region has no room for it. Nothing changed.
            DataLost: ``existing`` and the chunk is not here, or the shard refuses the chunk
                (:attr:`lost`) and this is not an assign of all of it. Nothing changed.
        """
        if isinstance(op, Update) and op.round is not None:  # summed by the dispatcher's rounds, never as is
            raise BadRequest("a round's contribution reaches the shard only as its round's update")
        if isinstance(op, Update) and op.encoding:
            data, op = _decoded(op, data, offset, chunk_size), op.dense
        n = len(data)
        if offset < 0 or offset + n > chunk_size:
            raise BadRequest(f"range [{offset}, {offset + n}) leaves the {chunk_size}-byte chunk")
        kind = op_kind(op)
        if kind.is_float32 and (offset % 4 or n % 4):
            raise BadRequest(f"{kind.name.lower()} needs float32 alignment: offset {offset} and length {n}"
                             " must be multiples of 4")
        if optimizers.is_state(chunk_index) and kind != UpdateOp.ASSIGN:
            raise BadRequest(f"chunk index {chunk_index} names optimizer state: only assign writes it")
        if kind.is_optimizer and not isinstance(op, Update):
            raise BadRequest(f"{kind.name.lower()} needs its arguments")
        if kind.is_optimizer:
            assert isinstance(op, Update)
            skey = (file_id, optimizers.state_index(chunk_index))
            had_state = skey in self._chunks
            pending = ChunksPending()  # the state and the chunk are reserved together
            state: Chunk | None = None
            try:
                state = self._state_for(file_id, chunk_index, chunk_size, op, existing)
            except ChunksPending as more:
                pending.add(more)
            try:
                chunk = self._get_or_create(file_id, chunk_index, chunk_size, existing, offset + n)
                if not pending:
                    self._grow((file_id, chunk_index), chunk, offset + n)
            except ChunksPending as more:
                pending.add(more)
            except Exception:
                self.abandon(pending.new)
                if not had_state and skey in self._chunks:  # a refused write leaves nothing behind
                    self._drop(*skey)
                raise
            if pending:
                raise pending
            assert state is not None
            self._unshare((file_id, chunk_index))
            self._unshare(skey)
            start = chunk.offset + offset
            optim.apply(op, self.region.view[start : start + n], data,
                        self.region.view[state.offset : state.offset + state.size], chunk_size, offset)
            version = self._bump(chunk)
            self.versions[state.slot] = version  # the state's version follows its chunk's
            return version
        if self.lost and kind == UpdateOp.ASSIGN and offset == 0 and n == chunk_size and \
                (file_id, chunk_index) in self.lost:  # a refused chunk rewritten whole: trusted again
            was = self._chunks[(file_id, chunk_index)]
            return self.replace(file_id, chunk_index, chunk_size, data, int(self.versions[was.slot]) + 1)
        chunk = self._get_or_create(file_id, chunk_index, chunk_size, existing, offset + n)
        if chunk.offset in self._sharers and offset + n <= chunk.extent and \
                self._redirect((file_id, chunk_index), chunk, offset, n, kind, data):
            return self._bump(chunk)
        self._grow((file_id, chunk_index), chunk, offset + n)  # a shared one: this key alone, to its own copy
        self._unshare((file_id, chunk_index))
        start = chunk.offset + offset
        if kind == UpdateOp.ASSIGN:
            self.region.view[start : start + n] = data
        else:
            dst = np.frombuffer(self.region.view[start : start + n], dtype="<f4")
            dst += np.frombuffer(data, dtype="<f4")
        return self._bump(chunk)

    def _state_for(self, file_id: int, chunk_index: int, chunk_size: int, update: Update, existing: bool) -> Chunk:
        """The state chunk of a chunk, made (or made afresh) for ``update``'s optimizer
        (allocated before the chunk itself; :meth:`write` drops it again if the chunk finds no room)."""
        if existing and (file_id, chunk_index) not in self._chunks:
            raise DataLost(f"chunk ({file_id}, {chunk_index}) is not on shard {self.shard_id}")
        size = optimizers.state_size(update.op, chunk_size)
        key = (file_id, optimizers.state_index(chunk_index))
        state = self._chunks.get(key)
        if state is not None and state.size != size:  # made for another optimizer
            self._drop(*key)
            state = None
        fresh = state is None
        state = self._get_or_create(file_id, optimizers.state_index(chunk_index), size)
        self._grow(key, state, size)  # read whole by the step (a copy received may have held less)
        self._unshare(key)  # before init_state may rewrite it (another optimizer): a snapshot keeps its own
        view = self.region.view[state.offset : state.offset + state.size]
        if fresh or optimizers.header_op(view) != update.op:
            optim.init_state(update, view, chunk_size)
        return state

    def state_snapshot(self, file_id: int, chunk_index: int) -> tuple[int, bytes] | None:
        """``(version, copy)`` of chunk ``chunk_index``'s optimizer state, or None."""
        return self.snapshot(file_id, optimizers.state_index(chunk_index))

    def version_of(self, file_id: int, chunk_index: int) -> int:
        """The chunk's version; 0 when the shard has no such chunk (or refuses it: :attr:`lost`)."""
        chunk = self._chunks.get((file_id, chunk_index))
        return 0 if chunk is None or (file_id, chunk_index) in self.lost else int(self.versions[chunk.slot])

    def snapshot(self, file_id: int, chunk_index: int) -> tuple[int, bytes] | None:
        """``(version, a copy of the whole chunk)``, or None when the shard has no such chunk.

        Raises:
            DataLost: the shard refuses the chunk (:attr:`lost`).
        """
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None:
            return None
        self._refuse_lost(file_id, chunk_index)
        held = bytes(self.region.view[chunk.offset : chunk.offset + chunk.extent])
        return int(self.versions[chunk.slot]), held + bytes(chunk.size - chunk.extent)

    def copy_of(self, file_id: int, chunk_index: int) -> tuple[int, int, bytes] | None:
        """``(version, chunk size, a copy of the bytes its extent holds)`` (the rest of the chunk
        is zeros: what a whole-chunk copy, REPLACE, sends since protocol 12), or None when the
        shard has no such chunk.

        Raises:
            DataLost: the shard refuses the chunk (:attr:`lost`).
        """
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None:
            return None
        self._refuse_lost(file_id, chunk_index)
        return int(self.versions[chunk.slot]), chunk.size, bytes(self.region.view[chunk.offset : chunk.offset + chunk.extent])

    def checksum(self, file_id: int, chunk_index: int) -> tuple[int, int]:
        """``(version, zlib CRC-32 of the whole chunk)`` (its extent's bytes, then zeros up to its
        size); ``(0, 0)`` when there is no such chunk or the shard refuses it (:attr:`lost`: as
        absent, so fsck and resync see it missing)."""
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None or (file_id, chunk_index) in self.lost:
            return 0, 0
        return int(self.versions[chunk.slot]), crc_padded(self.region.view[chunk.offset : chunk.offset + chunk.extent],
                                                          chunk.size)

    def replace(self, file_id: int, chunk_index: int, chunk_size: int, data: memoryview | bytes, version: int) -> int:
        """Set a whole chunk (creating it if needed) and its version: how a replica that missed
        updates is brought level with its predecessor's copy.

        ``data`` is the chunk's first bytes, zeros after them (protocol 12: a copy sends what its
        extent holds; the whole chunk before). The chunk here takes the extent that holds its
        bytes up to the last one not zero (:func:`extent_of`), whatever the sender's was.
        A chunk the shard refused (:attr:`lost`) is trusted again once its bytes are written.
        A new key whose bytes and version equal a chunk copied here before shares its extent
        (:meth:`_share_copy`): a move copies a shared extent once.

        Raises:
            BadRequest: ``data`` is longer than ``chunk_size`` bytes, or the version is 0. NoSpace.
            Nothing changed in each case.
        """
        if len(data) > chunk_size or version <= 0:
            raise BadRequest(f"a whole-chunk copy needs at most {chunk_size} bytes and a version > 0,"
                             f" got {len(data)} bytes at version {version}")
        key = (file_id, chunk_index)
        extent = extent_of(data, chunk_size)
        body = memoryview(data).cast("B")[:extent]
        sig = (chunk_index, chunk_size, version, crc_padded(body, extent))
        if key not in self._chunks and key not in self._making and self._share_copy(key, sig, body):
            return version
        why = self.lost.pop(key, None)  # rewritten whole below: trusted again
        try:
            chunk = self._chunks.get(key)
            if chunk is not None and chunk.size != chunk_size:
                self._drop(file_id, chunk_index)
            chunk = self._get_or_create(file_id, chunk_index, chunk_size, reach=extent)
            self._grow(key, chunk, extent)
            self._unshare(key)
        except BaseException:
            if why is not None and key in self._chunks:
                self.lost[key] = why
            raise
        start = chunk.offset
        self.region.view[start : start + len(body)] = body
        self.region.view[start + len(body) : start + chunk.extent] = bytes(chunk.extent - len(body))
        self.versions[chunk.slot] = version
        if why is not None and self.store is not None:
            self.store.forget_lost([key])
            self._release_held()
        self._received[sig] = key
        self._received.move_to_end(sig)
        if len(self._received) > COPIES_REMEMBERED:
            self._received.popitem(last=False)
        return version

    def _unrecorded(self, file_id: int, chunk_index: int) -> None:
        assert self.store is not None
        if self._unrecord is not None:
            self._unrecord.append((file_id, chunk_index))
        else:
            self.store.unrecord_chunks([(file_id, chunk_index)])

    def has_file(self, file_id: int) -> bool:
        return file_id in self._by_file

    def file_chunks(self, file_id: int) -> list[tuple[int, int, int, int]]:
        """Every chunk of ``file_id`` here (optimizer state left out) as ``(file_id, chunk
        index, chunk size in bytes, version)``, in index order."""
        out = []
        for i in sorted(self._by_file.get(file_id, ())):
            if not optimizers.is_state(i):
                c = self._chunks[(file_id, i)]
                out.append((file_id, i, c.size, int(self.versions[c.slot])))
        return out

    def _bump(self, chunk: Chunk) -> int:
        self.versions[chunk.slot] += 1
        return int(self.versions[chunk.slot])

    def list_chunks(self, after_file: int, after_chunk: int, limit: int) -> list[tuple[int, int, int, int]]:
        """Up to ``limit`` chunks strictly after ``(after_file, after_chunk)`` in (file, chunk) order,
        as ``(file_id, chunk_index, chunk_size in bytes, version)``. File ids are inode numbers
        (never 0), so ``(0, 0)`` starts from the first chunk; pass the last entry to go on."""
        keys = heapq.nsmallest(limit, (k for k in self._chunks if k > (after_file, after_chunk)
                                       and not optimizers.is_state(k[1]) and k not in self.lost))  # state follows its chunk
        return [(f, i, self._chunks[(f, i)].size, int(self.versions[self._chunks[(f, i)].slot])) for f, i in keys]

    def locate(self, file_id: int, chunk_index: int, create_size: int = 0) -> Chunk | None:
        """The chunk's place in the region; allocated (zeroed) first if ``create_size`` > 0.

        Raises:
            BadRequest, NoSpace: as :meth:`write`.
        """
        chunk = self._get_or_create(file_id, chunk_index, create_size) if create_size else \
            self._chunks.get((file_id, chunk_index))
        if chunk is not None:
            self._refuse_lost(file_id, chunk_index)
            # a client reads and writes the whole chunk from this place: its extent holds it
            # all, so it never grows (and never moves by growing) after this
            self._grow((file_id, chunk_index), chunk, chunk.size)
            chunk.located = True
        return chunk

    def commit_in_place(self, file_id: int, chunk_index: int, region_offset: int, offset: int, length: int) -> int:
        """Account for an assign whose bytes a client wrote into the chunk by RDMA WRITE.

        Returns:
            The chunk's version after the update.

        Raises:
            BadRequest: the chunk is gone or moved (the client used a stale location), or the
                range leaves it.
        """
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None or chunk.offset != region_offset:
            raise BadRequest(f"chunk ({file_id}, {chunk_index}) is not at region offset {region_offset}: locate it again")
        self._refuse_lost(file_id, chunk_index)
        if offset + length > chunk.size:
            raise BadRequest(f"range [{offset}, {offset + length}) leaves the {chunk.size}-byte chunk")
        if not chunk.located or offset + length > chunk.extent:  # never told where: not this place
            raise BadRequest(f"chunk ({file_id}, {chunk_index}) was not located at region offset {region_offset}:"
                             " locate it again")
        if chunk.offset in self._sharers:
            # the bytes landed in an extent a snapshot shares: a client must stage such writes
            log.error("an in-place write landed in chunk (%d, %d), which a snapshot shares", file_id, chunk_index)
            raise BadRequest(f"chunk ({file_id}, {chunk_index}) is shared with a snapshot: stage writes to it")
        return self._bump(chunk)

    def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        """Zero a chunk from ``offset`` to its end (the tail cut by a truncate).

        Returns:
            The chunk's version after the update (0 if there is no such chunk).
        """
        chunk = self._chunks.get((file_id, chunk_index))
        if chunk is None:
            return 0
        if offset > chunk.size:
            raise BadRequest(f"offset {offset} is past the {chunk.size}-byte chunk")
        if offset == 0:
            self._drop(file_id, chunk_index)
            return 0
        self._refuse_lost(file_id, chunk_index)
        self._unshare((file_id, chunk_index))
        if offset < chunk.extent:  # past the extent it is zeros already
            self.region.view[chunk.offset + offset : chunk.offset + chunk.extent] = bytes(chunk.extent - offset)
        return self._bump(chunk)

    def free(self, file_id: int, first_chunk: int) -> int:
        """Drop every chunk of ``file_id`` whose index is ``>= first_chunk``.

        Returns:
            How many chunks were freed.
        """
        if self.store is not None and self._unrecord is None:
            return self.free_files([file_id], first_chunk)
        indices = [i for i in self._by_file.get(file_id, ()) if first_chunk <= i < optimizers.STATE_BASE]
        for i in indices:
            self._drop(file_id, i)
        for i in [i for i in self._by_file.get(file_id, ()) if i >= optimizers.state_index(first_chunk)]:
            self._drop(file_id, i)  # their optimizer state (orphans of a crash too)
        return len(indices)

    def free_files(self, file_ids: Sequence[int], first_chunk: int = 0) -> int:
        """:meth:`free` of each of ``file_ids``, with one chunk-index transaction for them all
        (a snapshot's delete: :class:`irdma.wire.protocol.FreeFiles`). Returns the chunks freed."""
        if self.store is None:
            return sum(self.free(f, first_chunk) for f in file_ids)
        self._unrecord = []
        try:
            freed = sum(self.free(f, first_chunk) for f in file_ids)
        finally:
            gone, self._unrecord = self._unrecord, None
            if gone:
                self.store.unrecord_chunks(gone)
        return freed

    def trim(self, older_than: float = TRIM_DELAY_S) -> int:
        """Zero (punch out of the region file) the extents freed more than ``older_than``
        seconds ago that are still free; returns how many bytes.

        A freed extent is not zeroed at once: a snapshot's delete frees many chunks and the next
        round's copy-on-write copies take their extents again at once, and an extent punched out
        of the file would fault its pages in again, page by page (twice the shard's CPU per
        copied chunk, measured). Nothing reads a free extent, and each one is zeroed when made
        a chunk again (:meth:`ShardStore.add_chunks`) or overwritten whole (a copy-on-write copy),
        so the bytes it keeps meanwhile are never seen; it only holds disk until trimmed (the
        deferred frees of ZFS and the batched discards of SSDs, "fstrim").
        """
        if self.store is None:
            return 0
        self.reclaim()
        limit = time.monotonic() - older_than
        done = 0
        while self._freed and self._freed[0][0] <= limit:
            _, offset, size = self._freed.popleft()
            for start, n in self._alloc.free_parts(offset, size):
                self.store.zero(start, n)
                done += n
        return done

    def _drop(self, file_id: int, chunk_index: int) -> None:
        if not optimizers.is_state(chunk_index) and (file_id, optimizers.state_index(chunk_index)) in self._chunks:
            self._drop(file_id, optimizers.state_index(chunk_index))  # a chunk's state goes with it
        chunk = self._chunks.pop((file_id, chunk_index))
        if self.lost.pop((file_id, chunk_index), None) is not None:  # (its row goes with the chunk's: lost_freed)
            self._release_held()
        idx = self._by_file[file_id]
        idx.discard(chunk_index)
        if not idx:
            del self._by_file[file_id]
        twin = self._sharers.get(chunk.offset)
        if twin is not None:  # other keys still hold the extent: only this key goes
            twin.remove((file_id, chunk_index))
            if len(twin) < 2:
                del self._sharers[chunk.offset]
            if self.store is not None:
                self._unrecorded(file_id, chunk_index)
            return
        if self.store is not None:
            self._unrecorded(file_id, chunk_index)
        self._release(chunk.offset, chunk.extent)


def crc_padded(data: memoryview | bytes, size: int) -> int:
    """zlib CRC-32 of ``data`` followed by zeros up to ``size`` bytes (a chunk's bytes past its
    extent; :func:`irdma.client.cache.chunk_crc` computes the same on the client)."""
    crc = zlib.crc32(data)
    left = size - len(data)
    while left > 0:
        n = min(left, len(_ZEROS))
        crc = zlib.crc32(_ZEROS[:n], crc)
        left -= n
    return crc


def extent_of(data: memoryview | bytes, chunk_size: int) -> int:
    """The size class (:func:`extent_for`) of the extent that holds ``data``, a chunk's first
    bytes, up to its last byte that is not zero (one page for all zeros): what a whole-chunk
    copy takes, so that equal chunks take equal extents whatever extent they came from."""
    raw = np.frombuffer(data, dtype=np.uint8)
    extent = extent_for(len(raw), chunk_size)
    while extent > PAGE:
        smaller = max(PAGE, 1 << ((extent - 1).bit_length() - 1))  # the class below
        if raw[smaller:extent].any():
            break
        extent = smaller
    return extent


def _decoded(op: Update, payload: memoryview | bytes, offset: int, chunk_size: int) -> memoryview:
    """The dense bytes of an encoded write (little-endian float32, a new buffer).

    Raises:
        BadRequest: the payload is malformed, or its vector does not fit the chunk at ``offset``.
    """
    if offset < 0 or offset % 4 or offset > chunk_size:
        raise BadRequest(f"an encoded write at offset {offset} of a {chunk_size}-byte chunk: the offset must be"
                         " float32 aligned and inside the chunk")
    try:
        dense = compress.decode(payload, op.encoding, limit=(chunk_size - offset) // 4)
    except ValueError as exc:
        what = f"{op.op.name.lower()} with a {Encoding(op.encoding).name.lower()} payload"
        raise BadRequest(f"{what} refused: {exc}") from None
    return memoryview(dense).cast("B")  # type: ignore[arg-type]
