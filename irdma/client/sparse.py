"""Sparse rows of a 2-D float32 file: pulls by GATHER and pushes by SCATTER, one request per
shard (per chain when replicated) carrying every row it holds (ps-lite's sparse pull and push:
Li et al., OSDI 2014).

:class:`SparseRows` works by layout (:meth:`~SparseRows.read_rows_into`,
:meth:`~SparseRows.write_rows_from`) over the client's :class:`~irdma.client.datapath.DataPath`
(its chained updates, request ids, payload limit and read cache) and by path
(:meth:`~SparseRows.pull_rows`, :meth:`~SparseRows.push_rows`: the row length from the file's
``user.irdma.shape``, duplicates summed, the chunk map and mtime kept). A row is
``row_bytes`` bytes at byte ``id * row_bytes`` of the file; one that crosses a chunk boundary is
two extents.

A pull or push by path costs no metadata call in the steady state: the table's inode, shape
and chunk map, read with two calls, serve this client's pulls and pushes of that path for
:data:`TABLE_CACHE_S` seconds while the shard map's epoch stays the same (as a mount's attribute
cache and the kernel's trust what they were told for a second), with the chunks this client's
pushes create added. A change this client makes to the namespace, a file's size, attributes or
chunks (a call of :data:`irdma.meta.aio.CHANGES`, other than this module's own mtime
refreshes), a restart of a shard the map names, or a pull of a row past the cached size drops
them; another client's change is seen within the second.
Bytes are never taken on trust: a pull that meets a chunk the cached map does not name and the
shard does not hold (a hole, or a chunk another client made on a shard that lost it since) reads
the map again and pulls again with it, so a lost chunk is DataLost, never zeros.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import trio

from .._concurrency import open_nursery
from .._errors import DataLost, Dirty, InvalidArgument, IrdmaError, NoAttribute, ShardUnavailable
from ..meta import Inode
from ..meta.base import XATTR_SHAPE, parse_shape
from ..placement import Layout
from ..transport import ShardConnection
from ..wire.extents import move, positions
from ..wire.optimizers import parse_update
from ..wire.protocol import DEFAULT_MAX_PAYLOAD, Chain, Part, Update, UpdateOp
from ..wire.protocol import extents as P_extents
from .datapath import ChunkMap, DataPath, NewChunk, as_bytes_view, pack
from .view import layout_of, writable

#: Most extents one GATHER or SCATTER carries (a verbs SCATTER of them stays under 256 batches).
MAX_EXTENTS = 1 << 16
#: Seconds between mtime refreshes by sparse pushes that neither grow a file nor make chunks.
MTIME_LAZY_S = 1.0
#: Seconds a table's inode, shape and chunk map serve pulls and pushes by path (module docstring).
TABLE_CACHE_S = 1.0


def sum_duplicates(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the same id summed into one (ps-lite's sparse push sums what a batch repeats).

    ``ids``: int64, shape ``(n,)``; ``rows``: float32, shape ``(n, k)``, C-contiguous. Returns
    ``(ids, rows)`` unchanged when no id repeats, else the distinct ids ascending and, for each,
    the sum of its rows (float32, ``(distinct, k)``, a new array; numpy's summation order, so
    within float32 rounding of the sum in the order given).

    The sums run over whole rows, one numpy reduction per distinct repeat count (a Zipf batch
    of 10,000 ids has a few dozen): ``np.add.reduceat`` along the rows walks each column with
    a stride of a row, 3-4x slower here on rows of 1 KiB.
    """
    if len(ids) < 2:
        return ids, rows
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.empty(len(ids), dtype=bool)
    first[0] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    if len(starts) == len(ids):
        return ids, rows
    k = rows.shape[1]
    whole = np.dtype((np.void, 4 * k))  # a row as one element: fancy indexing copies it with one memcpy
    as_void = np.ascontiguousarray(rows, dtype="<f4").view(whole).reshape(-1)
    summed = as_void[order[starts]].view("<f4").reshape(len(starts), k)  # each id's first row
    counts = np.diff(np.r_[starts, len(ids)])
    for c in np.unique(counts[counts > 1]).tolist():
        groups = np.flatnonzero(counts == c)
        if len(groups) == 1:  # one id repeated c times (a popular row): its rows in place
            g = int(groups[0])
            one = as_void[order[starts[g] : starts[g] + c]].view("<f4").reshape(c, k)
            summed[g] = np.add.reduce(one, axis=0)
        else:
            many = as_void[order[starts[groups][:, None] + np.arange(c)]].view("<f4").reshape(len(groups), c, k)
            summed[groups] = np.add.reduce(many, axis=1)
    return sorted_ids[starts], summed


