"""Checking and collecting a namespace: ``irdma fsck`` and ``irdma gc`` (as ``juicefs fsck``
and ``juicefs gc`` do for JuiceFS).

* **damaged files**: chunks the chunk map records as written whose shard has since changed
  incarnation (it restarted on fresh memory), or that the shard no longer lists (freed
  behind the namespace's back). Their bytes are gone: reads of them fail with EIO.
* **dead sessions**: mounts that stopped heartbeating (or whose process on this host is gone);
  their open-file records no longer keep unlinked files alive.
* **orphans**: files with no name left that no live session holds open; their chunks and inode
  are freed.
* **leaked chunks**: chunks on a shard that belong to no file, or lie past the end of a file no
  live session has open (a crashed writer's); they are freed.

The shard list is read before the metadata snapshot, so a chunk written while the scan runs
belongs to a file the snapshot already knows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ._errors import IrdmaError, ShardUnavailable
from .client import Client
from .meta.base import DamagedFile, Session


@dataclass
class Report:
    """What a scan found (and, for :func:`collect_garbage`, what it freed)."""

    damaged: list[DamagedFile] = field(default_factory=list)
    missing: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # ino -> [(chunk, shard)] not on shard
    sessions: list[Session] = field(default_factory=list)  # dead sessions
    orphans: list[int] = field(default_factory=list)  # inode numbers
    leaked: list[tuple[int, int, int, int]] = field(default_factory=list)  # (shard, file, chunk, bytes)
    unreachable: list[tuple[int, str]] = field(default_factory=list)  # (shard, why) not scanned

    @property
    def leaked_bytes(self) -> int:
        return sum(x[3] for x in self.leaked)

    @property
    def data_lost(self) -> bool:
        return bool(self.damaged or self.missing)


async def scan(client: Client, *, chunks: bool = True, progress: Callable[[str], None] = lambda msg: None) -> Report:
    """Find damaged files, dead sessions, orphans and (with ``chunks``) leaked and missing chunks.
    Changes nothing.

    Raises:
        IrdmaError: the metadata engine failed.
    """
    rep = Report()
    listed: dict[int, set[tuple[int, int]]] = {}
    stats = await client.shard_stats()  # also notes each shard's incarnation in the shard map
    if chunks:
        for rec, st, why in stats:
            if st is None:
                rep.unreachable.append((rec.shard_id, why))
                continue
            have: set[tuple[int, int]] = set()
            try:
                async for page in client.list_chunks(rec.shard_id):
                    for e in page:
                        have.add((e.file_id, e.chunk_index))
                    progress(f"shard {rec.shard_id}: {len(have)} chunks listed")
            except ShardUnavailable as exc:
                rep.unreachable.append((rec.shard_id, str(exc)))
                continue
            listed[rec.shard_id] = have
    meta = client.meta
    rep.damaged = await meta.damaged()
    rep.sessions = await meta.dead_sessions()
    for inode in await meta.orphans():
        if await meta.reclaimable(inode.ino) is not None:
            rep.orphans.append(inode.ino)
    if chunks and listed:
        files = await meta.file_sizes()
        damaged_idx = {(d.ino, i) for d in rep.damaged for i in d.lost_chunks}
        for shard_id, have in listed.items():
            for file_id, idx in sorted(have):
                f = files.get(file_id)
                if f is None:
                    rep.leaked.append((shard_id, file_id, idx, 0))
                    continue
                size, chunk_size, is_open = f
                if idx >= -(-size // chunk_size) and not is_open:
                    rep.leaked.append((shard_id, file_id, idx, chunk_size))
        for file_id in files:
            for idx, replicas in (await meta.chunk_map(file_id)).items():
                for shard_id in replicas:
                    if (shard_id in listed and (file_id, idx) not in listed[shard_id]
                            and (file_id, idx) not in damaged_idx):
                        rep.missing.setdefault(file_id, []).append((idx, shard_id))
    return rep


async def collect_garbage(
    client: Client, *, dry_run: bool = False, leaked_chunks: bool = True,
    progress: Callable[[str], None] = lambda msg: None,
) -> Report:
    """Reap dead sessions, free orphans and (with ``leaked_chunks``) leaked chunks.

    Returns:
        What was found; with ``dry_run`` nothing is changed.

    Raises:
        IrdmaError: the metadata engine failed.
    """
    meta = client.meta
    rep = Report()
    rep.sessions = await meta.dead_sessions()
    if not dry_run:
        for s in rep.sessions:
            await meta.reap_session(s.sid)
            progress(f"reaped session {s.sid} ({s.name}, pid {s.pid} on {s.host})")
    for inode in await meta.orphans():
        if await meta.reclaimable(inode.ino) is None:
            continue
        rep.orphans.append(inode.ino)
        if not dry_run:
            try:
                await client.destroy_if_unused(inode.ino)
                progress(f"freed orphan inode {inode.ino} ({inode.size} bytes)")
            except ShardUnavailable as exc:
                progress(f"orphan inode {inode.ino} kept: {exc}")
    if leaked_chunks:
        found = await scan(client, progress=progress)
        rep.leaked, rep.unreachable = found.leaked, found.unreachable
        if not dry_run:
            # free from the first leaked index on, per (shard, file): FREE drops every chunk >= it
            first: dict[tuple[int, int], int] = {}
            for shard_id, file_id, idx, _ in rep.leaked:
                key = (shard_id, file_id)
                first[key] = min(first.get(key, idx), idx)
            for (shard_id, file_id), idx in first.items():
                try:
                    await client._conn_call(shard_id, "free", file_id, idx)
                except IrdmaError as exc:
                    progress(f"cannot free leaked chunks of file {file_id} on shard {shard_id}: {exc}")
            if first:
                progress(f"freed {len(rep.leaked)} leaked chunks")
    return rep
