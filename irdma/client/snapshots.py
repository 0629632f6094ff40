"""Snapshots of a live model: a consistent cut across shards, copy-on-write chunks (issue 23).

How a snapshot is made (``irdma snapshot create PATH NAME``, ``mkdir PATH/.snapshots/NAME``):

1. **Metadata copy** (:meth:`irdma.meta.sql_snap.SqlSnap.snapshot_begin`): the tree of PATH is
   copied inode by inode (new inode numbers, same attributes and xattrs, read-only) under
   ``DIR/.snapshots/NAME``. O(files), no byte of parameters.
2. **Freeze** (one round trip per shard, all shards at once): every shard that may hold a chunk
   of the tree's files holds the updates to those files from now on, clients' and those a
   replica forwards down its chain (:class:`irdma.wire.protocol.Freeze`), and answers each
   chunk's version. Once every shard answered, no update to the files is being applied
   anywhere: that instant is the cut. Every push acknowledged before ``create`` was called was
   applied on every replica before it, and every push that starts after ``create`` returns is
   applied after it.
3. **Clone** (one round trip per shard, all at once): each shard brings its replicas of the
   chunks to the highest version any replica answered (it applies the forwards it holds whose
   version is not past that, and waits for those still on their way), makes each copy's chunks
   share the live file's extents (:meth:`irdma.server.shard.Shard.clone`: no byte copied),
   then ends its freeze: the held updates are applied in the order they came. A shard may end
   its freeze before the others cloned: the post-cut updates it then forwards reach a
   successor that is still frozen, which holds them until its own clone (a forward is past the
   cut when its version is). So a push waits one round trip of the creator to the shards
   (from its FREEZE to its CLONE, plus the catch-up of that shard's replicas), and the
   freeze's lease (:data:`FREEZE_LEASE_S`) bounds it even if this client dies meanwhile; a
   shard holds forwards one second at most (less when their senders' deadlines are shorter); a
   clone that then finds a chunk past the cut is refused.
4. **Thaw**: only for a snapshot given up (a shard failed, or this client was cancelled): every
   shard not cloned yet releases its held updates at once.
5. **Commit**: the copies' chunk maps (the replicas that cloned) are recorded and the
   snapshot is ``ready``. A failure anywhere before takes it all back (thaw, free the clones,
   drop the metadata) and raises: a snapshot either exists whole or not at all.

The first update of a shared chunk afterwards copies it on its shard (copy-on-write: the
snapshot keeps the bytes and the optimizer state of the cut; later updates copy nothing).

A push that spans several requests (a write over several chunks, rows on several shards) is
in the snapshot whole or not at all: the client tags each request as a part of its push
(:class:`irdma.wire.protocol.Part`), each shard's FREEZE answer names the parts it applied of
late, and a push the freeze split (some parts applied before it, some held or still on their
way) is admitted whole into the cut before CLONE (:func:`_whole_pushes`: every shard applies
that push's held parts, the others as they come). A frozen shard goes on reading a
connection's requests while it holds one, so no part is stuck behind a held one.

Sources: CephFS snapshots (``.snap``, Ceph documentation "CephFS Snapshots"); ZFS snapshots
and copy-on-write (Bonwick et al., "The Zettabyte File System", 2003); the consistent cut of
Chandy and Lamport, "Distributed Snapshots", ACM TOCS 1985 (here with the cut enforced by
holding writes rather than by markers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .._concurrency import open_nursery
from .._errors import InvalidArgument, IrdmaError, NotFound, NotPermitted, ShardUnavailable
from ..meta.base import Inode, Snapshot
from ..placement import Layout
from ..transport import ShardConnection
from ..wire.protocol import MAX_ADMIT, FreezeReply

if TYPE_CHECKING:
    from .native import Client

log = logging.getLogger("irdma.client")

#: Seconds a shard holds client updates for a snapshot at most (the freeze's lease).
FREEZE_LEASE_S = 5.0
#: Seconds after which a snapshot still ``creating`` counts as abandoned (its creator died:
#: a create ends within FREEZE_LEASE_S of its cut, or fails and takes its snapshot away).
#: ``irdma gc`` deletes it, and so does a create with ``keep`` of the same file or tree.
ABANDONED_S = 600.0
#: Seconds a snapshot waits for the last parts of a push its freeze split (:func:`_whole_pushes`):
#: well under the second a frozen shard holds forwards (``server.dispatch.FORWARD_HOLD_S``).
ADMIT_WAIT_S = 0.5
#: Milliseconds a shard waits for a held part on one ADMIT before it answers (every shard is
#: asked, and one that holds no part of the pushes waits this long: a push's parts are sent at
#: once, so a missing one is a few milliseconds away).
ADMIT_POLL_MS = 5


@dataclass
class SnapshotInfo:
    """One snapshot as ``irdma snapshot list`` shows it.

    Attributes:
        name: its name (``DIR/.snapshots/NAME``).
        path: where to read it.
        created_ns: when it was made, nanoseconds since the Unix epoch.
        files: regular files in it.
        bytes: the sum of its files' sizes (bytes).
        state: ``ready``, or ``creating`` while being made (or left by a creator that died:
            ``irdma snapshot delete`` removes it, ``irdma gc`` once it is :data:`ABANDONED_S` old).
        held_alone: bytes the shards hold for it alone, every replica counted (what
            ``delete`` frees: the chunks copied since, as the live files changed); -1 when a
            shard did not answer.
        shared: bytes of its chunks it still shares with the live files or other snapshots
            (every replica counted); -1 when a shard did not answer.
        maker: the uid whose snapshot it is (:func:`maker_of`: who made it through a mount,
            else its top directory's owner); it, the directory's owner and root may delete it.
    """

    name: str
    path: str
    created_ns: int
    files: int
    bytes: int
    state: str
    held_alone: int = 0
    shared: int = 0
    maker: int = 0


def _serving(client: Client, layout: Layout) -> list[int]:
    """The shards that may hold the file's chunks, less those drained or removed from the cluster."""
    out = []
    for sid in sorted(client.shards_of(layout)):
        rec = client.view.shard_map.get(sid)
        if rec is not None and rec.state not in ("drained", "removed"):
            out.append(sid)
    return out


async def _dir_of(client: Client, path: str) -> tuple[str, Inode]:
    """The directory whose ``.snapshots`` holds PATH's snapshots, and its path."""
    inode = await client.meta.resolve(path)
    if inode.is_dir:
        return path.rstrip("/") or "/", inode
    parent = os.path.dirname(path.rstrip("/")) or "/"
    return parent, await client.meta.resolve(parent)


async def create(client: Client, path: str, name: str, *, keep: int | None = None) -> SnapshotInfo:
    """Snapshot file or directory ``path`` as ``DIR/.snapshots/NAME`` (see the module doc).

    ``keep``: then delete the oldest snapshots of DIR beyond the newest ``keep`` (as
    ``tf.train.CheckpointManager``'s ``max_to_keep``).

    Raises:
        Exists: DIR has a snapshot named ``name``. InvalidArgument: a bad name or ``keep``.
        ReadOnly: ``path`` is in a snapshot. NotFound: no such path.
        ShardUnavailable, BadRequest: a shard holding the files could not take part (down,
            or its freeze's lease ended): nothing was kept; try again.
    """
    inode = await client.meta.resolve(path)
    snap = await create_at(client, inode.ino, os.fsencode(name), keep=keep)
    dir_path, _ = await _dir_of(client, path)
    return await _info(client, dir_path, snap)


async def create_at(client: Client, ino: int, name: bytes, *, keep: int | None = None, owner: int | None = None,
                    reader: tuple[int, Sequence[int]] | None = None) -> Snapshot:
    """:func:`create` of inode ``ino`` (the mount's ``mkdir D/.snapshots/NAME``).

    ``owner``: the snapshot's maker, recorded with it (may delete it: :func:`delete_at`; shown
    as its top directory's owner; the tree keeps the directory's owners, and so do its clones);
    None: none recorded (the directory's owner). ``reader``: ``(uid, gids)`` of a maker who
    must be able to reach and read every file of the tree (a mount's user: nobody pins bytes
    it may not read; the directory's owner and root pass); None: no check.

    Raises:
        What :func:`create` raises; NotPermitted: ``reader`` may not reach or read a file of the tree;
        QuotaExceeded: the directory holds as many snapshots as its ``user.irdma.max_snapshots``
        allows (those ``keep`` deletes after are not counted). Nothing is kept then.
    """
    if keep is not None and keep < 1:
        raise InvalidArgument(f"--keep {keep}: keep at least 1 snapshot")
    spare = 0
    if keep is not None:  # what keep deletes once this one is made: not counted against the limit
        top = await client.meta.getattr(ino)
        mine = [s for s in await client.meta.snapshots(ino if top.is_dir else await client.meta.parent_of(ino))
                if s.src == ino]
        ready = [s for s in mine if s.state == "ready"]
        spare = max(0, len(ready) + 1 - keep) + sum(s.state == "creating" and s.created_ns < abandoned_before()
                                                    for s in mine)
    snap, files = await client.meta.snapshot_begin(ino, name, owner=owner, reader=reader, spare=spare)
    try:
        try:
            cloned = await _cut(client, snap, files)
        except IrdmaError as exc:
            if isinstance(exc, ShardUnavailable) or "take the snapshot again" not in str(exc):
                raise ShardUnavailable(f"snapshot {name.decode(errors='replace')!r} was not taken: {exc}",
                                       "nothing was kept; take it again (once `irdma status` shows every shard up)"
                                       ) from exc
            raise
        snap = await client.meta.snapshot_commit(snap.id, cloned)
    except BaseException:
        with trio.CancelScope(shield=True), contextlib.suppress(NotFound):  # (gone: taken for abandoned)
            await _drop(client, snap)
        raise
    if keep is not None:  # only snapshots of the same file or tree: never one made of something else
        mine = [s for s in await client.meta.snapshots(snap.dir) if s.src == snap.src]
        ready = [s for s in mine if s.state == "ready"]
        dead = [s for s in mine if s.state == "creating" and s.created_ns < abandoned_before()]
        for old in ready[: max(0, len(ready) - keep)] + dead:
            with contextlib.suppress(NotFound):  # (another create or gc took it first)
                await _drop(client, old)
    return snap


def abandoned_before() -> int:
    """The time (nanoseconds since the Unix epoch) before which a snapshot still ``creating``
    was abandoned: :data:`ABANDONED_S` ago."""
    return time.time_ns() - int(ABANDONED_S * 1e9)


async def drop_abandoned(client: Client, before_ns: int | None = None,
                         progress: Callable[[str], None] = lambda msg: None) -> list[Snapshot]:
    """Delete the snapshots left ``creating`` by creators that died (begun more than
    :data:`ABANDONED_S` ago, or before ``before_ns``, nanoseconds since the Unix epoch): their
    metadata, and the clones their cut may have made on the shards. ``irdma gc`` calls it.

    Returns:
        The snapshots deleted (one another client deleted first is left out).
    """
    gone = []
    for snap in await client.meta.abandoned_snapshots(abandoned_before() if before_ns is None else before_ns):
        try:
            await _drop(client, snap)
        except NotFound:
            continue
        progress(f"deleted snapshot {snap.name.decode(errors='replace')!r} of directory inode {snap.dir}, left"
                 " 'creating' by a creator that died")
        gone.append(snap)
    return gone


@contextlib.asynccontextmanager
async def _control(client: Client, shards: Sequence[int]) -> AsyncIterator[dict[int, ShardConnection]]:
    """The client's snapshot connection to each shard for FREEZE, CLONE and THAW
    (:meth:`irdma.client.pool.ShardPool.snapshot_connection`: kept open across snapshots). A snapshot that
    fails closes them (a request of it may be half done on one); the next opens new ones.

    One snapshot of this client at a time uses them. Another made meanwhile (two ``mkdir
    .snapshots/NAME`` through one mount) gets connections of its own for its cut, closed after:
    a shard applies one connection's CLONEs in order, and with chains of 3 one snapshot's CLONE
    may wait for another shard's CLONE of the same snapshot (its pre-cut forwards), so two cuts
    on shared connections could wait on each other."""
    pool = client.pool
    if pool.snapshot_lock.locked():
        async with _own_connections(client, shards) as own:
            yield own
        return
    async with pool.snapshot_lock:
        conns: dict[int, ShardConnection] = {}

        async def connect(sid: int) -> None:
            conns[sid] = await pool.snapshot_connection(sid)

        try:
            async with open_nursery() as connecting:
                for sid in shards:
                    connecting.start_soon(connect, sid)
            yield conns
        except BaseException:
            with trio.CancelScope(shield=True):
                for sid in shards:
                    await pool.drop_snapshot_connection(sid)
            raise


@contextlib.asynccontextmanager
async def _own_connections(client: Client, shards: Sequence[int]) -> AsyncIterator[dict[int, ShardConnection]]:
    """A TCP connection to each shard for one snapshot's cut, closed after it."""
    from ..transport import make_transport

    transport = make_transport("tcp")
    keys = client.pool.keys
    conns: dict[int, ShardConnection] = {}
    async with open_nursery() as nursery:
        try:
            async def connect(sid: int) -> None:
                conns[sid] = await transport.connect(client.view.shard_map[sid].address, nursery,
                                                     client_name=f"{client.pool.name} (snapshot)",
                                                     key=keys.ring() if keys is not None else None,
                                                     timeout=client.timeout)

            async with open_nursery() as connecting:
                for sid in shards:
                    connecting.start_soon(connect, sid)
            yield conns
        finally:
            with trio.CancelScope(shield=True):
                for conn in conns.values():
                    await conn.aclose()
            nursery.cancel_scope.cancel()


async def _cut(client: Client, snap: Snapshot, files: Sequence[tuple[Inode, int]]) -> list[tuple[int, int, int, int]]:
    """Freeze and clone on every shard that may hold the files' chunks (each CLONE ends its
    shard's freeze; THAW for those that did not clone).

    Returns:
        ``(live file, copy, chunk index, shard)`` of every chunk replica the shards cloned: the
        copies' chunk map (the chunk map at the cut, not at commit time).
    """
    from .view import layout_of

    await client.refresh_view()
    layouts = {f.ino: layout_of(f) for f, _ in files}
    copies = dict((f.ino, copy) for f, copy in files)
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for f, copy in files:
        if f.stripe:
            for sid in _serving(client, layouts[f.ino]):
                by_shard.setdefault(sid, []).append((f.ino, copy))
    shards = sorted(sid for sid in by_shard if client.view.health.get(sid, "up") not in ("down", "syncing"))
    missing = sorted(set(by_shard) - set(shards))
    if missing:
        raise ShardUnavailable(f"shard {missing[0]} holds chunks of these files and is {client.view.health.get(missing[0])}",
                               "wait until `irdma status` shows it up (resynced), then take the snapshot again")
    token = int.from_bytes(os.urandom(8), "big") >> 1 or 1
    lease_ms = int(FREEZE_LEASE_S * 1000)
    answered: list[tuple[int, int, int]] = []
    parts: dict[int, tuple[int, set[int]]] = {}  # push id: (part count, parts applied)
    cloned: list[tuple[int, int, int, int]] = []
    ended: set[int] = set()  # shards whose CLONE was made (and ended their freeze)

    def note(reply: FreezeReply) -> None:
        answered.extend((e.file_id, e.chunk_index, e.version) for e in reply.entries)
        for p in reply.parts:
            parts.setdefault(p.push_id, (p.count, set()))[1].add(p.index)

    async with _control(client, shards) as conns:
        try:
            async def freeze(sid: int) -> None:
                inos = [src for src, _ in by_shard[sid]]
                with trio.fail_after(client.timeout):
                    note(await conns[sid].freeze(token, lease_ms, inos))

            async with open_nursery() as nursery:
                for sid in shards:
                    nursery.start_soon(freeze, sid)
            await _whole_pushes(conns, token, parts, note)
            # the cut: every chunk any replica has, at the highest version any answered
            cut: dict[tuple[int, int], int] = {}
            for fid, idx, v in answered:
                cut[(fid, idx)] = max(cut.get((fid, idx), 0), v)
            # each replica placed for a chunk waits for it, even one that has not made it yet
            # (its forwarded creation still on its way): never a snapshot with a replica short
            want: dict[int, list[tuple[int, int, int]]] = {sid: [] for sid in shards}
            for (fid, idx), v in sorted(cut.items()):
                chain, joining = client.placed(layouts[fid], idx)
                for sid in chain:
                    if sid in want and sid != joining:
                        want[sid].append((fid, idx, v))
                        cloned.append((fid, copies[fid], idx, sid))
            async def clone(sid: int) -> None:
                with trio.fail_after(client.timeout):
                    await conns[sid].clone(token, by_shard[sid], want[sid])
                if conns[sid].info.version >= 10:
                    ended.add(sid)  # its CLONE ended its freeze (protocol 10; a shard of 9 waits for THAW)

            async with open_nursery() as nursery:
                # sizes at the cut (the metadata copy was made before the freeze), while the shards clone
                nursery.start_soon(client.meta.snapshot_sizes, snap.id, [(f.ino, copy) for f, copy in files])
                for sid in shards:
                    nursery.start_soon(clone, sid)
        finally:  # a shard not cloned (or of protocol 9) keeps its freeze until THAW or its lease: end it now
            with trio.CancelScope(shield=True), trio.move_on_after(client.timeout):
                async def thaw(sid: int) -> None:
                    try:
                        await conns[sid].thaw(token)
                    except IrdmaError as exc:  # its lease ends the freeze anyway
                        log.warning("snapshot: could not thaw shard %d (its lease ends it): %s", sid, exc)

                async with trio.open_nursery() as nursery:
                    for sid in conns:  # every one not cloned: a freeze cancelled in flight may have landed
                        if sid not in ended:
                            nursery.start_soon(thaw, sid)
    return cloned


async def _whole_pushes(conns: dict[int, ShardConnection], token: int, parts: dict[int, tuple[int, set[int]]],
                        note: Callable[[FreezeReply], None]) -> None:
    """Take whole into the cut every push the freeze split: one some of whose parts (requests,
    :class:`irdma.wire.protocol.Part`) a shard applied before its freeze while others were
    still on their way. Every shard is asked (ADMIT) to apply the parts of those pushes it
    holds, and those that come, until every part is in; ``note`` gets each answer (the chunks'
    new versions, the parts applied). A part that does not come within :data:`ADMIT_WAIT_S`
    belongs to a push its client gave up (an error answered: never acknowledged), and the cut
    is taken without it."""
    deadline = trio.current_time() + ADMIT_WAIT_S
    while True:
        split = sorted(pid for pid, (count, got) in parts.items() if len(got) < count)
        if not split:
            return
        if trio.current_time() >= deadline:
            log.warning("snapshot: %d pushes split by the cut did not send every part within %.1f s (their clients"
                        " gave up on them); the snapshot holds what of them was applied", len(split), ADMIT_WAIT_S)
            return
        split = split[:MAX_ADMIT]

        async def admit(sid: int, pushes: list[int] = split) -> None:
            with trio.fail_after(ADMIT_WAIT_S + 5):
                note(await conns[sid].admit(token, pushes, ADMIT_POLL_MS))

        async with open_nursery() as nursery:
            for sid in conns:
                nursery.start_soon(admit, sid)


async def _find(client: Client, path: str, name: str) -> tuple[str, Snapshot]:
    dir_path, dir_inode = await _dir_of(client, path)
    for snap in await client.meta.snapshots(dir_inode.ino):
        if snap.name == os.fsencode(name) and snap.state == "ready":
            return dir_path, snap
    raise NotFound(f"{path} has no snapshot named {name!r}", f"`irdma snapshot list {path}` lists them")


async def _find_of(client: Client, path: str, name: str, verb: str) -> tuple[str, Snapshot]:
    """:func:`_find`, for a tool that acts on what the snapshot holds (restore, clone): the
    snapshot must be of ``path`` itself, its directory's tree or its one file.

    Raises:
        NotFound: no such snapshot. InvalidArgument: ``path`` is a file and the snapshot is of
            its directory's whole tree, or the snapshot is of a file and ``path`` is its
            directory or another file (nothing done: the message names the right path).
    """
    dir_path, snap = await _find(client, path, name)
    named = path.rstrip("/") or "/"
    base = dir_path.rstrip("/")
    target = await client.meta.resolve(path)
    if snap.src == snap.dir:
        if target.ino != snap.dir:
            raise InvalidArgument(f"snapshot {name!r} is of the directory {dir_path}, not of {named}: nothing was done",
                                  f"`irdma snapshot {verb} {dir_path} {name}` {verb}s the whole directory; to get"
                                  f" back one file, copy it from {base}/.snapshots/{name}/")
        return dir_path, snap
    (held, _), = await client.meta.readdir(snap.root)
    of = f"{base}/{held.decode(errors='replace')}"
    if target.is_dir or os.fsencode(named.rsplit("/", 1)[-1]) != held:
        raise InvalidArgument(f"snapshot {name!r} is of the file {of}, not of {named}: nothing was done",
                              f"run `irdma snapshot {verb} {of} {name}` to {verb} that file")
    return dir_path, snap


async def _source(client: Client, snap: Snapshot) -> Inode:
    """What a snapshot holds: its tree's root (a directory's snapshot) or its one file."""
    root = await client.meta.getattr(snap.root)
    if snap.src == snap.dir:
        return root
    (_, only), = await client.meta.readdir(snap.root)
    return only


async def _clone_into(client: Client, src: Inode, parent: int, name: bytes) -> Inode:
    """Copy ``src`` (a snapshot's tree) as live ``name`` in ``parent``, sharing its chunks."""
    from .view import layout_of

    copy, files = await client.meta.clone_tree(src.ino, parent, name)
    try:
        await client.refresh_view()
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for f, new in files:
            if f.stripe:
                for sid in _serving(client, layout_of(f)):
                    by_shard.setdefault(sid, []).append((f.ino, new))

        async def clone(sid: int) -> None:
            await client.pool.call(sid, ShardConnection.clone, 0, by_shard[sid], [])

        async with open_nursery() as nursery:
            for sid in by_shard:
                nursery.start_soon(clone, sid)
        await client.meta.copy_chunk_maps([(f.ino, new) for f, new in files], sorted(by_shard))
    except BaseException:
        with trio.CancelScope(shield=True):
            for ino in await client.meta.remove_tree(copy.ino):
                await client.destroy_if_unused(ino, grace=False)
        raise
    return copy


async def clone(client: Client, path: str, name: str, new_path: str) -> Inode:
    """A writable copy of snapshot ``name`` of ``path`` at ``new_path`` (its directory tree, or
    its file), sharing every chunk with the snapshot until written (copy-on-write). O(files).

    Raises:
        NotFound: no such snapshot, or ``new_path``'s directory is missing. InvalidArgument:
            the snapshot is not of ``path`` (its directory's, or another file's). Exists: ``new_path``
            exists. ShardUnavailable: a shard holding the snapshot did not answer (nothing made).
    """
    _, snap = await _find_of(client, path, name, "clone")
    parent = os.path.dirname(new_path.rstrip("/")) or "/"
    base = os.path.basename(new_path.rstrip("/"))
    return await _clone_into(client, await _source(client, snap), (await client.meta.resolve(parent)).ino,
                             os.fsencode(base))


async def restore(client: Client, path: str, name: str) -> None:
    """Make ``path`` what snapshot ``name`` holds again, atomically for readers: a file is
    replaced by a copy of the snapshot's (rename(2) over it: an open file keeps what it had);
    a directory's entries are swapped for a copy of the snapshot's tree in one metadata
    transaction (the directory keeps its inode and its snapshots). The chunks are shared with
    the snapshot (no byte copied); what only the old files held is freed.

    ``path`` names what the snapshot is of: its directory (a snapshot of the directory's
    tree), or its file (a snapshot of that file); any other path is refused.

    Raises:
        NotFound: no such snapshot. InvalidArgument: the snapshot is not of ``path`` (a file
            of a directory's snapshot, the directory or another file of a file's): nothing
            changed. NotEmpty: a subdirectory holds snapshots of its own (delete them, or
            restore that subdirectory). ShardUnavailable: nothing changed.
    """
    dir_path, snap = await _find_of(client, path, name, "restore")
    src = await _source(client, snap)
    tmp = b".irdma-restore-" + os.urandom(6).hex().encode()
    if snap.src == snap.dir:  # the directory's tree
        parent_path = os.path.dirname(dir_path.rstrip("/")) or "/"
        tree = await _clone_into(client, src, (await client.meta.resolve(parent_path)).ino, tmp)
        try:
            gone = await client.meta.restore_contents(snap.dir, tree.ino)
        except BaseException:
            with trio.CancelScope(shield=True):
                for ino in await client.meta.remove_tree(tree.ino):
                    await client.destroy_if_unused(ino, grace=False)
            raise
    else:  # one file
        fname = (await client.meta.readdir(snap.root))[0][0]
        await _clone_into(client, src, snap.dir, tmp)
        replaced = await client.meta.rename(snap.dir, tmp, snap.dir, fname)
        gone = [replaced.ino] if replaced is not None and replaced.nlink <= 0 else []
    async with open_nursery() as nursery:  # freed past the unlink grace (mounts may cache the names)
        for ino in gone:
            nursery.start_soon(client.destroy_later, ino)


async def _drop(client: Client, snap: Snapshot) -> int:
    """Take a snapshot away: its metadata, then its chunks on the shards, one FREE_FILES
    request per shard for all its files (what cannot be freed now, ``irdma gc`` frees).
    Returns how many files it had."""
    from ..wire.protocol import MAX_SNAPSHOT_FILES
    from .view import layout_of

    files = await client.meta.snapshot_drop(snap.id)
    by_shard: dict[int, list[int]] = {}
    for f in files:
        if client.cached is not None:
            client.cached.invalidate(f.ino)
        if f.stripe:
            for sid in _serving(client, layout_of(f)):
                by_shard.setdefault(sid, []).append(f.ino)

    async def free(sid: int, inos: list[int]) -> None:
        try:
            for at in range(0, len(inos), MAX_SNAPSHOT_FILES):
                await client.pool.call(sid, ShardConnection.free_files, inos[at : at + MAX_SNAPSHOT_FILES])
        except IrdmaError as exc:
            log.warning("snapshot %s: its chunks on shard %d stay until `irdma gc` (%s)",
                        snap.name.decode(errors="replace"), sid, exc)

    async with trio.open_nursery() as nursery:  # every shard at once
        for sid, inos in by_shard.items():
            nursery.start_soon(free, sid, inos)
    return len(files)


async def delete(client: Client, path: str, name: str) -> int:
    """Delete snapshot ``name`` of ``path`` (a directory, or a file of it); what only it held on
    the shards is freed. Returns how many files it had.

    Raises:
        NotFound: no such snapshot.
    """
    _, dir_inode = await _dir_of(client, path)
    try:
        return await delete_at(client, dir_inode.ino, os.fsencode(name))
    except NotFound:
        raise NotFound(f"{path} has no snapshot named {name!r}", f"`irdma snapshot list {path}` lists them") from None


async def delete_at(client: Client, dir_ino: int, name: bytes, *, uid: int | None = None) -> int:
    """:func:`delete` of directory inode ``dir_ino``'s snapshot ``name`` (the mount's rmdir).

    ``uid``: the user asking (a mount's); it may delete the snapshot when it made it (its
    recorded maker: :func:`maker_of`), owns the directory, or is root. None: anyone (the
    operator's tools act with the metadata database's rights).

    Raises:
        NotFound: no such snapshot. NotPermitted: ``uid`` may not delete it (nothing changed).
    """
    for snap in await client.meta.snapshots(dir_ino):
        if snap.name == name:
            if uid is not None and uid != 0:
                owners = {(await client.meta.getattr(dir_ino)).uid, await maker_of(client, snap)}
                if uid not in owners:
                    raise NotPermitted(f"snapshot {name.decode(errors='replace')!r} is another user's: its maker, the"
                                       " directory's owner and root may delete it", "ask one of them")
            return await _drop(client, snap)
    raise NotFound(f"no snapshot named {name.decode(errors='replace')!r}")


async def maker_of(client: Client, snap: Snapshot) -> int:
    """The uid whose snapshot ``snap`` is: its recorded maker, else (made by root or the
    operator's tools, or before makers were recorded) its top directory's owner."""
    return snap.maker if snap.maker is not None else (await client.meta.getattr(snap.root)).uid


async def _info(client: Client, dir_path: str, snap: Snapshot) -> SnapshotInfo:
    from .view import layout_of

    files = await client.meta.snapshot_files(snap.id)
    base = dir_path.rstrip("/")
    by_shard: dict[int, list[int]] = {}
    for f in files:
        if f.stripe:
            for sid in _serving(client, layout_of(f)):
                by_shard.setdefault(sid, []).append(f.ino)
    held: dict[int, tuple[int, int]] = {}  # shard: (bytes alone, bytes shared)

    async def usage(sid: int, inos: list[int]) -> None:
        try:
            entries = await client.pool.call(sid, ShardConnection.usage, inos)
            held[sid] = (sum(a for _, a, _ in entries), sum(s for _, _, s in entries))
        except IrdmaError as exc:
            log.warning("snapshot %s: shard %d did not say what it holds: %s", snap.name.decode(errors="replace"), sid, exc)

    async with trio.open_nursery() as nursery:  # every shard at once
        for sid, inos in sorted(by_shard.items()):
            nursery.start_soon(usage, sid, inos)
    alone = shared = -1
    if len(held) == len(by_shard):
        alone, shared = sum(a for a, _ in held.values()), sum(s for _, s in held.values())
    return SnapshotInfo(snap.name.decode(errors="replace"), f"{base}/.snapshots/{snap.name.decode(errors='replace')}",
                        snap.created_ns, len(files), sum(f.size for f in files if stat.S_ISREG(f.mode)), snap.state,
                        alone, shared, await maker_of(client, snap))


async def list_snapshots(client: Client, path: str) -> list[SnapshotInfo]:
    """The snapshots of ``path`` (a directory, or a file: its directory's), oldest first."""
    dir_path, dir_inode = await _dir_of(client, path)
    return [await _info(client, dir_path, s) for s in await client.meta.snapshots(dir_inode.ino)]
