"""Checking and collecting a namespace: ``irdma fsck``, ``irdma status`` and ``irdma gc`` (as
``juicefs fsck`` and ``juicefs gc`` do for JuiceFS).

What a chunk's replicas are (the chunk map, ``chunks(ino, idx, shard, incarnation)``): a replica
is *in sync* when its row holds its shard's current incarnation, which is never 0; a row of 0
is a replica out of the chunk's in-sync set (it missed acknowledged updates: Kafka's ISR, the
last one standing is 3FS's LASTSRV). A chunk whose rows are all 0 was never acknowledged and
counts as not written. A written chunk is *readable* when one of its in-sync replicas is on a
shard that answers and holds it (version > 0). So each written chunk is one of:

* **readable**; an in-sync replica on a shard that answers but lacks the chunk is **missing**
  there (the others serve it; a resync brings it back);
* **waiting**: its in-sync replicas are all on shards that do not answer, or that answer but
  are still catching up (clients read a shard once its resync marked it up). Reads fail with
  EIO until one of them is back (restart it; ``irdma shard resync`` for one catching up); if
  its memory is gone for good, ``irdma shard resync --force-from SHARD`` adopts the copy of a
  shard that answers (losing what only the lost replicas had);
* **lost** (damaged): no in-sync replica is left (their shards restarted on fresh memory, or
  were removed by force), or every one answers without the chunk (freed behind the
  namespace's back). Reads fail with EIO for good: rewrite the file or restore a checkpoint.

What can be collected (one plan, :func:`scan`, for ``fsck``, ``gc --dry-run`` and ``gc``,
which then frees exactly what it lists unless the namespace changed meanwhile):

* **dead sessions**: mounts that stopped heartbeating (or whose process on this host is gone);
  their open-file records no longer keep files alive.
* **orphans**: files with no name left, past their unlink grace, that no live session (dead
  ones discounted) holds open; their chunks and inode are freed.
* **leaked chunks**: chunks on a shard in service that belong to no file, or lie past the end
  of a file no live session holds open (a crashed writer's); they are freed.

Shards drained or removed are history: they are neither checked nor counted as failures.

The shard lists are read before the metadata, so a chunk written while the scan runs belongs
to a file the metadata already knows (never counted leaked); a replica found absent is asked
again (CHECKSUM) after the metadata was read, so a chunk written meanwhile is not reported lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from .._errors import IrdmaError, NotFound, ShardUnavailable
from ..meta.base import DamagedFile, Session, ShardRecord, Snapshot
from ..transport import ShardConnection
from . import snapshots
from .native import Client, layout_of

#: The incarnation of a chunk-map row out of its chunk's in-sync set
#: (:data:`irdma.meta.base.OUT_OF_SYNC`).
OUT_OF_SYNC = 0
#: Shard states whose shards serve no chain: history, not failures.
RETIRED = ("drained", "removed")

#: ``(shard record, STAT reply or None, why it failed)`` per shard: :meth:`Client.shard_stats`.
Stats = list[tuple[ShardRecord, Any, str]]
#: chunks a shard holds: ``(file id, chunk index) -> (version, chunk size in bytes)``.
Listing = dict[tuple[int, int], tuple[int, int]]


@dataclass
class Unreadable:
    """A file some of whose written chunks cannot be read now: each one's in-sync replicas
    are all on shards that do not answer, or that answer but are still catching up (clients
    read a shard only once its resync marked it up)."""

    ino: int
    path: str  # "" when the inode has no name left
    chunks: list[int]  # chunk indices
    waits_for: list[int]  # shards holding their in-sync replicas
    stale: list[int] = field(default_factory=list)  # shards that answer with an older copy of one
    catching_up: list[int] = field(default_factory=list)  # of waits_for: answer, not resynced yet


@dataclass
class Report:
    """What a scan found (and, for :func:`collect_garbage`, what it freed)."""

    damaged: list[DamagedFile] = field(default_factory=list)  # chunks lost for good
    waiting: list[Unreadable] = field(default_factory=list)  # chunks waiting for a shard
    missing: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # ino -> [(chunk, shard)]: an in-sync replica lacks it
    sessions: list[Session] = field(default_factory=list)  # dead sessions
    orphans: list[int] = field(default_factory=list)  # inode numbers
    orphan_bytes: int = 0  # their sizes
    orphan_sizes: dict[int, int] = field(default_factory=dict)  # inode number -> its size (bytes)
    leaked: list[tuple[int, int, int, int]] = field(default_factory=list)  # (shard, file, chunk, bytes)
    unreachable: list[tuple[int, str]] = field(default_factory=list)  # (shard, why) in service, not scanned
    retired: list[int] = field(default_factory=list)  # shards drained or removed (not scanned)
    abandoned: list[Snapshot] = field(default_factory=list)  # left 'creating' by a creator that died

    @property
    def leaked_bytes(self) -> int:
        return sum(x[3] for x in self.leaked)

    @property
    def data_lost(self) -> bool:
        """Some chunk is lost for good."""
        return bool(self.damaged)

    @property
    def unreadable(self) -> bool:
        """Some file cannot be read now (lost, or waiting for a shard)."""
        return bool(self.damaged or self.waiting)

    @property
    def garbage(self) -> bool:
        return bool(self.leaked or self.sessions or self.orphans or self.abandoned)


# ---------------------------------------------------------------- metadata read in bulk
def _select(store: Any, sql: str) -> list[tuple[Any, ...]]:
    """Rows of one read-only statement through an SQL engine's own call path (its connection,
    retries and error mapping). ``store``: a :class:`~irdma.meta.sql.SqlMeta`."""

    def run(self: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._db.execute(sql).fetchall()]

    return store._call(run, (), {})  # type: ignore[no-any-return]


async def chunk_rows(client: Client) -> dict[int, dict[int, dict[int, int]]]:
    """The whole chunk map: ino -> chunk index -> {shard: incarnation} (one statement on SQL
    engines; else one :meth:`MetaStore.chunk_map` per file)."""
    out: dict[int, dict[int, dict[int, int]]] = {}
    if hasattr(client.store, "_call"):
        rows = await trio.to_thread.run_sync(_select, client.store,
                                             "SELECT ino, idx, shard, incarnation FROM chunks ORDER BY ino, idx")
        for ino, idx, shard, inc in rows:
            out.setdefault(int(ino), {}).setdefault(int(idx), {})[int(shard)] = int(inc)
        return out
    for ino in await client.meta.file_sizes():
        m = await client.meta.chunk_map(ino)
        if m:
            out[ino] = m
    return out


async def _held_open(client: Client, dead: set[int]) -> set[int] | None:
    """Inodes a session other than ``dead`` ones holds open; None where the engine cannot say
    (then :meth:`MetaStore.file_sizes`'s own flag is used)."""
    if not hasattr(client.store, "_call"):
        return None
    live = {s.sid for s in await client.meta.sessions()} - dead
    rows = await trio.to_thread.run_sync(_select, client.store, "SELECT sid, ino FROM open_files")
    return {int(ino) for sid, ino in rows if int(sid) in live}


# ---------------------------------------------------------------- readability
async def readability(
    client: Client, stats: Stats, listed: dict[int, Listing] | None = None,
) -> tuple[list[DamagedFile], list[Unreadable], dict[int, list[tuple[int, int]]]]:
    """Classify every written chunk (see the module's docstring).

    Args:
        stats: every shard with its STAT reply or None (:meth:`Client.shard_stats`, which
            records each shard's incarnation first).
        listed: what each shard that was listed holds (``fsck``): presence and version are
            checked per replica, and a replica the listing lacks is asked again. None
            (``status``): a shard that answers counts as holding its replicas.

    Returns:
        ``(damaged, waiting, missing)``: files with chunks lost for good, files with chunks
        waiting for a shard, and ``ino -> [(chunk, shard)]``: in-sync replicas that a shard
        that answers lacks while another replica serves the chunk.

    Raises:
        IrdmaError: the metadata engine failed.
    """
    recs = {r.shard_id: r for r, _, _ in stats}
    answering = {r.shard_id for r, st, _ in stats if st is not None and r.state != "removed"}
    if listed is not None:
        answering &= set(listed)  # a shard whose listing failed did not answer
    # clients read a shard that answers once a resync marked it up (not down, not syncing)
    serving = {s for s in answering if recs[s].health not in ("down", "syncing")}
    chunks = await chunk_rows(client)

    def insync(ino: int, idx: int) -> list[int]:
        reps = chunks[ino][idx]
        return sorted(s for s, n in reps.items() if n != OUT_OF_SYNC and s in recs
                      and recs[s].state != "removed" and recs[s].incarnation and n == recs[s].incarnation)

    absent = {(ino, idx, s) for ino, idxs in chunks.items() for idx in idxs for s in insync(ino, idx)
              if s in answering and listed is not None and listed[s].get((ino, idx), (0, 0))[0] <= 0}
    if absent:  # written after its shard was listed, or freed after the metadata was read?
        absent = await _still_absent(client, absent)
    single = await _single_copies(client, {
        (ino, idx) for ino, idxs in chunks.items() for idx in idxs
        if not any(s in serving for s in insync(ino, idx)) and any(s in answering for s in insync(ino, idx))})
    lost: dict[int, dict[int, list[int]]] = {}  # ino -> chunk -> the shards of its written rows
    waiting: dict[int, dict[int, list[int]]] = {}  # ino -> chunk -> its in-sync shards, down or catching up
    catching: dict[int, set[int]] = {}  # ino -> those of them that answer
    missing: dict[int, list[tuple[int, int]]] = {}
    for ino, idxs in chunks.items():
        for idx, reps in sorted(idxs.items()):
            written = sorted(s for s, n in reps.items() if n != OUT_OF_SYNC)
            if not written:
                continue  # never acknowledged: not a written chunk
            good = insync(ino, idx)
            up = [s for s in good if s in answering]
            have = [s for s in up if (ino, idx, s) not in absent]
            if [s for s in have if s in serving] or (have and (ino, idx) in single):
                if lacking := [(idx, s) for s in up if s not in have]:
                    missing.setdefault(ino, []).extend(lacking)
            elif waits := sorted([s for s in good if s not in answering] + have):
                waiting.setdefault(ino, {})[idx] = waits
                catching.setdefault(ino, set()).update(have)
            else:
                lost.setdefault(ino, {})[idx] = written
    damaged = [DamagedFile(ino, await client.meta.path_of(ino), sorted(m),
                           sorted({s for shards in m.values() for s in shards}))
               for ino, m in sorted(lost.items())]
    unreadable = []
    for ino, m in sorted(waiting.items()):
        stale = await _stale_copies(client, ino, m, chunks[ino], answering, listed)
        unreadable.append(Unreadable(ino, await client.meta.path_of(ino), sorted(m),
                                     sorted({s for shards in m.values() for s in shards}), stale,
                                     sorted(catching.get(ino, ()))))
    return damaged, unreadable, missing


async def _single_copies(client: Client, which: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Of ``which``, the chunks placed on one shard only (a file of one replica): clients read
    that copy whatever the shard's health, so one catching up still serves it."""
    out: set[tuple[int, int]] = set()
    by_ino: dict[int, list[int]] = {}
    for ino, idx in which:
        by_ino.setdefault(ino, []).append(idx)
    for ino, idxs in sorted(by_ino.items()):
        try:
            layout = layout_of(await client.meta.getattr(ino))
        except IrdmaError:
            continue
        for idx in idxs:
            chain, joining = client.placed(layout, idx)
            if len([s for s in chain if s != joining]) == 1:
                out.add((ino, idx))
    return out


async def _still_absent(client: Client, absent: set[tuple[int, int, int]]) -> set[tuple[int, int, int]]:
    """Of ``(ino, chunk, shard)`` replicas a listing lacked, those still absent (CHECKSUM says
    version 0) and still recorded in sync (the chunk map read again)."""
    out = set()
    for ino, idx, s in sorted(absent):
        try:
            version, _ = await client.shard_call(s, ShardConnection.checksum, ino, idx, client.view.epoch)
        except ShardUnavailable:
            version = 0  # it answered the listing: count it as it was then
        if version > 0:
            continue
        if (await client.meta.chunk_map(ino)).get(idx, {}).get(s, OUT_OF_SYNC) == OUT_OF_SYNC:
            continue  # freed (truncated, removed) or taken out of sync since
        out.add((ino, idx, s))
    return out


async def _stale_copies(client: Client, ino: int, waiting: dict[int, list[int]], rows: dict[int, dict[int, int]],
                        answering: set[int], listed: dict[int, Listing] | None) -> list[int]:
    """Shards that answer and hold (as far as the listing says) an out-of-sync copy of a chunk
    of ``waiting``: what ``irdma shard resync --force-from`` could adopt."""
    try:
        layout = layout_of(await client.meta.getattr(ino))
    except (NotFound, IrdmaError):
        layout = None
    out: set[int] = set()
    for idx, down in waiting.items():
        members = set(rows.get(idx, {}))
        if layout is not None:
            chain, joining = client.placed(layout, idx)
            members.update(chain)
        for s in members - set(down):
            if s in answering and (listed is None or listed[s].get((ino, idx), (0, 0))[0] > 0):
                out.add(s)
    return sorted(out)


# ---------------------------------------------------------------- the scan
async def scan(client: Client, *, chunks: bool = True, reads: bool = True,
               progress: Callable[[str], None] = lambda msg: None) -> Report:
    """Find what is unreadable (with ``reads``) and what can be collected (dead sessions,
    orphans and, with ``chunks``, leaked chunks); :func:`collect_garbage` frees what it finds.
    Changes nothing.

    Raises:
        IrdmaError: the metadata engine failed.
    """
    rep = Report()
    meta = client.meta
    listed: dict[int, Listing] = {}
    stats: Stats = []
    if chunks or reads:
        stats = await client.shard_stats()  # also notes each shard's incarnation in the shard map
        rep.retired = [rec.shard_id for rec, _, _ in stats if rec.state in RETIRED]
    if chunks:
        for rec, st, why in stats:
            if rec.state in RETIRED:
                continue  # history: it serves no chain
            if st is None:
                rep.unreachable.append((rec.shard_id, why))
                continue
            have: Listing = {}
            try:
                async for page in client.list_chunks(rec.shard_id):
                    for e in page:
                        have[(e.file_id, e.chunk_index)] = (e.version, e.chunk_size)
                    progress(f"shard {rec.shard_id}: {len(have)} chunks listed")
            except ShardUnavailable as exc:
                rep.unreachable.append((rec.shard_id, str(exc)))
                continue
            listed[rec.shard_id] = have
    # the metadata after the listings (see the module's docstring)
    rep.sessions = await meta.dead_sessions()
    rep.abandoned = await meta.abandoned_snapshots(snapshots.abandoned_before())
    held = await _held_open(client, {s.sid for s in rep.sessions})
    files = await meta.file_sizes() if chunks or held is None else {}
    grace_ns = int(await meta.unlink_grace() * 1e9)
    for inode in await meta.orphans():
        if held is not None:
            if inode.nlink > 0 or time.time_ns() - inode.ctime_ns <= grace_ns or inode.ino in held:
                continue
        elif await meta.reclaimable(inode.ino) is None:
            continue
        rep.orphans.append(inode.ino)
        rep.orphan_bytes += inode.size
        rep.orphan_sizes[inode.ino] = inode.size
    if reads:
        progress("checking that every written chunk can be read")
        rep.damaged, rep.waiting, rep.missing = await readability(client, stats, listed if chunks else None)
    if chunks:
        orphans = set(rep.orphans)  # their chunks go with them
        for shard_id, have in listed.items():
            for (file_id, idx), (_, nbytes) in sorted(have.items()):
                if file_id in orphans:
                    continue
                f = files.get(file_id)
                if f is None:
                    rep.leaked.append((shard_id, file_id, idx, nbytes))
                    continue
                size, chunk_size, is_open = f
                if held is not None:
                    is_open = file_id in held
                if idx >= -(-size // chunk_size) and not is_open:
                    rep.leaked.append((shard_id, file_id, idx, nbytes))
    return rep


async def collect_garbage(
    client: Client, *, dry_run: bool = False, leaked_chunks: bool = True,
    progress: Callable[[str], None] = lambda msg: None,
    step: Callable[[int, int, int, int], None] | None = None,
) -> Report:
    """Reap dead sessions, free orphans and (with ``leaked_chunks``) leaked chunks: what
    :func:`scan` finds, so ``dry_run`` reports exactly what a run then frees. Each leaked
    chunk is checked again just before it is freed (its file may have grown or been opened
    since); one that no longer is garbage is kept and left out of the report.

    ``progress`` gets a line per phase and per thing freed; ``step(done_bytes, total_bytes,
    done_items, total_items)`` (:func:`irdma.ops.progress.transfer_progress`) the bytes and
    items (orphaned files, then leaked chunks) handled so far of those found, once the scan is
    over.

    Returns:
        What was found; with ``dry_run`` nothing is changed, else what was freed.

    Raises:
        IrdmaError: the metadata engine failed.
    """
    rep = await scan(client, chunks=leaked_chunks, reads=False, progress=progress)
    if dry_run:
        return rep
    meta = client.meta
    for s in rep.sessions:
        await meta.reap_session(s.sid)
        progress(f"reaped session {s.sid} ({s.name}, pid {s.pid} on {s.host})")
    if rep.abandoned:  # those the scan found (one begun since is not abandoned yet)
        rep.abandoned = await snapshots.drop_abandoned(client, max(x.created_ns for x in rep.abandoned) + 1, progress)
    total = [rep.orphan_bytes + rep.leaked_bytes, len(rep.orphans) + len(rep.leaked)]
    done = [0, 0]

    def did(nbytes: int, items: int) -> None:
        done[0] += nbytes
        done[1] += items
        if step is not None:
            step(done[0], total[0], done[1], total[1])

    did(0, 0)
    freed = []
    for ino in rep.orphans:
        try:
            if await client.destroy_if_unused(ino):
                freed.append(ino)
                progress(f"freed orphan inode {ino}")
        except ShardUnavailable as exc:
            progress(f"orphan inode {ino} kept: {exc}")
        did(rep.orphan_sizes.get(ino, 0), 1)
    if len(freed) != len(rep.orphans):
        rep.orphans = freed
        rep.orphan_bytes = sum(rep.orphan_sizes.get(ino, 0) for ino in freed)
    if rep.leaked:
        rep.leaked = await _free_leaked(client, rep.leaked, progress, did)
    return rep


async def _free_leaked(client: Client, leaked: Iterable[tuple[int, int, int, int]], progress: Callable[[str], None],
                       did: Callable[[int, int], None] = lambda nbytes, items: None) -> list[tuple[int, int, int, int]]:
    """Free leaked chunks from the first index on per (shard, file) (FREE drops every chunk at
    or after it), each file checked again first; returns those freed. ``did(bytes, chunks)``
    is told each (shard, file)'s chunks once handled (freed or kept)."""
    by_key: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for x in leaked:
        by_key.setdefault((x[0], x[1]), []).append(x)
    held = await _held_open(client, set())
    freed: list[tuple[int, int, int, int]] = []
    for (shard_id, file_id), items in sorted(by_key.items()):
        first = min(x[2] for x in items)
        try:
            inode = await client.meta.getattr(file_id)
        except NotFound:
            inode = None
        if inode is not None:
            size, cs = inode.size, inode.chunk_size or 1
            if first < -(-size // cs) or (held is not None and file_id in held):
                progress(f"chunks of file {file_id} on shard {shard_id} kept: the file grew or was opened since")
                did(sum(x[3] for x in items), len(items))
                continue
        try:
            await client.shard_call(shard_id, ShardConnection.free, file_id, first)
        except IrdmaError as exc:
            progress(f"cannot free leaked chunks of file {file_id} on shard {shard_id}: {exc}")
            did(sum(x[3] for x in items), len(items))
            continue
        freed += items
        did(sum(x[3] for x in items), len(items))
    if freed:
        progress(f"freed {len(freed)} leaked chunks")
    return freed
