"""Sparse rows: a shard's GATHER and SCATTER of extents of a file's chunks (protocol 7).

:func:`split_extents` checks a SCATTER's extents and groups them by chunk before anything is
applied; :class:`SparseRows` is the part of :class:`irdma.server.shard.Shard` that copies
extents out (:meth:`SparseRows.gather`) and applies an update op to them
(:meth:`SparseRows.scatter`), with the chunk table's own methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from irdma._errors import BadRequest
from irdma.wire import optimizers  # the optimizer-state layout, shared with the client
from irdma.wire.extents import elements, fill, move, positions, row_view
from irdma.wire.protocol import Update, UpdateOp, op_kind

from . import optim
from .cow import SharedExtents
from .region import Chunk, ChunkKey, ChunksPending


class SparseRows(SharedExtents):
    """GATHER and SCATTER of a :class:`~irdma.server.shard.Shard` (a mixin: the shard makes,
    finds and drops the chunks)."""

    if TYPE_CHECKING:
        def _get_or_create(self, file_id: int, chunk_index: int, chunk_size: int,
                           existing: bool = False, reach: int | None = None) -> Chunk: ...

        def _state_for(self, file_id: int, chunk_index: int, chunk_size: int, update: Update,
                       existing: bool) -> Chunk: ...

        def _drop(self, file_id: int, chunk_index: int) -> None: ...

        def abandon(self, reserved: list[tuple[ChunkKey, Chunk]]) -> None: ...

        def _bump(self, chunk: Chunk) -> int: ...

        def _grow(self, key: ChunkKey, chunk: Chunk, end: int) -> None: ...

    def gather(self, file_id: int, chunk: np.ndarray, offset: np.ndarray, length: np.ndarray,
               out: memoryview) -> np.ndarray:
        """Copy extents of a file into ``out``, one after the other (GATHER: sparse rows).

        ``chunk``, ``offset``, ``length``: int64 arrays, one extent each (chunk index, byte
        offset in the chunk, bytes); ``out`` has room for exactly their total. A missing chunk
        reads as zeros. A copy, so the caller may send it while updates go on; one fancy-indexed
        copy per distinct extent length (:func:`irdma.wire.extents.move`).

        Returns:
            The version of each extent's chunk (uint64; 0 for a hole).

        Raises:
            BadRequest: an extent leaves its chunk, or ``out`` is not the extents' total.
        """
        pos = positions(length)
        if pos[-1] != len(out):
            raise BadRequest(f"{len(out)} bytes of room for extents of {pos[-1]}")
        dst = np.frombuffer(out, dtype=np.uint8)
        if not len(chunk):
            return np.zeros(0, dtype=np.uint64)
        names, inv = np.unique(chunk, return_inverse=True)
        base = np.full(len(names), -1, dtype=np.int64)
        size = np.zeros(len(names), dtype=np.int64)
        extent = np.zeros(len(names), dtype=np.int64)
        ver = np.zeros(len(names), dtype=np.uint64)
        for k, index in enumerate(names.tolist()):
            c = self._chunks.get((file_id, index))
            if c is not None:
                self._refuse_lost(file_id, index)
                base[k], size[k], extent[k], ver[k] = c.offset, c.size, c.extent, self.versions[c.slot]
        inv = inv.reshape(-1)
        held = base[inv] >= 0
        if bool((held & (offset + length > size[inv])).any()):
            raise BadRequest(f"an extent leaves its chunk of file {file_id}")
        at = pos[:-1]
        inside = held & (offset + length <= extent[inv])  # past a chunk's extent it reads as zeros
        region = np.frombuffer(self.region.view, dtype=np.uint8)
        move(dst, at[inside], region, (base[inv] + offset)[inside], length[inside])
        fill(dst, at[~inside], length[~inside])
        for k in np.flatnonzero(held & ~inside).tolist():  # rows across an extent's end: its part in it
            n = int(extent[inv[k]] - offset[k])
            if n > 0:
                start = int(base[inv[k]] + offset[k])
                dst[at[k] : at[k] + n] = region[start : start + n]
        return ver[inv]

    def scatter(self, file_id: int, chunk_size: int, parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
                op: UpdateOp | Update, data: memoryview | bytes, existing: bool = False) -> list[int]:
        """Apply an update op to extents of chunks (SCATTER: sparse rows), each chunk with one
        version bump; every op of :meth:`write`, applied extent by extent.

        ``parts``: per chunk, ``(chunk index, offsets in the chunk, lengths, positions in
        data)`` as :func:`split_extents` makes them (checked there: in range, aligned, not
        overlapping). Every chunk (and optimizer state) is found or made first: a NoSpace or
        DataLost then undoes what this call made and changes nothing; only then are the bytes
        applied (assign and add in one fancy-indexed operation over the region).

        Returns:
            Each part's chunk version after the update, in order.

        Raises:
            BadRequest: an op other than assign on optimizer state, an optimizer without its
                arguments. NoSpace, DataLost: as :meth:`write`. Nothing changed in each case.
        """
        kind = op_kind(op)
        if kind.is_optimizer and not isinstance(op, Update):
            raise BadRequest(f"{kind.name.lower()} needs its arguments")
        if kind != UpdateOp.ASSIGN and any(optimizers.is_state(i) for i, _, _, _ in parts):
            raise BadRequest("optimizer state chunks take only assign")
        made: list[tuple[int, int]] = []  # what this call created: dropped again if it fails
        pending = ChunksPending()  # deferred creation: every new chunk reserved, then made at once
        chunks: list[Chunk] = []
        states: list[Chunk] = []
        try:
            for index, o, n, _ in parts:
                if kind.is_optimizer:
                    assert isinstance(op, Update)
                    skey = (file_id, optimizers.state_index(index))
                    had = skey in self._chunks
                    try:
                        states.append(self._state_for(file_id, index, chunk_size, op, existing))
                    except ChunksPending as more:
                        pending.add(more)
                    if not had and skey in self._chunks:
                        made.append(skey)
                key = (file_id, index)
                had = key in self._chunks
                try:
                    chunks.append(self._get_or_create(file_id, index, chunk_size, existing, int((o + n).max())
                                                      if len(o) else 0))
                except ChunksPending as more:
                    pending.add(more)
                if not had and key in self._chunks:
                    made.append(key)
        except BaseException:
            self.abandon(pending.new)
            for key in reversed(made):
                if key in self._chunks:
                    self._drop(*key)
            raise
        if pending:
            raise pending
        try:
            for (index, offs, lens, _), c in zip(parts, chunks, strict=True):
                # grown and copied on write first: nothing applied yet if either finds no room
                self._grow((file_id, index), c, int((offs + lens).max()) if len(offs) else 0)
                self._unshare((file_id, index))
                if kind.is_optimizer:
                    self._unshare((file_id, optimizers.state_index(index)))
        except BaseException:
            for key in reversed(made):
                if key in self._chunks:
                    self._drop(*key)
            raise
        src = np.frombuffer(data, dtype=np.uint8)
        lengths = np.concatenate([n for _, _, n, _ in parts])
        at = np.concatenate([a for _, _, _, a in parts])  # each extent's place in the payload
        if kind.is_optimizer:
            assert isinstance(op, Update)
            # every row of every chunk in one step: taken from the region, stepped, put back
            per_extent = np.repeat(np.arange(len(parts)), [len(o) for _, o, _, _ in parts])
            within = np.concatenate([offs for _, offs, _, _ in parts])
            base = np.array([c.offset for c in chunks], dtype=np.int64)[per_extent] + within
            state = np.array([st.offset + optimizers.HEADER for st in states], dtype=np.int64)[per_extent] + within
            if len(lengths) and int(lengths.min()) == int(lengths.max()):  # one length (none across a chunk's end)
                row_bytes = int(lengths[0])  # whole rows, each one element: a copy, the payload stays as sent
                rows = row_view(src, row_bytes)[at].view("<f4").reshape(len(at), row_bytes // 4)
                optim.apply_rows(op, self.region.view, rows, base, state, chunk_size)
            else:  # float by float
                counts = lengths // 4
                grads = np.frombuffer(data, dtype="<f4")[elements(at // 4, counts)]
                optim.apply_region(op, self.region.view, grads, elements(base // 4, counts),
                                   elements(state // 4, counts), chunk_size // 4)
        else:
            move(np.frombuffer(self.region.view, dtype=np.uint8),
                 np.concatenate([c.offset + o for c, (_, o, _, _) in zip(chunks, parts, strict=True)]), src,
                 at, lengths, add=kind == UpdateOp.ADD)
        versions = [self._bump(c) for c in chunks]
        for st, v in zip(states, versions, strict=False):
            self.versions[st.slot] = v  # the state's version follows its chunk's
        return versions


def _by_chunk(chunk: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(chunk index, positions of its extents in request order)`` for each chunk named."""
    order = np.argsort(chunk, kind="stable")
    sorted_chunks = chunk[order]
    cuts = np.flatnonzero(np.diff(sorted_chunks)) + 1
    return [(int(sorted_chunks[g[0]]), g) for g in np.split(order, cuts) if len(g)] if len(order) else []


