"""A client's view of the cluster: the shard map at one epoch, where chunks are placed in it,
their replication chains, and the health this client has seen of each shard.

:class:`ShardView` is the part of the client that decides *where*: given a file's
:class:`~irdma.placement.Layout` and a chunk index it names the chunk's replicas
(:meth:`~ShardView.placed`), the chain an update goes down (:meth:`~ShardView.chain_of`) and
whether a replica may serve a read (:meth:`~ShardView.current`). It reads and writes only the
metadata engine's shard map (:class:`irdma.meta.aio.AsyncMeta`: ``shard_view``, ``shards``,
``set_shard_health``, ``note_incarnation``, ``withdraw_replicas``); it opens no connection and
knows nothing of the client above it, so chain building and failover are tested over a fake
shard map (``tests/test_shard_view.py``).

The rules it keeps:

- Every client of one view builds the same chain for a chunk: its replicas that the view has up,
  in placement order, then those catching up (``syncing``) as the tail, then a move's target
  (joining) last. Health recorded by this client changes only with the view it belongs to (a
  shard back after being down is ``syncing``, never up before it was resynced).
- A shard that failed this client is held out of reads and data calls until ``down_until``
  (trio time), one deadline later, whatever the view says.
- An update carries the epoch its chain was built in (:meth:`~ShardView.chain`), never a newer
  one; before an update that skips replicas, they leave their chunks' in-sync sets durably
  (:meth:`~ShardView.withdraw`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from .._errors import Fenced, IrdmaError, IsADirectory, ReadOnly, ShardUnavailable
from ..meta import Inode, ShardRecord
from ..meta.aio import AsyncMeta
from ..placement import Layout, Move, substitute
from ..wire.protocol import Chain

#: Chunks whose placement a view keeps (a table of 1M rows has 61; a checkpoint's files a few thousand).
PLACED_CACHE = 1 << 16

log = logging.getLogger("irdma.client")


def writable(inode: Inode, path: str) -> None:
    """Raise ReadOnly (EROFS) for a file of a snapshot, before anything is sent."""
    if inode.snap:
        raise ReadOnly(f"{path} is in a snapshot, which is read-only", "write to the live file instead")


def layout_of(inode: Inode) -> Layout:
    """The placement of a file's chunks."""
    if inode.is_dir:
        raise IsADirectory(f"inode {inode.ino} is a directory")
    assert inode.chunk_size is not None
    return Layout(inode.ino, inode.chunk_size, inode.stripe, inode.replicas, inode.place)