@dataclasses.dataclass
class _Table:
    """A table as a pull or push by path read it: the inode, its ``user.irdma.shape`` (raw, or
    None), its chunk map (this client's pushes add what they create), when (monotonic s) and at
    which shard-map epoch, and the incarnations of the shards its map names as this client's
    connections knew them then (a shard that restarted since makes the map suspect)."""

    inode: Inode
    shape: bytes | None
    chunks: ChunkMap
    at: float
    epoch: int
    incarnations: dict[int, int | None]  # of the shards the map names, as this client knew them then
    changes: int  # the client's AsyncMeta.changes when it was read


class SparseRows:
    """The sparse rows of one client's files (see the module docstring).

    Args:
        data: the client's data path (its view, connections, metadata engine and read cache).
    """

    def __init__(self, data: DataPath) -> None:
        self.data = data
        self.view = data.view
        self.pool = data.pool
        self.meta = data.meta
        self._mtime_at: dict[int, float] = {}  # when push_rows last refreshed a file's mtime (monotonic s)
        self._tables: dict[str, _Table] = {}

    def _incarnation(self, shard_id: int) -> int | None:
        conn = self.pool.conns.get(shard_id)
        return conn.info.incarnation if conn is not None else None

    async def _table(self, path: str, fresh: bool = False) -> tuple[_Table, bool]:
        """The table at ``path`` (see the module docstring), read from the metadata engine if
        the cached one is older than :data:`TABLE_CACHE_S`, of another shard-map epoch, or
        ``fresh``; returns it and whether it was read now.

        Raises:
            NotFound: no such path. The metadata engine's errors.
        """
        t = self._tables.get(path)
        now = time.monotonic()
        if (t is not None and not fresh and now - t.at < TABLE_CACHE_S and t.epoch == self.view.epoch
                and t.changes == self.meta.changes
                and all(self._incarnation(sid) == inc for sid, inc in t.incarnations.items())):
            return t, False
        epoch, changes = self.view.epoch, self.meta.changes
        inode, chunks = await self.meta.resolve_chunks(path)
        try:
            raw: bytes | None = await self.meta.getxattr(inode.ino, XATTR_SHAPE)
        except NoAttribute:
            raw = None
        mapped = {i: dict(r) for i, r in chunks.items()}
        t = _Table(inode, raw or None, mapped, now, epoch,
                   {sid: self._incarnation(sid) for rec in mapped.values() for sid in rec}, changes)
        if len(self._tables) >= 1024:  # a client of many tables: the oldest go
            for old in sorted(self._tables, key=lambda k: self._tables[k].at)[:512]:
                del self._tables[old]
        self._tables[path] = t
        return t, True

    @staticmethod
    def row_extents(layout: Layout, ids: np.ndarray, row_bytes: int) -> tuple[np.ndarray, ...]:
        """The extents of rows ``ids`` (distinct, int64) of ``row_bytes`` bytes each: a row
        that crosses a chunk boundary is two (or more) extents.

        Returns:
            ``(chunk, offset, length, at)``, int64 arrays sorted by chunk and offset: each extent's chunk
            index, byte offset in the chunk, bytes, and byte position in the packed rows
            (row ``ids[k]`` at ``k * row_bytes``).
        """
        cs = layout.chunk_size
        if not len(ids):
            return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
        cur = ids.astype(np.int64) * row_bytes
        end = cur + row_bytes
        at = np.arange(len(ids), dtype=np.int64) * row_bytes
        parts: list[tuple[np.ndarray, ...]] = []
        while len(cur):
            c = cur // cs
            n = np.minimum(end, (c + 1) * cs) - cur
            parts.append((c, cur - c * cs, n, at))
            more = cur + n < end
            cur, at, end = (cur + n)[more], (at + n)[more], end[more]
        chunk, offset, length, at = (np.concatenate([q[k] for q in parts]) for k in range(4))
        order = np.lexsort((offset, chunk))  # ascending within each chunk: the shard walks its memory in order
        return chunk[order], offset[order], length[order], at[order]

    def _batches(self, chunk: np.ndarray, length: np.ndarray, sel: np.ndarray, limit: int,
                 whole_chunks: bool = False) -> list[np.ndarray]:
        """``sel`` (extent positions, sorted by chunk) cut into requests whose bytes plus 24 per
        extent fit ``limit``, of at most MAX_EXTENTS extents each; with ``whole_chunks`` (a
        round's rows: each chunk's contribution is one) cut only between chunks.

        Raises:
            InvalidArgument: one extent alone does not fit a request (a row larger than the
                shards' payload limit: pull or push it with ``read``/``write``), or with
                ``whole_chunks`` one chunk's rows do not.
        """
        if len(sel) and int(length[sel].max()) + 24 > limit:
            raise InvalidArgument(f"a row piece of {int(length[sel].max())} bytes exceeds the shards' payload limit"
                                  f" of {limit} bytes: use read/write (or pull/push) for rows this large")
        cost = np.cumsum(length[sel] + 24)
        if whole_chunks and len(sel):
            cuts = np.r_[np.flatnonzero(np.diff(chunk[sel])) + 1, len(sel)]  # where each chunk's extents end
            before = np.r_[0, cuts[:-1]]
            if bool((np.diff(np.r_[0, cost[cuts - 1]]) > limit).any()) or bool((cuts - before > MAX_EXTENTS).any()):
                raise InvalidArgument(f"one chunk's rows of this synchronous push exceed a request ({limit} bytes,"
                                      f" {MAX_EXTENTS} extents)", "push fewer rows per step, or use a smaller chunk size")
        out, start, base = [], 0, 0
        while start < len(sel):
            stop = int(np.searchsorted(cost, base + limit, side="right"))
            stop = min(max(stop, start + 1), start + MAX_EXTENTS)
            if whole_chunks and stop < len(sel):
                ends = cuts[(cuts > start) & (cuts <= stop)]
                stop = int(ends[-1]) if len(ends) else int(cuts[cuts > start][0])
            out.append(sel[start:stop])
            base, start = int(cost[stop - 1]), stop
        return out

    async def read_rows_into(self, layout: Layout, ids: np.ndarray, row_bytes: int, into: memoryview,
                             chunks: ChunkMap | None = None, unmapped: set[int] | None = None) -> None:
        """Pull rows ``ids`` (distinct, in-range, int64) of ``row_bytes`` bytes each into ``into``
        (row ``ids[k]`` at byte ``k * row_bytes``): one GATHER per shard (more when the rows'
        bytes exceed a request's payload limit), all shards at once. ps-lite's sparse pull (Li
        et al., OSDI 2014). A replicated chunk is read from its chain's tail (always clean,
        CRAQ); a replica that fails or lost the chunk is left for the next one, read clean (one
        with an update still in flight is asked again shortly).

        ``unmapped``: a set the chunks read as holes that ``chunks`` does not name are added to
        (a caller whose map may be older than the chunks asks again with a fresh one).

        Raises:
            DataLost: a recorded chunk is gone from every replica. ShardUnavailable: no replica
                answered. BadRequest. ``into`` is then partly filled.
        """
        if not len(ids):
            return
        out = np.frombuffer(into, dtype=np.uint8)
        chunk, offset, length, at = self.row_extents(layout, ids, row_bytes)
        names = chunk[np.r_[0, np.flatnonzero(np.diff(chunk)) + 1]].tolist()  # the chunks named, ascending

        def candidates(c: int) -> list[int]:
            placed, joining = self.view.placed(layout, c)
            reps = [x for x in placed if x != joining]
            return reps if len(reps) == 1 else [x for x in reversed(reps) if self.view.current(x)]  # the tail first

        cands = {c: candidates(c) for c in names}
        tails = {c: (v[0] if v else None) for c, v in cands.items()}
        tried: dict[int, set[int]] = collections.defaultdict(set)  # replicas that failed or lost a chunk
        errors: dict[int, IrdmaError] = {}
        pending = set(names)
        limit = self.data.max_piece(layout) or DEFAULT_MAX_PAYLOAD
        refreshed, dirty_rounds = False, 0
        while pending:
            if any(not cands[c] for c in pending) and not refreshed:
                refreshed = True  # the view may be older than the shard map: read it once more
                await self.view.refresh()
                for c in pending:
                    if not cands[c]:
                        cands[c] = [x for x in candidates(c) if x not in tried[c]]
            by_shard: dict[int, list[int]] = collections.defaultdict(list)
            for c in sorted(pending):
                if not cands[c]:
                    raise errors.get(c) or ShardUnavailable(
                        f"no up-to-date replica of chunk {c} of file {layout.file_id} answered",
                        "`irdma status` shows the shards; restart them with `irdma up`")
                by_shard[cands[c][0]].append(c)
            failed: list[tuple[int, int]] = []
            again: list[int] = []

            async def from_shard(sid: int, cs: list[int], failed: list[tuple[int, int]] = failed,
                                 again: list[int] = again) -> None:
                sel = np.flatnonzero(np.isin(chunk, cs))  # its chunks' extents, in order
                clean = layout.replicas > 1 and any(tails[c] != sid for c in cs)
                for part in self._batches(chunk, length, sel, limit):
                    lost, outcome = await self._gather_part(layout, sid, chunk[part], offset[part], length[part],
                                                            at[part], out, chunks, errors, clean, unmapped)
                    if outcome == "down":  # the replica failed: every chunk asked of it goes to the next one
                        failed.extend((c, sid) for c in cs)
                        return
                    if outcome == "dirty":  # an update in flight there: ask again shortly
                        again.extend(sorted(set(chunk[part].tolist())))
                        continue
                    failed.extend((c, sid) for c in lost)

            async with open_nursery() as nursery:
                for sid, cs in by_shard.items():
                    nursery.start_soon(from_shard, sid, cs)
            pending = set(again)
            for c, sid in failed:
                tried[c].add(sid)
                if sid in cands[c]:
                    cands[c].remove(sid)
                pending.add(c)
            if again:
                dirty_rounds += 1
                if dirty_rounds > 50:
                    raise ShardUnavailable(f"chunks of file {layout.file_id} kept an update in flight on their"
                                           " replicas while the tail was down", "`irdma status` shows the shards")
                await trio.sleep(0.002 * dirty_rounds)  # the chain acknowledges it within its deadline

    async def _gather_part(self, layout: Layout, shard_id: int, chunk: np.ndarray, offset: np.ndarray,
                           length: np.ndarray, at: np.ndarray, out: np.ndarray, chunks: ChunkMap | None,
                           errors: dict[int, IrdmaError], clean: bool = False,
                           unmapped: set[int] | None = None) -> tuple[list[int], str]:
        """One GATHER of these extents from one shard into ``out``; returns the chunks it lost
        (another replica may have them) and ``ok``, ``down`` (the replica failed: nothing read)
        or ``dirty`` (a clean read met an update in flight: nothing read)."""
        ext = P_extents(chunk, offset, length)
        names = np.unique(chunk).tolist()

        async def fn(conn: ShardConnection) -> tuple[np.ndarray, memoryview]:
            return await conn.gather(layout.file_id, ext, clean and not conn.one_sided_reads)

        try:
            versions, got = await self.pool.run(shard_id, fn, pull=True)
            buf = np.frombuffer(got, dtype=np.uint8)
        except Dirty:
            return [], "dirty"
        except ShardUnavailable as exc:
            if layout.replicas == 1:
                raise
            await self.view.mark_down(shard_id)
            for c in names:
                errors[c] = exc
            return names, "down"
        conn = self.pool.conns.get(shard_id)
        inc = conn.info.incarnation if conn is not None else None
        lost: list[int] = []
        zero = versions == 0
        holes = set(np.unique(chunk[zero]).tolist()) if (chunks or unmapped is not None) and zero.any() else set()
        if unmapped is not None:
            unmapped.update(c for c in holes if chunks is None or c not in chunks)
        if chunks:
            for c in names:
                rec = chunks.get(c)
                if rec is None:
                    continue
                # written to an earlier incarnation of this shard's memory, or not here at all
                was = rec.get(shard_id)
                if c in holes or (was and inc is not None and was != inc):
                    lost.append(c)
                    errors[c] = self.data.lost(layout, c, shard_id, "restarted with empty memory since, or no longer has it")
        pos = positions(length)[:-1]
        if lost:  # what the lost chunks' extents read is left out (another replica's read fills it)
            keep = ~np.isin(chunk, lost)
            at, pos, length = at[keep], pos[keep], length[keep]
        move(out, at, buf, pos, length)
        return lost, "ok"

    async def write_rows_from(self, layout: Layout, ids: np.ndarray, row_bytes: int, data: memoryview | bytes,
                              op: UpdateOp | Update, chunks: ChunkMap | None = None,
                              table_bytes: int = 0) -> list[NewChunk]:
        """Push rows ``ids`` (distinct, in-range, int64; row ``ids[k]`` at byte ``k * row_bytes``
        of ``data``) with update op ``op`` applied per row on the shards: one SCATTER per chunk
        chain (one per shard for files of one replica; more when the bytes exceed a request's
        payload limit). Each chunk's rows are applied atomically with one version bump, exactly
        once (request ids, as :meth:`DataPath.write_from`).

        An ``op`` with a :class:`~irdma.wire.protocol.Round` makes the push this member's
        contribution to a synchronous round of every chunk of the table (``table_bytes`` long):
        a chunk without rows in ``ids`` gets an empty extent (the member's empty contribution,
        so the round does not wait for it), and each chunk's rows travel in one request
        (:meth:`irdma.server.rounds.Rounds.contribute_rows`).

        Returns:
            The chunk replicas created, for the chunk map (see :meth:`DataPath.write_from`).

        Raises:
            As :meth:`DataPath.write_from`. Other chunks' rows may have been applied.
            InvalidArgument: a round's rows of one chunk exceed a request.
        """
        in_round = isinstance(op, Update) and op.round is not None
        if not len(ids) and not in_round:
            return []
        if self.data.cached is not None:
            self.data.cached.invalidate(layout.file_id)
        src = np.frombuffer(as_bytes_view(data), dtype=np.uint8)
        chunk, offset, length, at = self.row_extents(layout, ids, row_bytes)
        created: list[NewChunk] = []
        if in_round:  # every chunk of the table hears from this member: an empty extent where it has no rows
            none = np.setdiff1d(np.arange(layout.chunk_count(table_bytes), dtype=np.int64), chunk)
            zeros = np.zeros(len(none), dtype=np.int64)
            chunk, offset, length, at = (np.concatenate(v) for v in ((chunk, none), (offset, zeros), (length, zeros),
                                                                    (at, zeros)))
            order = np.lexsort((offset, chunk))
            chunk, offset, length, at = chunk[order], offset[order], length[order], at[order]
            sizes = [c.info.max_payload for c in self.pool.conns.values()]
            limit = min(sizes) if sizes else DEFAULT_MAX_PAYLOAD  # a chunk's rows in one request: not P3's slices
        else:
            limit = self.data.max_piece(layout) or DEFAULT_MAX_PAYLOAD
        units = self._scatter_units(layout, chunk, chunks)
        batches = [b for sel in units for b in self._batches(chunk, length, sel, limit, whole_chunks=in_round)]
        push_id = self.data.request_id() if len(batches) > 1 else 0  # a snapshot takes all the requests or none
        async with open_nursery() as nursery:
            for k, b in enumerate(batches):
                nursery.start_soon(self._scatter_chain, layout, chunk[b], offset[b], length[b], src, at[b], op, chunks,
                                   created, self.data.request_id(), Part(push_id, k, len(batches)) if push_id else None)
        return list(dict.fromkeys(created))  # a chunk in two requests is created once

    def _scatter_units(self, layout: Layout, chunk: np.ndarray, chunks: ChunkMap | None,
                       sel: np.ndarray | None = None) -> list[np.ndarray]:
        """Extent positions grouped so that each group's chunks share one chain, one head
        incarnation and whether they exist (so one request with one FLAG_EXISTING serves it)."""
        if sel is None:
            sel = np.arange(len(chunk))
        sub = chunk[sel]
        if not len(sub):
            return []
        starts = np.r_[0, np.flatnonzero(np.diff(sub)) + 1]  # each run of one chunk's extents
        single = layout.replicas == 1
        keys: dict[tuple[object, ...], int] = {}
        run_key = np.empty(len(starts), dtype=np.int64)
        for j, c in enumerate(sub[starts].tolist()):
            try:
                chain: tuple[int, ...] | None = self.view.chain_of(layout, c)
            except ShardUnavailable:
                chain = None  # _scatter_chain raises the error that says why
            rec = chunks.get(c) if chunks else None
            head = chain[0] if chain else None
            existing = rec is not None and (head in rec or single)
            run_key[j] = keys.setdefault((chain, existing, rec.get(head) if rec is not None and head is not None else None),
                                         len(keys))
        if len(keys) == 1:
            return [sel]
        per_extent = np.repeat(run_key, np.diff(np.r_[starts, len(sub)]))
        return [sel[per_extent == k] for k in range(len(keys))]  # in the order the keys first appear

    async def _scatter_chain(self, layout: Layout, chunk: np.ndarray, offset: np.ndarray, length: np.ndarray,
                             src: np.ndarray, at: np.ndarray, op: UpdateOp | Update, chunks: ChunkMap | None,
                             created: list[NewChunk], rid: int, part: Part | None = None) -> None:
        """One SCATTER along its chunks' chain (:meth:`DataPath.chained_update`); a group whose chunks'
        chains parted since it was formed is split, one request per chain, same request id."""
        ext = P_extents(chunk, offset, length)
        packed: list[np.ndarray] = []  # packed at the first send: a request parted() splits packs its own parts

        async def parted() -> bool:
            units = self._scatter_units(layout, chunk, chunks)
            if len(units) == 1:
                return False
            async with open_nursery() as nursery:
                for u in units:
                    nursery.start_soon(self._scatter_chain, layout, chunk[u], offset[u], length[u], src, at[u], op,
                                       chunks, created, rid, part)
            return True

        async def send(conn: ShardConnection, existing: bool, chain: Chain) -> None:
            if not packed:
                packed.append(pack(src, at, length, self.data.buffers))
            await conn.scatter(layout.file_id, layout.chunk_size, ext, op, memoryview(packed[0]),  # type: ignore[arg-type]
                               existing, chain if part is None else dataclasses.replace(chain, part=part))

        await self.data.chained_update(layout, sorted(set(chunk.tolist())), send, chunks, created, rid, "scatter", parted)
        if packed:
            self.data.buffers.give(packed[0])  # completed: no transport holds it (a failed request's is dropped)

    @staticmethod
    def _geometry(inode: Inode, raw: bytes | None, row_len: int | None) -> tuple[int, int | None]:
        """``(row bytes, row count or None)`` of a file read as float32 rows: ``row_len`` if
        given, else from ``raw``, its ``user.irdma.shape`` xattr (None: it has none).

        Raises:
            InvalidArgument: neither says, or ``row_len`` disagrees with the shape.
        """
        shape = parse_shape(raw) if raw else None
        per_row = int(np.prod(shape[1:])) if shape else None
        if row_len is None:
            if per_row is None:
                raise InvalidArgument(f"inode {inode.ino} has no {XATTR_SHAPE.decode()} xattr: pass row_len, or set"
                                      " it (setfattr -n user.irdma.shape -v ROWS,COLS FILE)")
            row_len = per_row
        if row_len <= 0 or (per_row is not None and row_len != per_row):
            raise InvalidArgument(f"row length {row_len} disagrees with {XATTR_SHAPE.decode()} {shape}"
                                  if per_row is not None else f"row length {row_len} must be positive")
        return 4 * row_len, (shape[0] if shape else None)

    @staticmethod
    def _row_ids(ids: object) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise InvalidArgument(f"row ids must be a 1-D array of integers, got {arr.dtype} of shape {arr.shape}")
        arr = arr.astype(np.int64)
        if arr.size and int(arr.min()) < 0:
            raise InvalidArgument(f"row id {int(arr.min())} is negative")
        return arr

    async def pull_rows(self, path: str, ids: Sequence[int] | np.ndarray, *, row_len: int | None = None,
                        out: np.ndarray | None = None) -> np.ndarray:
        """Sparse pull: rows ``ids`` of a 2-D little-endian float32 file, in the order given
        (duplicates allowed), as a ``(len(ids), row_len)`` float32 array (``out`` if given: a
        C-contiguous float32 array of that shape, reused across calls to spare page faults).
        The row length comes from ``row_len`` or the file's ``user.irdma.shape`` xattr (e.g.
        ``1000000,256``). One GATHER per shard carries every row it holds (ps-lite's sparse pull).

        Raises:
            InvalidArgument: bad ids, a row past the end of the file, no row length, a bad ``out``.
            DataLost, ShardUnavailable: as :meth:`irdma.Client.pull`.
        """
        return await self._pull(path, ids, row_len, out, fresh=False)

    async def _pull(self, path: str, ids: Sequence[int] | np.ndarray, row_len: int | None,
                    out: np.ndarray | None, fresh: bool) -> np.ndarray:
        """:meth:`pull_rows`; ``fresh``: with the table read afresh (its cached state was suspect)."""
        table, fetched = await self._table(path, fresh=fresh)
        inode = table.inode
        try:
            rb, _ = self._geometry(inode, table.shape, row_len)
        except InvalidArgument:
            if fetched:
                raise
            return await self._pull(path, ids, row_len, out, fresh=True)  # its shape changed since it was read?
        ids_arr = self._row_ids(ids)
        if out is None:
            out = np.empty((len(ids_arr), rb // 4), dtype="<f4")
        elif out.dtype != np.dtype("<f4") or out.shape != (len(ids_arr), rb // 4) or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a C-contiguous float32 array of shape {(len(ids_arr), rb // 4)},"
                                  f" got {out.dtype} {out.shape}")
        if not len(ids_arr):
            return out
        if (int(ids_arr.max()) + 1) * rb > inode.size and not fetched:  # grown since it was read?
            return await self._pull(path, ids, row_len, out, fresh=True)
        if (int(ids_arr.max()) + 1) * rb > inode.size:
            raise InvalidArgument(f"row {int(ids_arr.max())} of {rb} bytes is past the end of {path}"
                                  f" ({inode.size} bytes, {inode.size // rb} rows)")
        uniq, inv = np.unique(ids_arr, return_inverse=True)
        dups = len(uniq) < len(ids_arr)  # without duplicates each row lands in place, in the order asked
        got = np.empty((len(uniq), rb // 4), dtype="<f4") if dups else out
        unmapped: set[int] = set()
        try:
            await self.read_rows_into(layout_of(inode), uniq if dups else ids_arr, rb,
                                      memoryview(got).cast("B"),  # type: ignore[arg-type]
                                      table.chunks, None if fetched else unmapped)
        except IrdmaError as exc:
            self._tables.pop(path, None)  # the next call reads the table afresh
            if fetched or not isinstance(exc, DataLost):
                raise
            return await self._pull(path, ids, row_len, out, fresh=True)  # a restart since it was read?
        if unmapped:  # a hole the cached map cannot vouch for: pull again with the map as it is now
            return await self._pull(path, ids, row_len, out, fresh=True)
        if dups:  # each row copied out as one void element (one memcpy a row)
            whole = np.dtype((np.void, rb))
            out.view(whole).reshape(-1)[:] = got.view(whole).reshape(-1)[inv.reshape(-1)]
        return out

    async def push_rows(self, path: str, ids: Sequence[int] | np.ndarray, rows: np.ndarray, *,
                        op: UpdateOp | Update | str | None = None, row_len: int | None = None) -> None:
        """Sparse push: apply ``rows`` (``(len(ids), row_len)``, cast to little-endian float32)
        to rows ``ids`` of a file with update op ``op`` (default: the file's
        ``user.irdma.update``; assign, add and the optimizers, applied per row on the shards).
        Duplicate ids are summed first (their sum is what is assigned or added; ps-lite's
        sparse push). One SCATTER per shard (per chain when replicated) carries every row it
        holds; each chunk's rows are applied atomically. Rows must lie inside the file (and its
        shape's row count): :meth:`irdma.Client.set_shape` sizes a table.

        Raises:
            InvalidArgument: bad ids or rows (nothing changed). DataLost, NoSpace,
                ShardUnavailable, BadRequest: as :meth:`irdma.Client.write` (other chunks' rows may have
                been applied).
        """
        ids_arr = self._row_ids(ids)
        table, fetched = await self._table(path)
        while True:
            inode = table.inode
            writable(inode, path)
            try:
                rb, nrows = self._geometry(inode, table.shape, row_len)
            except InvalidArgument:
                if fetched:
                    raise
                table, fetched = await self._table(path, fresh=True)  # its shape changed since it was read?
                continue
            limit = inode.size // rb if nrows is None else min(nrows, inode.size // rb)
            if fetched or not len(ids_arr) or int(ids_arr.max()) < limit:
                break
            table, fetched = await self._table(path, fresh=True)  # grown since it was read?
        data = np.asarray(rows, dtype="<f4")
        if data.size != len(ids_arr) * (rb // 4):
            raise InvalidArgument(f"{len(ids_arr)} row ids need {len(ids_arr)} x {rb // 4} values, got an array of"
                                  f" shape {data.shape}")
        uop = parse_update(op) if isinstance(op, str) else (op if op is not None else parse_update(inode.update_op or "assign"))
        in_round = isinstance(uop, Update) and uop.round is not None
        if not len(ids_arr) and not in_round:
            return
        if len(ids_arr) and int(ids_arr.max()) >= limit:
            raise InvalidArgument(f"row {int(ids_arr.max())} is past the last row of {path} ({limit} rows;"
                                  f" set_shape sizes a table)")
        uniq, summed = sum_duplicates(ids_arr, data.reshape(len(ids_arr), rb // 4))
        layout = layout_of(inode)
        end = (int(uniq.max()) + 1) * rb if len(uniq) else 0  # inside the file: never changes its size
        payload = memoryview(np.ascontiguousarray(summed, dtype="<f4")) if summed.size else b""  # type: ignore[arg-type]
        try:
            created = await self.write_rows_from(layout, uniq, rb, payload, uop, table.chunks, table_bytes=limit * rb)
        except IrdmaError:
            self._tables.pop(path, None)  # the next call reads the table afresh
            raise
        for idx, shard, incarnation in created:  # this client's map names what it made
            table.chunks.setdefault(idx, {})[shard] = incarnation
            table.incarnations.setdefault(shard, incarnation)
        # mtime is refreshed at most once a second by pushes that neither grow the file nor make
        # chunks (as a mount's direct-I/O pushes, and lazytime): no metadata transaction per push
        now = time.monotonic()
        if created or now - self._mtime_at.get(inode.ino, -MTIME_LAZY_S) >= MTIME_LAZY_S:
            before = self.meta.changes
            await self.meta.extend(inode.ino, end, time.time_ns(), tuple(created))
            self._mtime_at[inode.ino] = now
            if self.meta.changes == before + 1 and table.changes == before:  # only this refresh meanwhile
                table.changes = self.meta.changes
