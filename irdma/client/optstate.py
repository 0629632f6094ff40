"""Optimizer state images: the state the shards keep beside each chunk of a file whose update
op is an optimizer (moments, step counts), read for a checkpoint and written back to restore it.

The *state image* of such a file is the concatenation, chunk by chunk, of each chunk's state
chunk (:mod:`irdma.server.optim`: a 4096-byte header, then one slot of ``chunk_size`` bytes per
state variable, little-endian float32, Adam's step as u32), ``ceil(size / chunk_size)`` state
chunks in all (:meth:`StateImages.state_of`). :class:`StateImages` reads it from an up-to-date
replica of each chunk and writes it down each chunk's chain with one request id, through the
client's :class:`~irdma.client.datapath.DataPath`.
"""

from __future__ import annotations

import numpy as np

from .._concurrency import open_nursery
from .._errors import BadRequest, Fenced, InvalidArgument, IrdmaError, ReplicaFailed, ShardUnavailable
from ..meta import Inode
from ..placement import Layout
from ..transport import ShardConnection
from ..wire.optimizers import HEADER, MAGIC, SLOT_NAMES, SLOTS, parse_update, state_index, state_size
from ..wire.protocol import UpdateOp
from .datapath import MAX_ATTEMPTS, ChunkMap, DataPath, as_bytes_view
from .view import layout_of, writable


