"""Chain replication (protocol 3): the :class:`Chain` an update carries, the :class:`Part` of a
push it may be (protocol 9), and RESYNC.

A WRITE, REMOTE_WRITE or SCATTER with FLAG_CHAIN carries a chain after its fixed part (and
its optimizer arguments): ``!QQQIB3x`` (request id, shard-map epoch, expected version, forward
deadline in ms, successor count), then per successor ``!IH`` (shard id, address length) and
the UTF-8 ``HOST:PORT``. With FLAG_PART a ``!QII`` part (push id, index, count) follows the
chain. See :mod:`irdma.server.replicate`.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import ClassVar

from ..._errors import RemoteProtocolError
from ._core import FLAG_CHAIN, FLAG_PART, Opcode, VersionReply, _exact, _need, _Parts

_PART = struct.Struct("!QII")  # push id, part index, part count
_CHAIN = struct.Struct("!QQQIB3x")  # request id, view, expect version, forward timeout (ms), successor count
_PEER = struct.Struct("!IH")  # shard id, address length; the UTF-8 address follows
_RESYNC = struct.Struct("!QQI")  # file id, chunk index, chunk size


@dataclass(frozen=True)
class Part:
    """The part a request is of a push that takes several (FLAG_PART; protocol 9): a client
    cuts a push into one update per chunk piece (or one SCATTER per shard), and tags each with
    the push's id, its own index and how many there are, so a snapshot's cut can take the
    whole push or none of it (:mod:`irdma.client.snapshots`).

    Attributes:
        push_id: u64, random, chosen by the client per push (never 0).
        index: u32, this request's place among the push's parts, ``0 <= index < count``.
        count: u32, how many requests the push was cut into (at least 2).
    """

    push_id: int
    index: int
    count: int

    def encode(self) -> bytes:
        """``!QII``: push id, index, count."""
        return _PART.pack(self.push_id, self.index, self.count)

    @classmethod
    def decode(cls, body: memoryview, at: int) -> Part:
        """The part at ``body[at:]`` (its length checked by the caller), not validated."""
        return cls(*_PART.unpack_from(body, at))


@dataclass
class Chain:
    """Chain replication of one update (CRAQ: Terrace & Freedman, USENIX ATC 2009; chain
    replication: van Renesse & Schneider, OSDI 2004).

    The client sends an update to the chunk's head replica with the rest of the chain as
    ``successors``; each replica applies it, then forwards it to the next with ``expect`` set to
    the version it reached, and answers once the rest of the chain answered. ``request_id``
    (client-chosen, unique, never 0) makes a retried request apply once: a replica that already
    applied it answers the version it reached and still forwards it along the (possibly new)
    chain. ``view`` is the shard map epoch the sender acts on: a replica refuses (FENCED) a view
    older than one it has seen, so a demoted head cannot overwrite the new chain.

    Attributes:
        request_id: u64, unique per update (0: no deduplication, a REPLACE).
        view: u64 shard-map epoch.
        expect: u64, 0 from a client; on a forward, the chunk version the sender reached.
        timeout_ms: u32 deadline of the forward to the next replica, milliseconds.
        successors: ``(shard id, "HOST:PORT")`` of the replicas after the receiver, in order.
    """

    request_id: int
    view: int = 0
    expect: int = 0
    timeout_ms: int = 5000
    successors: tuple[tuple[int, str], ...] = ()
    #: The push this update is a part of, when it is one of several (FLAG_PART, after the
    #: chain on the wire; a client's update only: forwards leave it out).
    part: Part | None = None

    def encode(self) -> bytes:
        out = [_CHAIN.pack(self.request_id, self.view, self.expect, self.timeout_ms, len(self.successors))]
        for sid, addr in self.successors:
            a = addr.encode()
            out.append(_PEER.pack(sid, len(a)) + a)
        return b"".join(out)

    @classmethod
    def decode(cls, body: memoryview, at: int) -> tuple[Chain, int]:
        """Parse a chain at ``body[at:]``; returns it and the offset after it."""
        _need(body[at:], _CHAIN.size, "chain")
        rid, view, expect, tmo, n = _CHAIN.unpack_from(body, at)
        at += _CHAIN.size
        succ = []
        for _ in range(n):
            _need(body[at:], _PEER.size, "chain successor")
            sid, alen = _PEER.unpack_from(body, at)
            at += _PEER.size
            _need(body[at:], alen, "chain successor address")
            succ.append((sid, bytes(body[at : at + alen]).decode("utf-8", "replace")))
            at += alen
        return cls(rid, view, expect, tmo, tuple(succ)), at


def _chain_bytes(chain: Chain | None) -> tuple[bytes, int]:
    """The wire bytes of an update's chain and its part, and the flags they set."""
    if chain is None:
        return b"", 0
    if chain.part is None:
        return chain.encode(), FLAG_CHAIN
    return chain.encode() + chain.part.encode(), FLAG_CHAIN | FLAG_PART


def _chain_of(body: memoryview, at: int, flags: int) -> tuple[Chain | None, int]:
    """The chain (and its part) an update carries at ``body[at:]`` by its flags; and the offset after."""
    if not flags & FLAG_CHAIN:
        if flags & FLAG_PART:
            raise RemoteProtocolError("FLAG_PART without FLAG_CHAIN")
        return None, at
    chain, at = Chain.decode(body, at)
    if flags & FLAG_PART:
        _need(body[at:], _PART.size, "push part")
        part = Part.decode(body, at)
        if not part.push_id or part.count < 2 or part.index >= part.count:
            raise RemoteProtocolError(f"push part {part.index} of {part.count} (push {part.push_id}) is not valid")
        chain = dataclasses.replace(chain, part=part)
        at += _PART.size
    return chain, at


@dataclass
class Resync:
    """Bring the replicas after the receiver up to date on one chunk: the receiver sends its
    whole chunk down ``chain`` (a REPLACE ordered after every update it applied before).
    Body: ``!QQI`` (file id, chunk index, chunk size), then the chain (no FLAG_CHAIN)."""

    OPCODE: ClassVar[Opcode] = Opcode.RESYNC

    file_id: int
    chunk_index: int
    chunk_size: int
    chain: Chain

    def encode(self) -> tuple[_Parts, int]:
        return [_RESYNC.pack(self.file_id, self.chunk_index, self.chunk_size) + self.chain.encode()], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Resync:
        _need(body, _RESYNC.size, "RESYNC")
        chain, at = Chain.decode(body, _RESYNC.size)
        _exact(body, at, "RESYNC")
        fid, idx, csize = _RESYNC.unpack_from(body)
        return cls(fid, idx, csize, chain)

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "RESYNC reply")
