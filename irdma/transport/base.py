"""The one interface every transport implements (TCP today, RDMA verbs beside it).

A :class:`ShardConnection` is one client's link to one shard. Every method may be called
concurrently from many trio tasks; the transport keeps several requests in flight and
answers each in the order the shard applied it. Requests sent on one connection are applied
by the shard in the order they were sent.

Cancellation (trio's rule): a call cancelled before its request left had no effect; a call
cancelled once its request may be partly sent, or while its reply is being received into the
caller's buffer, declares the connection broken and closes it, so no byte lands in the
caller's buffer after the call returned and no half frame is ever followed by another. A
broken connection fails every later call with ShardUnavailable; the client reconnects.

A transport implements the data path (:meth:`~ShardConnection.read`, ``write``, ``gather``,
``scatter``: requests that carry bulk bytes) and one typed request method,
:meth:`~ShardConnection.call` (a message of :mod:`irdma.wire.protocol` in, its reply out); the
control methods (``stat``, ``free``, ``checksum``, the snapshot requests...) are written once,
here, over ``call``. A transport with more to do for one request (verbs drops cached chunk
places on FREE and PUNCH) does it in its ``call``.

The interface follows ps-lite's ``Van`` (transports behind one interface chosen by name).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import trio

from irdma.wire import protocol as P
from irdma.wire.auth import KeyRing
from irdma.wire.protocol import Call, Chain, ChunkEntry, FreezeReply, StatReply, Update, UpdateOp

_R = TypeVar("_R")


@dataclass(frozen=True)
class ShardInfo:
    """What a shard said of itself in the handshake."""

    shard_id: int
    capacity: int  # bytes
    max_payload: int  # largest READ/WRITE payload, bytes
    incarnation: int = 0  # random id made with the shard's memory: changes when the shard lost it
    version: int = 0  # the protocol version its HELLO reply named (0: not known)


class ShardConnection(abc.ABC):
    """A client's connection to one shard. Close it with :meth:`aclose` (safe twice)."""

    info: ShardInfo
    address: str
    #: Reads are one-sided (RDMA READ): the shard cannot answer DIRTY, so a replicated chunk is
    #: read from its chain's tail.
    one_sided_reads: bool = False

    @abc.abstractmethod
    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview, clean: bool = False) -> int:
        """Fill ``into`` with bytes ``[offset, offset+len(into))`` of a chunk (a pull).

        A chunk that does not exist reads as zeros. ``clean``: a replica with an update of the
        chunk not yet acknowledged by the rest of its chain raises Dirty instead (CRAQ).

        Returns:
            The chunk's version (0 for a hole).

        Raises:
            BadRequest: the range leaves the chunk.
            ShardUnavailable: the connection failed.
        """

    @abc.abstractmethod
    async def write(
        self,
        file_id: int,
        chunk_index: int,
        chunk_size: int,
        offset: int,
        op: UpdateOp | Update,
        data: memoryview | bytes,
        existing: bool = False,
        chain: Chain | None = None,
    ) -> int:
        """Apply update op ``op`` with ``data`` at ``offset`` of a chunk (a push).

        ``existing``: the chunk must already exist (the metadata records it as written); a
        missing one raises DataLost and is not created. ``chain``: this shard is the head of the
        chunk's replication chain; the call returns once every successor applied the update
        (see :class:`irdma.wire.protocol.Chain`).

        Returns:
            The chunk's version after the update.

        Raises:
            BadRequest: refused, nothing changed. NoSpace: the shard is full, nothing changed.
            DataLost: ``existing`` and the chunk is gone, nothing changed.
            ShardUnavailable: the connection failed; the update may or may not have applied.
            ReplicaFailed: applied here, a successor failed (retry with the same request id).
            Fenced: the chain's view is older than one the shard has seen.
        """

    async def gather(self, file_id: int, extents: np.ndarray, clean: bool = False) -> tuple[np.ndarray, memoryview]:
        """Pull the bytes of ``extents`` (:data:`irdma.wire.protocol.EXTENT` records, each inside one
        chunk): a sparse pull in one request (TCP) or in batches of RDMA READs (verbs). A
        missing chunk reads as zeros. ``clean``: as :meth:`read`.

        Returns:
            ``(versions, data)``: per extent its chunk's version as uint64, 0 for a hole
            (one-sided transports answer only 0 or non-zero), and the extents' bytes one after
            the other, in a buffer the caller owns.

        Raises:
            BadRequest: an extent leaves its chunk, or the request exceeds the payload limit
                (the extents' bytes plus 24 bytes per extent must fit ``info.max_payload``).
            Dirty: ``clean`` and a chunk has an update in flight. ShardUnavailable.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot gather")

    async def scatter(self, file_id: int, chunk_size: int, extents: np.ndarray, op: UpdateOp | Update,
                      data: memoryview | bytes, existing: bool = False, chain: Chain | None = None) -> int:
        """Apply update op ``op`` with ``data`` (the extents' bytes one after the other) to
        ``extents`` of a file: a sparse push. Each chunk's extents are applied atomically with
        one version bump; extents of one chunk must not overlap. ``existing`` and ``chain`` as
        :meth:`write` (a chained scatter is applied once per request id and chunk).

        Returns:
            The highest chunk version reached.

        Raises:
            As :meth:`write`; BadRequest also for overlapping extents.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot scatter")

    @abc.abstractmethod
    async def call(self, request: Call[_R]) -> _R:
        """Send one control request (a message of :mod:`irdma.wire.protocol`: ``Stat()``,
        ``Free(...)``...) and return its OK reply, of the class its ``decode_reply`` names
        (:func:`irdma.wire.protocol.reply_kind`). The one request method a transport implements
        beside the data path (:meth:`read`, :meth:`write`, :meth:`gather`, :meth:`scatter`, whose
        requests carry bulk bytes); the methods below build their request, call it and unpack
        its reply.

        Raises:
            IrdmaError: the shard answered an error status: its exception (BadRequest, Fenced...;
                the table of :func:`irdma.wire.protocol.raise_for_error`).
            UnexpectedReply: the shard answered with another kind of reply; the connection is
                broken (a shard that mixes up replies is not trusted with the next one).
            ShardUnavailable: the connection failed.
        """

    async def resync(self, file_id: int, chunk_index: int, chunk_size: int, chain: Chain) -> int:
        """Send this shard's copy of a chunk down ``chain`` (ordered after every update it
        applied); returns its version. Raises as :meth:`write`."""
        return (await self.call(P.Resync(file_id, chunk_index, chunk_size, chain))).version

    async def checksum(self, file_id: int, chunk_index: int, view: int = 0) -> tuple[int, int]:
        """``(version, CRC-32)`` of a chunk's bytes; ``(0, 0)`` when the shard has no such chunk.
        ``view`` (a shard-map epoch, 0 for none) is fenced as a chained update's is: raises
        Fenced when the shard has seen a newer one."""
        reply = await self.call(P.Checksum(file_id, chunk_index, view))
        return reply.version, reply.crc

    async def stat(self) -> StatReply:
        """The shard's capacity, bytes used and chunk count."""
        return await self.call(P.Stat())

    async def free(self, file_id: int, first_chunk: int) -> int:
        """Free every chunk of ``file_id`` from index ``first_chunk`` on; returns how many."""
        return (await self.call(P.Free(file_id, first_chunk))).freed

    async def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        """Zero a chunk from ``offset`` to its end; returns its version."""
        return (await self.call(P.Punch(file_id, chunk_index, offset))).version

    async def sync(self) -> None:
        """Return once every update this shard applied before the call is durable."""
        await self.call(P.Sync())

    async def freeze(self, token: int, lease_ms: int, file_ids: Sequence[int]) -> FreezeReply:
        """Hold client updates to ``file_ids`` on this shard (a snapshot's first phase:
        :class:`irdma.wire.protocol.Freeze`); returns every chunk of them with its version, and
        the push parts applied of late."""
        return await self.call(P.Freeze(token, lease_ms, tuple(file_ids)))

    async def admit(self, token: int, push_ids: Sequence[int], wait_ms: int = 0) -> FreezeReply:
        """Take pushes ``push_ids`` whole into freeze ``token``'s cut (:class:`irdma.wire.protocol.Admit`)."""
        return await self.call(P.Admit(token, wait_ms, tuple(push_ids)))

    async def clone(self, token: int, pairs: Sequence[tuple[int, int]],
                    expect: Sequence[tuple[int, int, int]]) -> int:
        """Clone each ``(source, clone)`` file at the cut's versions and end freeze ``token``
        (:class:`irdma.wire.protocol.Clone`); returns the chunk keys made."""
        return (await self.call(P.Clone(token, tuple(pairs), tuple(expect)))).freed

    async def usage(self, file_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(file id, bytes held alone, bytes shared)`` per file on this shard (:class:`irdma.wire.protocol.Usage`)."""
        return (await self.call(P.Usage(tuple(file_ids)))).entries

    async def free_files(self, file_ids: Sequence[int]) -> int:
        """Free every chunk of each of ``file_ids`` (:class:`irdma.wire.protocol.FreeFiles`); returns how many."""
        return (await self.call(P.FreeFiles(tuple(file_ids)))).freed

    async def thaw(self, token: int) -> None:
        """End freeze ``token`` without cloning."""
        await self.call(P.Thaw(token))

    async def list_chunks(self, after_file: int = 0, after_chunk: int = 0) -> list[ChunkEntry]:
        """One page of the shard's chunks after ``(after_file, after_chunk)``, in order (for gc
        and fsck); an empty list at the end."""
        return (await self.call(P.List(after_file, after_chunk))).entries

    @property
    def broken(self) -> bool:
        """True once the connection failed or was declared broken: open a new one."""
        return False

    def forget_file(self, file_id: int) -> None:
        """Drop anything cached about ``file_id`` (one-sided transports cache chunk places)."""
        return None  # noqa: B027 - optional hook, nothing cached by default

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the connection; pending calls fail with ShardUnavailable."""


class Transport(abc.ABC):
    """A way to reach shards. ``name`` is what ``--transport`` accepts."""

    name: str

    @abc.abstractmethod
    async def connect(
        self, address: str, nursery: trio.Nursery, *, client_name: str = "", key: KeyRing | None = None,
        timeout: float = 10.0,
    ) -> ShardConnection:
        """Open a connection to the shard at ``address`` and do the handshake, within ``timeout``
        seconds: with ``key``, the mutual authentication of :mod:`irdma.wire.auth`.

        Background tasks of the connection (its reply reader) run in ``nursery``.

        Raises:
            ShardUnavailable: nobody answers there, or the handshake failed.
            AuthFailed: the shard refused our key, or did not prove it holds it.
        """
