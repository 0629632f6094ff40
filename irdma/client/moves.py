"""Admin moves of chunks between shards: resync, drain, rebalance, removal.

What each one does (every one runs while updates go on, and is safe to run again after a
failure: it resumes where the shard map and the chunk maps say it stopped):

- **resync** (``irdma shard resync``; a mount's heartbeat runs :meth:`ShardMoves.resync_all`):
  a shard back after being down is ``syncing``, the tail of its chains (it takes every update
  but serves no read). The resync compares each chunk it is a replica of with the chain's head
  (version and CRC-32), has the head send its copy where they differ (RESYNC, on the link that
  carries the chain's updates, so the copy is never overtaken by an update it lacks), puts the
  shard back in the chunk's in-sync set, and finally marks the shard up.
- **drain** (``irdma shard drain``): the shard map marks the shard *draining* with the shards in
  service as targets; from that view on every chain holding it gains a *joining* tail
  (:func:`irdma.placement.substitute`); each chunk is copied from the target's predecessor in
  the chain, the move is marked done (the shard leaves the chunk maps and its chains) and the
  shard's copies are freed.
- **rebalance** (``irdma rebalance``): the same move, for a share of the chunks of each shard
  holding more than the mean, to the shards under it.
- **remove** (``irdma shard remove``): a drained shard leaves the cluster; ``--force`` takes out
  one in any state, declares the chunks only it held lost and copies the others to the chains'
  new members from their surviving replicas.

The rules they follow (Kafka's ISR; 3FS's chain states and LASTSRV):

- Each chunk has an *in-sync set*: the replicas its chunk map records with their shard's current
  incarnation. A writer whose chain skips a replica that is down first withdraws it, durably
  (its row becomes :data:`irdma.meta.base.OUT_OF_SYNC`); only a resync that copied the chunk
  puts it back (:meth:`irdma.meta.MetaStore.note_replica`, in the view the copy was made in).
- Where every replica of a chunk failed, the in-sync set decides which copy is the truth, never
  the versions: a replica out of it waits for one in it to be back (:class:`_ChunksWaiting`
  names them), unless an operator takes its copy anyway (``--force-from``: the updates it
  missed are lost). A chunk whose in-sync replicas all lost their memory is lost (``irdma
  fsck`` names it) and holds nothing back.
- Before comparing anything, every shard up in the view is *fenced* at it (a CHECKSUM naming
  the view): an update built on an older view, whose chain skipped the shard being resynced or
  lacked a move's target, can land nowhere after that.

:class:`ShardMoves` holds them, over the client's :class:`~irdma.client.pool.ShardPool` and
:class:`~irdma.client.view.ShardView`; :class:`irdma.Client` keeps methods of the same names that
call it, so callers (the CLI, the mount, fsck, tests) use the client alone.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import trio

from .._concurrency import open_nursery
from .._errors import DataLost, InvalidArgument, IrdmaError, ShardUnavailable
from ..meta import Inode, ShardRecord
from ..meta.base import OUT_OF_SYNC
from ..placement import MOVE_ALL
from ..transport import ShardConnection
from ..wire.protocol import ChunkEntry, StatReply
from .pool import ShardPool
from .view import layout_of

#: Chunks a move (drain, rebalance) copies at once.
MOVE_COPIES = 4

#: A move's progress callback: ``(done_bytes, total_bytes, done_items, total_items)``, bytes of
#: the chunks handled so far (compared, and copied where they differ) and of all to handle, and
#: the same counted in chunks (:func:`irdma.ops.progress.transfer_progress` shows it).
MoveProgress = Callable[[int, int, int, int], None]


def _no_progress(done_bytes: int, total_bytes: int, done_items: int, total_items: int) -> None:
    pass

# the client's logger: what a move logs is what the client did
log = logging.getLogger("irdma.client")


class _ChunksWaiting(ShardUnavailable):
    """A resync that cannot finish yet: chunks wait for in-sync replicas on other shards
    (``waiting``: shard id -> inode numbers of files)."""

    def __init__(self, waiting: dict[int, set[int]], message: str, hint: str) -> None:
        super().__init__(message, hint)
        self.waiting = waiting


class ShardMoves:
    """The admin moves of one client (one per :class:`irdma.Client`, which calls it).

    It acts through the client's shard connections and their view (``pool.view``: the shard map,
    its chains, the metadata engine), and keeps what resyncs remember between calls.

    Args:
        pool: the client's shard connections, whose view the moves read and refresh.
    """

    def __init__(self, pool: ShardPool) -> None:
        self.pool = pool
        self.view = pool.view
        self.meta = pool.view.meta
        self._resync_said: dict[int, str] = {}  # the last reason each shard's resync gave, logged once
        self._resyncing: set[int] = set()  # shards a resync in progress waits for (no cycles)

    async def resync_shard(self, shard_id: int, progress: MoveProgress | None = None, force: bool = False) -> int:
        """See :meth:`_resync_once`; chunks that wait for in-sync replicas which are reachable
        but catching up themselves are retried once those shards were resynced first."""
        try:
            return await self._resync_once(shard_id, progress or _no_progress, force)
        except _ChunksWaiting as exc:
            helped = False
            for sid in sorted(exc.waiting):
                rec = self.view.shard_map.get(sid)
                if sid in self._resyncing or rec is None or rec.health != "syncing":
                    continue
                self._resyncing.add(sid)
                try:
                    await self.resync_shard(sid)
                    helped = True
                except IrdmaError:
                    pass
                finally:
                    self._resyncing.discard(sid)
            if not helped:
                raise
            return await self._resync_once(shard_id, progress or _no_progress, force)

    async def _resync_once(self, shard_id: int, progress: MoveProgress, force: bool) -> int:
        """Bring a shard that is catching up (``syncing``) level with its chains, then mark it
        up. For every written chunk of a replicated file with a replica there, and every chunk
        of such a file the shard holds (it may have missed a truncate):

        - a chunk with a replica up: compare version and CRC-32 with the chain's head and have
          the head send its copy (RESYNC, ordered after the head's updates) where they differ,
          or drop the shard's copy where the chunk is no longer written; the shard rejoins the
          chunk's in-sync set (:meth:`irdma.meta.MetaStore.note_replica`, in this view only);
        - a chunk none of whose replicas is up (they all failed, in some order): the chunk map's
          in-sync set decides, never the versions (3FS's LASTSRV; Kafka's ISR). A shard in it
          holds every acknowledged update and needs nothing; one out of it waits for an in-sync
          replica to be back (a reachable in-sync shard that is itself catching up is resynced
          first). A chunk whose in-sync replicas all lost their memory is lost (``irdma fsck``
          names it) and does not hold the shard back.
        - ``force`` (``irdma shard resync --force-from``): a chunk still waiting takes this
          shard's own copy as the truth: the acknowledged updates it missed are lost.

        Updates go on meanwhile: the shard is the tail of its chains and takes them (a chunk it
        is behind on is copied whole then).

        Returns:
            Bytes copied.

        Raises:
            ShardUnavailable: the shard or a head failed, the shard map changed meanwhile, or
                chunks wait for an in-sync replica that is down (the message names the shards
                and files); run it again (mounts do at each heartbeat).
        """
        await self.view.refresh()
        view = self.view.epoch
        # files striped over it, or over a shard it takes chunks from
        files = await self.meta.replicated_chunks(self.view.feeding(shard_id))
        wanted = {(inode.ino, idx) for inode, idxs in files for idx in idxs}
        by_ino = {inode.ino: inode for inode, _ in files}
        async for page in self.list_chunks(shard_id):  # what it kept of chunks freed meanwhile
            wanted.update((e.file_id, e.chunk_index) for e in page if e.file_id in by_ino)
        todo = [(by_ino[ino], idx) for ino, idx in sorted(wanted)
                if shard_id in self.view.placed(layout_of(by_ino[ino]), idx)[0]]
        copied = 0
        total_bytes = sum(layout_of(inode).chunk_size for inode, _ in todo)
        done_bytes = 0
        progress(0, total_bytes, 0, len(todo))
        inc = (await self.pool.connection(shard_id)).info.incarnation
        # every shard up in this view fences older views from now on (file 0 never exists): an
        # update built on a view without this shard in its chains can land nowhere after this
        await self._fence(view, skip=shard_id)
        incs = {sid: r.incarnation for sid, r in self.view.shard_map.items()}
        incs[shard_id] = inc
        maps: dict[int, dict[int, dict[int, int]]] = {}  # chunk maps read after the fence
        waiting: dict[int, set[int]] = collections.defaultdict(set)  # in-sync shard -> files
        adopted = 0
        for n, (inode, idx) in enumerate(todo, 1):
            layout = layout_of(inode)
            if inode.ino not in maps:
                maps[inode.ino] = await self.meta.chunk_map(inode.ino)
            row = maps[inode.ino].get(idx, {})
            try:
                chain: tuple[int, ...] = self.view.chain_of(layout, idx)
            except ShardUnavailable:
                chain = ()  # no replica up
            insync = [s for s, i in row.items() if i != OUT_OF_SYNC and i == incs.get(s)]
            if force and row and shard_id not in insync and not any(self.view.in_view(s) for s in insync):
                # --force-from: no up-to-date copy is in service (lost, or down): this shard's
                # copy becomes the truth, and the rest of its chain gets it
                mine = await self.pool.call(shard_id, ShardConnection.checksum, inode.ino, idx, view)
                if mine[0] and insync:  # the copies it replaces are out (if one comes back, it resyncs)
                    await self.meta.withdraw_replicas(inode.ino, [(idx, s) for s in insync])
                if mine[0] and await self.meta.note_replica(inode.ino, idx, shard_id, inc, view):
                    adopted += 1
                    others = tuple(s for s in chain if s != shard_id)
                    if others:
                        await self.pool.call(shard_id, ShardConnection.resync, inode.ino, idx, layout.chunk_size,
                                                     self.view.chain(0, others))
                        for sid in others:
                            await self.meta.note_replica(inode.ino, idx, sid,
                                                                await self.pool.incarnation(sid), view)
                        copied += layout.chunk_size
            elif chain and chain[0] != shard_id and (not row or chain[0] in insync or shard_id not in chain):
                # (a shard heading the chain has nothing to compare with: only the in-sync set says)
                if shard_id not in chain:
                    raise ShardUnavailable(f"shard {shard_id} is not in the chain of chunk {idx} of file {inode.ino}")
                head = chain[0]
                # both name the view: from here on the head fences updates of older views (ones
                # that skipped this shard), so none lands after the comparison
                mine = await self.pool.call(shard_id, ShardConnection.checksum, inode.ino, idx, view)
                theirs = await self.pool.call(head, ShardConnection.checksum, inode.ino, idx, view)
                # equal data, yet out of sync: it missed an optimizer-state write (the state
                # chunk rides along with a RESYNC)
                if theirs[0] and (mine != theirs or row.get(shard_id) == OUT_OF_SYNC):
                    rest = chain[chain.index(head) + 1 :]
                    try:
                        await self.pool.call(head, ShardConnection.resync, inode.ino, idx, layout.chunk_size,
                                                     self.view.chain(0, rest))
                    except DataLost:
                        pass  # freed at the head meanwhile (truncated or removed): nothing to copy
                    else:
                        copied += layout.chunk_size
                elif mine[0] and not theirs[0] and not row:  # freed (truncated) while this shard was down
                    await self.pool.call(shard_id, ShardConnection.punch, inode.ino, idx, 0)
                if theirs[0]:
                    await self.meta.note_replica(inode.ino, idx, shard_id, inc, view)
            elif insync and shard_id not in insync:
                for s in insync:  # the up-to-date copies are on shards down or catching up
                    waiting[s].add(inode.ino)
            # else: it holds every acknowledged update, or every holder lost it (fsck names it;
            # the head, if one is up, holds no up-to-date copy to give)
            done_bytes += layout.chunk_size
            progress(done_bytes, total_bytes, n, len(todo))
        if adopted:
            log.warning("shard %d: %d chunks whose in-sync replicas are gone took this shard's copy (--force-from):"
                        " the updates it missed are lost", shard_id, adopted)
        if waiting:
            raise await self._waiting_error(shard_id, waiting)
        if not await self.meta.mark_synced(shard_id, view):
            raise ShardUnavailable(f"the shard map changed while shard {shard_id} was resynced", "run it again")
        await self.view.refresh()
        return copied

    async def _waiting_error(self, shard_id: int, waiting: dict[int, set[int]]) -> _ChunksWaiting:
        """The error of a resync whose chunks wait for their in-sync replicas (``waiting``: in-sync
        shard -> files), naming the shards, a few files and the fix."""
        files = sorted(set().union(*waiting.values()))
        names = [await self.meta.path_of(ino) or f"inode {ino}" for ino in files[:3]]
        more = f" and {len(files) - 3} more" if len(files) > 3 else ""
        who = ", ".join(map(str, sorted(waiting)))
        return _ChunksWaiting(
            dict(waiting),
            f"shard {shard_id} stays catching up: shards {who} hold the only up-to-date copies of chunks of"
            f" {', '.join(names)}{more}, and are down or catching up",
            f"restart shards {who} (`irdma up`); if their data is gone for good, `irdma shard resync"
            f" --force-from {shard_id}` takes shard {shard_id}'s copies and loses the updates they missed")

    async def _fence(self, view: int, skip: int | None = None) -> None:
        """Make every shard up in this view refuse updates of older views from now on (a
        CHECKSUM naming ``view`` of file 0, which never exists)."""
        async with open_nursery() as nursery:
            for sid in [s for s, r in self.view.shard_map.items()
                        if s != skip and self.view.in_view(s) and r.state not in ("drained", "removed")]:
                nursery.start_soon(self.pool.call, sid, ShardConnection.checksum, 0, 0, view)

    async def drain_shard(self, shard_id: int, progress: MoveProgress | None = None) -> int:
        """Move every chunk off a shard while updates go on, then take it out of every chain
        (``irdma shard drain``; safe to run again after a failure: it resumes).

        The shard map marks it *draining* with the shards in service as its targets; from that
        view on, each chain that holds it gains a target as its tail (it takes every update;
        :func:`irdma.placement.substitute`). Every shard is fenced at that view, so no update of an
        older view lands anywhere after. Then each chunk it holds, or that the chunk map records
        on it, is compared (version and CRC-32) between the target and its predecessor in the
        chain and, where they differ, the predecessor sends its copy (RESYNC) on the same ordered
        link that carries the chain's updates, so the copy is never overtaken by an update it
        lacks. Once all are copied the shard is marked *drained* (its replicas leave the chunk
        map; the epoch moves on again, fencing the old chains) and its copies are freed.

        Returns:
            Bytes copied.

        Raises:
            InvalidArgument: the shard cannot be drained (see :meth:`irdma.meta.MetaStore.drain_shard`).
            ShardUnavailable: a shard needed failed, or a chain has a shard catching up; run it again.
            DataLost: a chunk recorded on the shard is on no shard that answers.
        """
        await self.meta.drain_shard(shard_id)
        return await self.run_move(progress)

    async def rebalance(self, progress: MoveProgress | None = None, tolerance: float = 0.1) -> list[tuple[int, int, int]]:
        """Even out the bytes the shards in service hold (``irdma rebalance``): every shard that
        holds more than ``1 + tolerance`` times the mean moves the excess share of its chunks to
        the shards under the mean, one move at a time (as :meth:`drain_shard` does, with
        updates going on). A move in progress (a failed rebalance) is finished first.

        Returns:
            ``(shard moved from, bytes copied, chunks moved)`` of each move made.

        Raises:
            ShardUnavailable: a shard in service does not answer, or one needed failed; run it again.
        """
        done: list[tuple[int, int, int]] = []
        await self.view.refresh()
        if any(not m.done for m in self.view.moves):
            m = next(m for m in self.view.moves if not m.done)
            done.append((m.shard_id, await self.run_move(progress), 0))
        stats = [(rec, st) for rec, st, _ in await self.shard_stats() if rec.state == "up"]
        if any(st is None for _, st in stats):
            raise ShardUnavailable("a shard in service does not answer: rebalance needs them all",
                                   "`irdma shard list` names it; restart it first")
        used = {rec.shard_id: cast(StatReply, st).used for rec, st in stats}
        if len(used) < 2:
            return done
        mean = sum(used.values()) / len(used)
        over = sorted((s for s in used if used[s] > mean * (1 + tolerance)), key=lambda s: -used[s])
        for sid in over:
            under = {s: mean - used[s] for s in used if used[s] < mean}
            if not under:
                break
            # targets weighted by how far under the mean they are (a shard listed k times takes
            # about k shares of what moves)
            unit = min(under.values())
            targets = [s for s in sorted(under) for _ in range(max(1, min(8, round(under[s] / unit))))]
            share = max(1, min(MOVE_ALL, int(MOVE_ALL * (used[sid] - mean) / used[sid])))
            await self.meta.begin_move(sid, targets, share)
            copied = await self.run_move(progress)
            done.append((sid, copied, 0))
            moved = used[sid] - mean
            used[sid] = int(mean)
            for s in under:
                used[s] += int(moved * under[s] / sum(under.values()))
        return done

    async def run_move(self, progress: MoveProgress | None = None) -> int:
        """Carry out the move of chunks in progress in the shard map (see :meth:`drain_shard`):
        fence every shard at its epoch, copy each moving chunk to its target, mark the move
        done, and free the moved copies on the shard they left. Returns bytes copied.

        ``progress`` (:data:`MoveProgress`) is called with 0 done first, then after each chunk."""
        progress = progress or _no_progress
        await self.view.refresh()
        move = next((m for m in self.view.moves if not m.done), None)
        if move is None:
            return 0
        shard_id = move.shard_id
        await self.shard_stats()  # shards back after being down are found (syncing) ...
        await self.resync_all()  # ... and brought level first: a move copies from its chains
        view = self.view.epoch
        await self._fence(view)
        syncing = [s for s, r in self.view.shard_map.items()
                   if r.health == "syncing" and r.state not in ("drained", "removed")]
        if syncing:
            raise ShardUnavailable(f"shards {syncing} are catching up: moving chunks waits for them",
                                   "run `irdma shard resync`, then this again")
        # what to copy: every written chunk of a file that may have one on the shard, and every
        # chunk the shard holds (it may hold one not yet recorded)
        files = {inode.ino: (inode, idxs)
                 for inode, idxs in await self.meta.replicated_chunks(self.view.feeding(shard_id), 1)}
        wanted = {(ino, idx) for ino, (_, idxs) in files.items() for idx in idxs}
        if self.view.current(shard_id):
            async for page in self.list_chunks(shard_id):
                wanted.update((e.file_id, e.chunk_index) for e in page if e.file_id in files)
        todo = []
        for ino, idx in sorted(wanted):
            chain, joining = self.view.placed(layout_of(files[ino][0]), idx)
            if shard_id in chain and joining is not None:
                todo.append((files[ino][0], idx, joining))
            elif shard_id in chain and move.share >= MOVE_ALL:
                await self.meta.cancel_move(move.seq)  # nothing was copied yet: back as it was
                await self.view.refresh()
                raise InvalidArgument(f"chunk {idx} of file {ino} has a replica on every shard in service:"
                                      f" shard {shard_id} cannot be drained (the drain was cancelled)",
                                      "add a shard first (`irdma shard add`), then drain again")
        total_bytes = sum(layout_of(inode).chunk_size for inode, _, _ in todo)
        progress(0, total_bytes, 0, len(todo))
        copied = [0, 0, 0]  # bytes copied, chunks done, bytes of the chunks done
        incs: dict[int, int] = {}
        limit = trio.Semaphore(MOVE_COPIES)

        async def one(group: list[tuple[Inode, int, int]]) -> None:
            async with limit:
                for inode, idx, target in group:
                    n = await self._copy_to_joining(inode, idx, target, view, incs)
                    copied[0] += n  # (not `+= await`: that reads the total before the await)
                    copied[1] += 1
                    copied[2] += layout_of(inode).chunk_size
                    progress(copied[2], total_bytes, copied[1], len(todo))

        # a file's snapshots and clones are placed as it is and share its chunks' extents: the
        # chunks placed alike are copied one after the other, so the target has the first copy
        # when the next one comes and shares its extent (Shard.replace) instead of taking one more
        groups: dict[tuple[int, int, int], list[tuple[Inode, int, int]]] = {}
        for inode, idx, target in todo:
            groups.setdefault((layout_of(inode).placed_as, idx, target), []).append((inode, idx, target))
        async with open_nursery() as nursery:
            for group in groups.values():
                nursery.start_soon(one, group)
        moved = [(inode.ino, idx) for inode, idx, _ in todo]
        async with open_nursery() as nursery:  # the copies are durable before the originals go
            for target in {t for _, _, t in todo}:
                nursery.start_soon(self.pool.call, target, ShardConnection.sync)
        if not await self.meta.finish_move(move.seq, view, moved):
            raise ShardUnavailable(f"the shard map changed while chunks of shard {shard_id} moved", "run it again")
        await self.view.refresh()
        await self._fence(self.view.epoch)
        if self.view.current(shard_id):  # its moved copies are in no chain now: free them
            # the source first refuses updates of the move's view (it is in no chain of the new
            # one, so _fence skipped it): a client that has not seen the new view is told to
            # read the shard map again instead of writing to a copy about to go
            await self.pool.call(shard_id, ShardConnection.checksum, 0, 0, self.view.epoch)
            async with open_nursery() as nursery:
                if move.share >= MOVE_ALL:
                    for ino in sorted({e.file_id async for page in self.list_chunks(shard_id) for e in page}):
                        nursery.start_soon(self.pool.call, shard_id, ShardConnection.free, ino, 0)
                else:
                    for ino, idx in moved:
                        nursery.start_soon(self.pool.call, shard_id, ShardConnection.punch, ino, idx, 0)
        return copied[0]

    async def _copy_to_joining(self, inode: Inode, idx: int, target: int, view: int, incs: dict[int, int]) -> int:
        """Bring a drain's target level with its predecessor in the chunk's chain (see
        :meth:`drain_shard`) and record its replica; returns the bytes copied."""
        layout = layout_of(inode)
        chain = self.view.chain_of(layout, idx)
        if target not in chain:
            raise ShardUnavailable(f"shard {target}, where chunk {idx} of file {inode.ino} moves, is down",
                                   "restart it (`irdma up`), then run the drain again")
        pos = chain.index(target)
        if pos == 0:
            raise DataLost(f"chunk {idx} of file {inode.ino}: no replica but its new one answers")
        pred = chain[pos - 1]
        mine = await self.pool.call(target, ShardConnection.checksum, inode.ino, idx, view)
        theirs = await self.pool.call(pred, ShardConnection.checksum, inode.ino, idx, view)
        copied = 0
        if theirs[0] and mine != theirs:
            try:
                await self.pool.call(pred, ShardConnection.resync, inode.ino, idx, layout.chunk_size,
                                             self.view.chain(0, (target,)))
            except DataLost:
                pass  # freed meanwhile (truncated or removed): nothing to copy
            else:
                copied = layout.chunk_size
        if theirs[0]:
            if target not in incs:
                incs[target] = await self.pool.incarnation(target)
            await self.meta.note_replica(inode.ino, idx, target, incs[target], view)
        return copied

    async def remove_shard(self, shard_id: int, force: bool = False) -> list[tuple[int, int]]:
        """Take a drained shard out of the cluster (``irdma shard remove``); with ``force`` one in
        any state, declaring the chunks only it held lost (they read as EIO, never zeros) and
        copying the others to the chains' new members from their surviving replicas.

        Returns:
            ``(ino, chunk index)`` of the chunks lost with it.

        Raises:
            InvalidArgument: not drained and not ``force``; NotFound: no such shard.
        """
        await self.view.refresh()
        rec = self.view.shard_map.get(shard_id)
        lost = await self.meta.remove_shard(shard_id, force)
        address = rec.address if rec is not None and rec.state == "drained" else None
        if address is not None:  # what a drained shard still holds (copies it kept while down) is in no chain
            # (a forced removal leaves the shard's bytes alone: they are the only copy of what was lost)
            with contextlib.suppress(IrdmaError), trio.move_on_after(self.view.timeout):
                async with open_nursery() as nursery:
                    keys = self.pool.keys
                    conn = await self.pool.transport.connect(address, nursery, client_name=self.pool.name,
                                                               key=keys.ring() if keys is not None else None,
                                                               timeout=self.view.timeout)
                    try:
                        after = (0, 0)
                        while page := await conn.list_chunks(*after):
                            for ino in sorted({e.file_id for e in page}):
                                await conn.free(ino, 0)
                            after = (page[-1].file_id, page[-1].chunk_index)
                    finally:
                        await conn.aclose()
        await self.view.refresh()
        await self._fence(self.view.epoch)
        for sid, rec in sorted(self.view.shard_map.items()):
            if force and rec.state == "up" and self.view.current(sid):
                await self._re_replicate(sid)
        return lost

    async def _re_replicate(self, shard_id: int) -> None:
        """Copy to ``shard_id`` the written chunks it is a replica of and lacks (after a forced
        removal gave it chunks it never had), from the head of each chain."""
        files = await self.meta.replicated_chunks(self.view.feeding(shard_id), 2)
        inc = await self.pool.incarnation(shard_id)
        for inode, idxs in files:
            layout = layout_of(inode)
            for idx in idxs:
                chain = self.view.chain_of(layout, idx)
                if shard_id not in chain[1:]:
                    continue
                mine = await self.pool.call(shard_id, ShardConnection.checksum, inode.ino, idx, self.view.epoch)
                theirs = await self.pool.call(chain[0], ShardConnection.checksum, inode.ino, idx, self.view.epoch)
                if theirs[0] and mine != theirs:
                    with contextlib.suppress(DataLost):
                        await self.pool.call(chain[0], ShardConnection.resync, inode.ino, idx, layout.chunk_size,
                                                     self.view.chain(0, chain[1:]))
                        await self.meta.note_replica(inode.ino, idx, shard_id, inc, self.view.epoch)

    async def resync_all(self, log_progress: Callable[[str], None] = log.info) -> None:
        """Resync every reachable shard that is catching up (what a mount's heartbeat does),
        in passes while a pass brings one up (a shard whose chunks wait for another one catching
        up follows it); each reason a shard stays behind is logged once."""
        await self.view.refresh()
        for _ in range(len(self.view.shard_map) + 1):
            progressed = False
            for sid, rec in sorted(self.view.shard_map.items()):
                if rec.health != "syncing":
                    continue
                try:
                    t0 = time.monotonic()
                    copied = await self.resync_shard(sid)
                    log_progress(f"shard {sid} is up to date again: {copied} bytes copied in {time.monotonic() - t0:.1f} s")
                    self._resync_said.pop(sid, None)
                    progressed = True
                except IrdmaError as exc:
                    if self._resync_said.get(sid) != str(exc):
                        self._resync_said[sid] = str(exc)
                        log.warning("resync of shard %d did not finish (retried at the next heartbeat): %s", sid, exc)
            if not progressed:
                return
            await self.view.refresh()

    async def shard_stats(self) -> list[tuple[ShardRecord, StatReply | None, str]]:
        """Every registered shard with its STAT reply, or None and the reason it failed.

        Connecting checks each shard's incarnation (see :meth:`irdma.Client.connection`); the records
        returned are read after that, so they carry what was found.
        """
        await self.view.refresh()
        out: dict[int, tuple[ShardRecord, StatReply | None, str]] = {}

        async def one(rec: ShardRecord) -> None:
            try:
                st = await self.pool.call(rec.shard_id, ShardConnection.stat, probe=True)
                out[rec.shard_id] = (rec, st, "")
                await self.view.note_health(rec.shard_id, "up")  # back after being down: syncing
            except ShardUnavailable as exc:
                out[rec.shard_id] = (rec, None, str(exc))

        async with open_nursery() as nursery:
            for rec in list(self.view.shard_map.values()):
                if rec.state == "removed":
                    out[rec.shard_id] = (rec, None, "removed")
                else:
                    nursery.start_soon(one, rec)
        await self.view.refresh()
        fresh = self.view.shard_map
        return [(fresh.get(k, out[k][0]), out[k][1], out[k][2]) for k in sorted(out)]

    async def list_chunks(self, shard_id: int) -> AsyncIterator[list[ChunkEntry]]:
        """Every chunk a shard holds, page by page (for gc and fsck)."""
        after = (0, 0)
        while True:
            page = await self.pool.call(shard_id, ShardConnection.list_chunks, *after)
            if not page:
                return
            yield page
            after = (page[-1].file_id, page[-1].chunk_index)