class StateImages:
    """The optimizer state images of one client's files (see the module docstring).

    Args:
        data: the client's data path (its view, connections and metadata engine).
    """

    def __init__(self, data: DataPath) -> None:
        self.data = data
        self.view = data.view
        self.pool = data.pool
        self.meta = data.meta

    async def state_of(self, inode: Inode) -> tuple[Layout, UpdateOp | None, int, int]:
        """Where a file's optimizer state lives: ``(layout, op, state chunk bytes, total bytes)``.

        The *state image* of a file whose update op is an optimizer is the concatenation, chunk
        by chunk, of each chunk's state chunk (:mod:`irdma.server.optim`: a 4096-byte header,
        then one slot of ``chunk_size`` bytes per state variable, little-endian float32, Adam's
        step as u32), ``ceil(size / chunk_size)`` state chunks in all. ``op`` is None (and the
        image empty) for ``assign`` and ``add``.
        """
        layout = layout_of(inode)
        op = parse_update(inode.update_op or "assign").op
        if op not in SLOTS:
            return layout, None, 0, 0
        per = state_size(op, layout.chunk_size)
        return layout, op, per, -(-inode.size // layout.chunk_size) * per

    @staticmethod
    def _state_pieces(per: int, offset: int, length: int, most: int | None) -> list[tuple[int, int, int, int]]:
        """``(chunk index, offset in its state chunk, offset in the buffer, length)`` of each
        piece of ``[offset, offset+length)`` of a state image, none longer than ``most``."""
        out, pos = [], offset
        while pos < offset + length:
            index, within = divmod(pos, per)
            n = min(per - within, offset + length - pos, most or per)
            out.append((index, within, pos - offset, n))
            pos += n
        return out

    async def read_state_into(self, layout: Layout, per: int, offset: int, into: memoryview,
                              chunks: ChunkMap | None = None) -> None:
        """Read bytes ``[offset, offset+len(into))`` of a file's state image (:meth:`state_of`;
        ``per`` its state chunk size) from an up-to-date replica of each chunk (the last one up
        in chain order: never one catching up, nor a move's target). A chunk that has no state
        chunk on that replica (never stepped) reads as zeros, as does the part of a smaller state
        chunk made by another optimizer (its header names that one; the next step starts this
        optimizer's afresh). ``chunks``, the file's chunk map: a replica restarted on empty memory
        since it got the chunk raises DataLost instead of answering zeros.

        Raises:
            DataLost; ShardUnavailable: no up-to-date replica of a chunk answered in time.
        """
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into

        async def one(index: int, within: int, at: int, n: int) -> None:
            view = into[at : at + n]
            rec = chunks.get(index) if chunks else None
            for _ in range(len(layout.replicas_of(index)) + 1):
                _, joining = self.view.placed(layout, index)
                chain = self.view.chain_of(layout, index)  # raises when no replica is up to date
                cands = [s for s in chain if s != joining and (len(chain) == 1 or self.view.current(s))]
                if not cands:
                    break
                pick = cands[-1]
                inc = rec.get(pick) if rec is not None else None

                async def fn(conn: ShardConnection, pick: int = pick, inc: int | None = inc) -> int:
                    if inc and inc != conn.info.incarnation:
                        raise self.data.lost(layout, index, pick, "restarted with empty memory since")
                    return await conn.read(layout.file_id, state_index(index), within, view)

                try:
                    if await self.pool.run(pick, fn) == 0:
                        view[:] = bytes(n)
                    return
                except BadRequest:  # past the end of a smaller state chunk (another optimizer's)
                    view[:] = bytes(n)
                    return
                except ShardUnavailable:
                    if len(chain) == 1:
                        raise
                    await self.view.mark_down(pick)
            raise ShardUnavailable(f"no up-to-date replica of chunk {index} of file {layout.file_id} answered",
                                   "`irdma status` shows the shards; restart them with `irdma up`")

        async with open_nursery() as nursery:
            for piece in self._state_pieces(per, offset, len(into), self.data.max_piece(layout)):
                nursery.start_soon(one, *piece)

    async def write_state_from(self, layout: Layout, per: int, offset: int, data: memoryview | bytes) -> None:
        """Restore bytes ``[offset, offset+len(data))`` of a file's state image (as
        :meth:`read_state_into` gave them) on every replica of each chunk, in chain order with
        one request id (``assign`` of the state chunk: exactly once on every replica).

        Write the whole image, and the weights with the file's op set to ``assign``, before the
        next gradient: a restore applies to the chunks as they are. A state chunk is copied to a
        replica that catches up only with its data chunk (when that one's version differs).

        Raises:
            BadRequest: a range past the image; NoSpace; ShardUnavailable.
        """
        view = as_bytes_view(data)

        async def one(index: int, within: int, at: int, n: int) -> None:
            part = view[at : at + n]
            rid = self.data.request_id()
            last: IrdmaError | None = None
            for _ in range(MAX_ATTEMPTS):
                epoch = self.view.epoch
                chain = self.view.chain_of(layout, index)

                async def fn(conn: ShardConnection, chain: tuple[int, ...] = chain, epoch: int = epoch) -> None:
                    await conn.write(layout.file_id, state_index(index), per, within, UpdateOp.ASSIGN, part, False,
                                     self.view.chain(rid, chain[1:], epoch))

                try:
                    await self.view.withdraw(layout, (index,), chain, epoch)
                    await self.pool.run(chain[0], fn)
                    self.data.note_unsynced(chain, len(chain) == 1)
                    return
                except ReplicaFailed as exc:
                    last = exc
                    await self.view.mark_down(exc.shard_id)
                except Fenced as exc:
                    last = exc
                    await self.view.refresh()
                except ShardUnavailable as exc:
                    if len(chain) == 1:
                        raise
                    last = exc
                    await self.view.mark_down(chain[0])
            assert last is not None
            raise last

        async with open_nursery() as nursery:
            for piece in self._state_pieces(per, offset, len(view), self.data.max_piece(layout)):
                nursery.start_soon(one, *piece)

    async def read_state(self, path: str) -> bytes:
        """A file's whole optimizer state image (:meth:`state_of`), for a checkpoint; empty when
        its update op is not an optimizer. Raises ShardUnavailable."""
        inode = await self.meta.resolve(path)
        layout, _, per, total = await self.state_of(inode)
        buf = bytearray(total)
        if total:
            await self.read_state_into(layout, per, 0, memoryview(buf), await self.meta.chunk_map(inode.ino))
        return bytes(buf)

    async def write_state(self, path: str, image: bytes | memoryview) -> None:
        """Restore a file's optimizer state from a :meth:`read_state` image taken under the same
        optimizer and chunk size (see :meth:`write_state_from` for the order of a restore).

        Raises:
            InvalidArgument: the file's op is not an optimizer, or the image's size is not this
                file's (nothing written). NoSpace, ShardUnavailable.
        """
        inode = await self.meta.resolve(path)
        writable(inode, path)
        layout, op, per, total = await self.state_of(inode)
        if op is None or len(image) != total:
            raise InvalidArgument(f"{path}: a state image of {total} bytes restores it"
                                  f" ({'its update op is not an optimizer' if op is None else f'not {len(image)}'});"
                                  " set the optimizer it was taken under first")
        await self.write_state_from(layout, per, 0, image)

    async def optimizer_state(self, path: str) -> dict[str, np.ndarray]:
        """A file's optimizer state as arrays, one per slot, each of the file's ``size // 4``
        elements: little-endian float32, Adam's ``step`` u32 (names:
        :data:`irdma.wire.optimizers.SLOT_NAMES`, e.g. ``m``, ``v``, ``step`` for Adam, as Keras names
        its variables). Empty for ``assign`` and ``add``; zeros for a chunk never stepped or
        holding another optimizer's state. Raises ShardUnavailable, DataLost."""
        inode = await self.meta.resolve(path)
        layout, op, per, total = await self.state_of(inode)
        if op is None:
            return {}
        image = np.frombuffer(await self.read_state(path), dtype=np.uint8).reshape(-1, per).copy()
        mine = (image[:, :4] == np.frombuffer(MAGIC, np.uint8)).all(axis=1) & (image[:, 4] == int(op))
        image[~mine] = 0  # chunks never stepped, or with another optimizer's state: none of this one's yet
        cs, n = layout.chunk_size, inode.size // 4
        out = {}
        for k, name in enumerate(SLOT_NAMES[op]):
            raw = np.ascontiguousarray(image[:, HEADER + k * cs : HEADER + (k + 1) * cs]).reshape(-1)
            out[name] = raw.view("<u4" if name == "step" else "<f4")[:n].copy()
        return out