def split_extents(ext: np.ndarray, chunk_size: int, op: UpdateOp | Update,
                  payload: int) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Check a SCATTER's extents and group them by chunk, before anything is applied.

    Returns:
        ``(chunk index, offsets, lengths, payload positions)`` per chunk, int64 arrays, in
        chunk order.

    Raises:
        BadRequest: no extent, an extent leaves its chunk, extents of one chunk overlap, the
            payload is not the extents' total, or an op other than assign is not aligned to float32.
    """
    chunk = ext["chunk"].astype(np.int64)
    offset = ext["offset"].astype(np.int64)
    length = ext["length"].astype(np.int64)
    if not len(chunk):
        raise BadRequest("a scatter names no extent")
    if int(length.min()) <= 0:
        raise BadRequest("an extent of a scatter is empty")
    pos = positions(length)
    if pos[-1] != payload:
        raise BadRequest(f"a scatter carries {payload} bytes for extents of {pos[-1]}")
    if int((offset + length).max()) > chunk_size:
        raise BadRequest(f"an extent leaves the {chunk_size}-byte chunk")
    if op_kind(op).is_float32 and bool(((offset % 4) | (length % 4)).any()):
        raise BadRequest(f"{op_kind(op).name.lower()} needs float32 alignment: every extent's offset and length"
                         " must be multiples of 4")
    order = np.lexsort((offset, chunk))
    c, o, e = chunk[order], offset[order], (offset + length)[order]
    if len(order) > 1 and bool(((c[1:] == c[:-1]) & (o[1:] < e[:-1])).any()):
        raise BadRequest("extents of one chunk overlap: sum duplicate rows into one first")
    return [(index, offset[sel], length[sel], pos[sel]) for index, sel in _by_chunk(chunk)]