class ShardView:
    """The shard map one client acts on, and the chains it builds over it.

    Args:
        meta: the metadata engine (awaitable) holding the shard map.
        timeout: seconds each request to a shard may take (the deadline chains carry, and how
            long a failed shard is held out).

    Attributes:
        shard_map: shard id -> its record, as last read (incarnations updated at connect).
        epoch: the shard map's epoch this client acts on (sent with every update).
        moves: the view's moves of chunks between shards, oldest first.
        health: shard id -> the health this client last saw recorded.
        down_until: shard id -> trio time until which it is held out (it failed a request).
    """

    def __init__(self, meta: AsyncMeta, timeout: float) -> None:
        self.meta = meta
        self.timeout = timeout
        self.shard_map: dict[int, ShardRecord] = {}
        self.epoch = 0
        self.moves: list[Move] = []
        self._placed: dict[tuple[int, tuple[int, ...], int, int], tuple[tuple[int, ...], int | None]] = {}
        self.health: dict[int, str] = {}
        self.down_until: dict[int, float] = {}
        # replicas this client took out of their chunks' in-sync sets in this view:
        # (file id, chunk index, shard id); forgotten when the view changes
        self._withdrawn: set[tuple[int, int, int]] = set()
        self._withdrawn_view = -1

    # ------------------------------------------------------------ the shard map
    async def refresh(self) -> None:
        """Read the shard map and its epoch again (the view requests carry)."""
        self.epoch, records, self.moves = await self.meta.shard_view()
        self._placed.clear()
        self.shard_map = {r.shard_id: r for r in records}
        for r in records:
            if r.health == "up" and self.health.get(r.shard_id) in ("down", "syncing"):
                # back and resynced since this client saw it fail (a restart that `irdma up`
                # or another mount resynced): its old deadline no longer holds it out
                self.down_until.pop(r.shard_id, None)
            self.health[r.shard_id] = r.health

    async def note_health(self, shard_id: int, health: str) -> None:
        """Record a shard's health in the shard map when it changes (best effort)."""
        if self.health.get(shard_id) == health:
            return
        # the health the chains are built from changes only with the view it belongs to: a shard
        # back after being down is ``syncing`` (the tail of its chains), never up before resynced
        try:
            recorded, epoch = await self.meta.set_shard_health(shard_id, health)
        except IrdmaError as exc:
            log.warning("cannot record shard %d as %s: %s", shard_id, health, exc)
            return
        if epoch != self.epoch:  # chains changed (here or elsewhere): act on the new view
            await self.refresh()
        else:
            self.health[shard_id] = recorded

    async def mark_down(self, shard_id: int) -> None:
        """A replica failed: held out for a deadline and out of the chains (the shard map's
        epoch moves on)."""
        self.down_until[shard_id] = trio.current_time() + self.timeout
        await self.note_health(shard_id, "down")

    def where(self, shard_id: int) -> str:
        """``shard N at ADDRESS`` (the address when the shard map has it), for messages."""
        rec = self.shard_map.get(shard_id)
        return f"shard {shard_id}" + (f" at {rec.address}" if rec else "")

    # ------------------------------------------------------------ placement
    def placed(self, layout: Layout, index: int) -> tuple[tuple[int, ...], int | None]:
        """A chunk's replicas in this view, head first, and the one joining them
        (the target of a move in progress: the tail, never read) or None
        (:func:`irdma.placement.substitute`)."""
        key = (layout.placed_as, layout.stripe, layout.replicas, index)
        hit = self._placed.get(key)
        if hit is None:  # a pure function of the layout, the chunk and the moves: kept until the map is read again
            hit = substitute(layout.replicas_of(index), self.moves, layout.placed_as + index, file_id=layout.placed_as)
            if len(self._placed) >= PLACED_CACHE:
                self._placed.clear()
            self._placed[key] = hit
        return hit

    def shards_of(self, layout: Layout) -> set[int]:
        """Every shard that may hold a chunk of the file: its stripe and where moves took them,
        less the shards drained or removed since (a finished drain freed their copies; one that
        a rebalance once fed and was then drained holds nothing either)."""
        out = set(layout.stripe)
        for m in self.moves:
            if m.shard_id in out:
                out.update(m.targets)
        gone = {s for s in out if (rec := self.shard_map.get(s)) is not None and rec.state in ("drained", "removed")}
        return out - gone

    def feeding(self, shard_id: int) -> list[int]:
        """``shard_id`` and every shard whose chunks moves may have taken to it (so files
        striped over any of them may have a chunk there)."""
        out = {shard_id}
        while True:
            more = {m.shard_id for m in self.moves if out & set(m.targets)} - out
            if not more:
                return sorted(out)
            out |= more

    # ------------------------------------------------------------ health and chains
    def in_view(self, shard_id: int) -> bool:
        """Whether this view has the shard up to date (neither down nor catching up): what a
        chain is built from, so every client of one view builds the same."""
        rec = self.shard_map.get(shard_id)
        return self.health.get(shard_id, rec.health if rec else "unknown") not in ("down", "syncing")

    def current(self, shard_id: int) -> bool:
        """Whether a shard may serve a read: up to date in the view, and it has not failed this
        client in the last deadline."""
        return self.in_view(shard_id) and trio.current_time() >= self.down_until.get(shard_id, 0.0)

    def chain_of(self, layout: Layout, index: int) -> tuple[int, ...]:
        """The replicas a chunk's updates go through now, head first: its replicas that are up,
        in placement order, then those catching up (syncing) as the tail. A file with one
        replica always uses it.

        Raises:
            ShardUnavailable: no replica of the chunk is up to date.
        """
        reps, joining = self.placed(layout, index)
        if len(reps) == 1:
            return reps
        up = [s for s in reps if s != joining and self.in_view(s)]
        if not up:
            raise ShardUnavailable(
                f"no up-to-date replica of chunk {index} of file {layout.file_id}: shards"
                f" {', '.join(map(str, reps))} are down or catching up",
                "restart the shards (`irdma up`); `irdma status` shows them",
            )
        syncing = [s for s in reps if s not in up and s != joining and self.health.get(s) == "syncing"]
        tail = [joining] if joining is not None and self.health.get(joining) not in ("down",) else []
        return tuple(up + syncing + tail)

    def chain(self, request_id: int, successors: Sequence[int], view: int | None = None) -> Chain:
        """The chain message of an update: ``view`` is the epoch its chain was built in (default
        this view's now); an update must carry the view of its chain, never a newer one, or a
        shard fenced at the newer view would take an update that skipped a replica resynced
        meanwhile."""
        return Chain(request_id, self.epoch if view is None else view, 0, max(1, int(self.timeout * 500)),
                     tuple((s, self.shard_map[s].address) for s in successors))

    async def withdraw(self, layout: Layout, indices: Sequence[int], chain: Sequence[int], view: int) -> None:
        """Before an update of chunks ``indices`` is sent down ``chain``: take the chunks'
        replicas that the chain skips (their shards are down) out of the chunks' in-sync sets
        in the chunk map (:meth:`MetaStore.withdraw_replicas`), durably, so that recovery never
        counts a copy that missed an acknowledged update as current. Once per replica and view;
        nothing to do when the chain has every replica.

        Raises:
            Fenced: the shard map moved on since this view (read it again, then build the chain
                again: the shard may be back); nothing recorded.
            IrdmaError: the metadata engine failed (the update must not be sent).
        """
        if layout.replicas == 1:
            return
        if self._withdrawn_view != view:
            self._withdrawn.clear()
            self._withdrawn_view = view
        todo: list[tuple[int, int]] = []
        for index in indices:
            reps, _ = self.placed(layout, index)
            if len(chain) >= len(reps):
                continue
            todo += [(index, s) for s in reps
                     if s not in chain and (layout.file_id, index, s) not in self._withdrawn]
        if todo:
            if not await self.meta.withdraw_replicas(layout.file_id, todo, view):
                raise Fenced(f"the shard map moved on from view {view} before an update that skips shards"
                             f" {sorted({s for _, s in todo})}", "read the shard map again")
            self._withdrawn.update((layout.file_id, index, s) for index, s in todo)
