"""The data path: READ, WRITE, GATHER and SCATTER of extents (protocol 7, sparse rows), PUNCH
and FREE (the verbs transport's LOCATE and REMOTE_WRITE are in :mod:`._verbs`).

A WRITE with FLAG_EXISTING is applied only to a chunk that exists (one the metadata records
as written); a missing chunk is answered CHUNK_LOST and nothing is created, so a lost chunk
never silently comes back as zeros plus the new bytes.

Sparse access (protocol 7): GATHER pulls a list of *extents* (chunk index, offset, length) of
one file in one request and SCATTER pushes one with an update op, ps-lite's sparse pull and push
(Li et al., OSDI 2014) as vectored I/O in the manner of ``preadv``/``pwritev``. An extent lies
inside one chunk; a SCATTER applies its extents of each chunk atomically with one version bump
per chunk (extents of one chunk must not overlap); a GATHER reply carries one u64 version per
extent (0: a hole, read as zeros), after a u32 count and 4 pad bytes, and then the extents'
bytes in request order. Extents travel as ``!QII`` records (16 bytes each) after the fixed part.

Compressed gradients (protocol 8): the op byte of WRITE and REMOTE_WRITE is ``op | encoding << 4``
(:class:`Encoding`; the layouts are in :mod:`irdma.wire.compress`). The payload of an encoded
write is the encoded gradient; the shard decodes it (refusing a malformed one, BAD_REQUEST,
nothing changed) and applies the op to the ``4 * n`` decoded bytes at ``offset``, exactly as a
dense write of them. ``assign`` and SCATTER are never encoded.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..._errors import LocalProtocolError, RemoteProtocolError
from ._chain import Chain, _chain_bytes, _chain_of
from ._core import (
    _VERSION,
    FLAG_CLEAN,
    FLAG_EXISTING,
    FLAG_HOLE,
    FLAG_REPLACE,
    FLAG_STAGED,
    FLAG_STAGED_EXTENTS,
    Opcode,
    VersionReply,
    _exact,
    _Fixed,
    _need,
    _Parts,
)
from ._update import Update, UpdateOp, _decode_update, _encode_update

#: One extent of GATHER and SCATTER: chunk index (u64), offset in the chunk, length (u32 each).
EXTENT = np.dtype([("chunk", ">u8"), ("offset", ">u4"), ("length", ">u4")])
#: Bytes of one extent on the wire.
EXTENT_SIZE = EXTENT.itemsize  # 16
_VERSIONS = np.dtype(">u8")


def extents(chunk: object, offset: object, length: object) -> np.ndarray:
    """An array of :data:`EXTENT` records from three equal-length integer sequences.

    Raises:
        LocalProtocolError: the sequences differ in length or a value does not fit its field.
    """
    c, o, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (chunk, offset, length))
    if not len(c) == len(o) == len(n):
        raise LocalProtocolError(f"extents of {len(c)} chunks, {len(o)} offsets and {len(n)} lengths")
    if len(c) and (c.min() < 0 or o.min() < 0 or n.min() < 0 or o.max() >= 1 << 32 or n.max() >= 1 << 32):
        raise LocalProtocolError("an extent's chunk, offset or length does not fit its field")
    out = np.empty(len(c), dtype=EXTENT)
    out["chunk"], out["offset"], out["length"] = c, o, n
    return out


def _decode_extents(body: memoryview, at: int, count: int, what: str) -> tuple[np.ndarray, int]:
    end = at + count * EXTENT_SIZE
    _need(body, end, what)
    ext = np.frombuffer(body[at:end], dtype=EXTENT)
    if count and int(ext["chunk"].max()) >= 1 << 63:
        raise RemoteProtocolError(f"{what} names a chunk index of 2^63 or more")
    return ext, end


# ---------------------------------------------------------------- READ
@dataclass
class Read:
    """Body ``!QQII``: file id, chunk index, offset, length. Answered with a :class:`ReadReply`."""

    OPCODE: ClassVar[Opcode] = Opcode.READ
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQII")

    file_id: int
    chunk_index: int
    offset: int
    length: int
    clean: bool = False  # FLAG_CLEAN: answer DIRTY rather than a version not on every replica

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(self.file_id, self.chunk_index, self.offset, self.length)], FLAG_CLEAN if self.clean else 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Read:
        _exact(body, cls.LAYOUT.size, "READ")
        fid, idx, off, n = cls.LAYOUT.unpack_from(body)
        return cls(fid, idx, off, n, bool(flags & FLAG_CLEAN))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> ReadReply:
        return ReadReply.decode(body, flags)


@dataclass
class ReadReply:
    """Body ``!Q`` (the chunk's version), then the bytes; FLAG_HOLE and no bytes for a missing chunk."""

    version: int
    data: memoryview | bytes = b""
    hole: bool = False

    def encode(self) -> tuple[_Parts, int]:
        return ([_VERSION.pack(self.version)], FLAG_HOLE) if self.hole else ([_VERSION.pack(self.version), self.data], 0)

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> ReadReply:
        _need(body, _VERSION.size, "READ reply")
        (version,) = _VERSION.unpack_from(body)
        return cls(version, body[_VERSION.size :], bool(flags & FLAG_HOLE))


# ---------------------------------------------------------------- WRITE
@dataclass
class Write:
    """Body ``!QQIIB3x`` (file id, chunk index, chunk size, offset, op byte), the optimizer's
    arguments, the chain (FLAG_CHAIN) and its part (FLAG_PART), then the payload. Answered with
    a :class:`VersionReply`."""

    OPCODE: ClassVar[Opcode] = Opcode.WRITE
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQIIB3x")

    file_id: int
    chunk_index: int
    chunk_size: int
    offset: int
    op: UpdateOp | Update
    data: memoryview | bytes = b""  # with an encoded op (protocol 8): the encoded gradient
    existing: bool = False  # FLAG_EXISTING: never create the chunk
    chain: Chain | None = None  # FLAG_CHAIN: replicate along this chain
    #: FLAG_REPLACE (forwards only): a whole-chunk copy, ``data`` its first bytes and zeros
    #: after them up to ``chunk_size`` (protocol 12; the whole chunk before)
    replace: bool = False

    def encode(self) -> tuple[_Parts, int]:
        flags = 0
        opv, optim = _encode_update(self.op)
        chain, flags = _chain_bytes(self.chain)
        fixed = self.LAYOUT.pack(self.file_id, self.chunk_index, self.chunk_size, self.offset, opv) + optim + chain
        flags |= (FLAG_EXISTING if self.existing else 0) | (FLAG_REPLACE if self.replace else 0)
        return ([fixed, self.data] if len(self.data) else [fixed]), flags

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Write:
        _need(body, cls.LAYOUT.size, "WRITE")
        fid, idx, csize, off, opv = cls.LAYOUT.unpack_from(body)
        uop, at = _decode_update(opv, body, cls.LAYOUT.size)
        chain, at = _chain_of(body, at, flags)
        return cls(fid, idx, csize, off, uop, body[at:], bool(flags & FLAG_EXISTING), chain, bool(flags & FLAG_REPLACE))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "WRITE reply")


# ---------------------------------------------------------------- GATHER and SCATTER
@dataclass
class Gather:
    """Pull ``extents`` (:data:`EXTENT` records) of one file in one request (sparse rows).
    ``clean``: FLAG_CLEAN, answer DIRTY if any extent's chunk has an update in flight (CRAQ).
    Body ``!QI4x`` (file id, extent count), then the extents."""

    OPCODE: ClassVar[Opcode] = Opcode.GATHER
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QI4x")

    file_id: int
    extents: np.ndarray
    clean: bool = False

    def encode(self) -> tuple[_Parts, int]:
        ext = np.ascontiguousarray(self.extents, dtype=EXTENT)
        return [self.LAYOUT.pack(self.file_id, len(ext)), ext.tobytes()], FLAG_CLEAN if self.clean else 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Gather:
        _need(body, cls.LAYOUT.size, "GATHER")
        fid, count = cls.LAYOUT.unpack_from(body)
        ext, at = _decode_extents(body, cls.LAYOUT.size, count, "GATHER")
        _exact(body, at, "GATHER")
        return cls(fid, ext, bool(flags & FLAG_CLEAN))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> GatherReply:
        return GatherReply.decode(body, flags)


@dataclass
class GatherReply:
    """Reply to GATHER: ``versions`` (u64 per extent, 0 for a hole, which reads as zeros) and
    ``data``, the extents' bytes one after the other in request order. Body ``!I4x`` (extent
    count), the versions, then the bytes."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!I4x")

    versions: np.ndarray
    data: memoryview | bytes = b""

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(len(self.versions))
                + np.ascontiguousarray(self.versions, dtype=_VERSIONS).tobytes(), self.data], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> GatherReply:
        _need(body, cls.LAYOUT.size, "GATHER reply")
        (count,) = cls.LAYOUT.unpack_from(body)
        end = cls.LAYOUT.size + 8 * count
        _need(body, end, "GATHER reply")
        return cls(np.frombuffer(body[cls.LAYOUT.size : end], dtype=_VERSIONS), body[end:])


@dataclass
class Scatter:
    """Push ``data`` into ``extents`` of one file with update op ``op`` (sparse rows).

    ``data`` is the extents' bytes one after the other in request order; with ``staged`` (FLAG_STAGED,
    verbs) it is not in the frame but at ``staging_offset`` of the connection's staging buffer.
    ``staged_extents`` (FLAG_STAGED_EXTENTS, protocol 13; staged only): that many extents are in
    the staging buffer too, at ``staging_offset``, the payload right after them, and none in the
    frame (``extents`` is empty until :meth:`unstaged` reads them): more than a verbs SEND carries.
    The extents of one chunk are applied atomically, one version bump per chunk; a chained
    SCATTER is applied once per (request id, chunk) and forwarded chunk by chunk. Answered with a
    :class:`VersionReply` of the highest chunk version reached.

    Body ``!QIIB3xQ`` (file id, chunk size, extent count, op byte, staging offset), the
    optimizer's arguments, the chain and its part, the extents (not staged), then the payload
    (not staged).
    """

    OPCODE: ClassVar[Opcode] = Opcode.SCATTER
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QIIB3xQ")

    file_id: int
    chunk_size: int
    extents: np.ndarray
    op: UpdateOp | Update
    data: memoryview | bytes = b""
    existing: bool = False  # FLAG_EXISTING: never create a chunk
    chain: Chain | None = None  # FLAG_CHAIN
    staged: bool = False  # FLAG_STAGED
    staging_offset: int = 0
    staged_extents: int = 0  # FLAG_STAGED_EXTENTS: extents at staging_offset, ahead of the payload

    @property
    def length(self) -> int:
        """Bytes of payload the extents name."""
        return int(self.extents["length"].sum(dtype=np.int64))

    def encode(self) -> tuple[_Parts, int]:
        flags = 0
        ext = np.ascontiguousarray(self.extents, dtype=EXTENT)
        if self.staged_extents and (not self.staged or len(ext)):
            raise LocalProtocolError("a SCATTER's staged extents go with a staged payload and no extent in the frame")
        opv, optim = _encode_update(self.op, encodable=False)
        chain, flags = _chain_bytes(self.chain)
        fixed = self.LAYOUT.pack(self.file_id, self.chunk_size, self.staged_extents or len(ext), opv,
                                 self.staging_offset) + optim + chain
        if not self.staged and len(self.data) != self.length:
            raise LocalProtocolError(f"SCATTER of {len(self.data)} bytes into extents of {self.length}")
        parts: _Parts = [fixed, ext.tobytes()]
        if not self.staged and len(self.data):
            parts.append(self.data)
        return parts, (flags | (FLAG_EXISTING if self.existing else 0) | (FLAG_STAGED if self.staged else 0)
                       | (FLAG_STAGED_EXTENTS if self.staged_extents else 0))

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Scatter:
        _need(body, cls.LAYOUT.size, "SCATTER")
        fid, csize, count, opv, soff = cls.LAYOUT.unpack_from(body)
        uop, at = _decode_update(opv, body, cls.LAYOUT.size, encodable=False)
        chain, at = _chain_of(body, at, flags)
        staged = bool(flags & FLAG_STAGED)
        in_staging = count if flags & FLAG_STAGED_EXTENTS else 0
        if in_staging and not staged:
            raise RemoteProtocolError("a SCATTER's extents are staged (FLAG_STAGED_EXTENTS) but its payload is not")
        ext, at = _decode_extents(body, at, count - in_staging, "SCATTER")
        msg = cls(fid, csize, ext, uop, b"" if staged else body[at:], bool(flags & FLAG_EXISTING), chain, staged, soff,
                  in_staging)
        if staged:
            _exact(body, at, "SCATTER (staged)")
        elif len(body) - at != msg.length:
            raise RemoteProtocolError(f"SCATTER carries {len(body) - at} bytes for extents of {msg.length}")
        return msg

    def unstaged(self, staging: memoryview | None) -> Scatter:
        """This SCATTER with its staged extents (:attr:`staged_extents`) read out of ``staging``,
        the connection's staging buffer (copied: the buffer is reused), and its payload's place
        after them; itself when its extents are in the frame.

        Raises:
            RemoteProtocolError: no staging buffer (not verbs), or the extents leave it.
        """
        n = self.staged_extents
        if not n:
            return self
        end = self.staging_offset + n * EXTENT_SIZE
        if staging is None or end > len(staging):
            raise RemoteProtocolError(f"a SCATTER's {n} staged extents at offset {self.staging_offset} leave the"
                                      f" {0 if staging is None else len(staging)}-byte staging buffer"
                                      " (staged extents come only over the verbs transport)")
        ext, _ = _decode_extents(staging, self.staging_offset, n, "SCATTER's staged extents")
        return dataclasses.replace(self, extents=ext.copy(), staging_offset=end, staged_extents=0)

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "SCATTER reply")


# ---------------------------------------------------------------- PUNCH and FREE
@dataclass
class Punch(_Fixed):
    """Zero a chunk from ``offset`` on. Body ``!QQI``: file id, chunk index, offset. Answered
    with a :class:`VersionReply`."""

    OPCODE: ClassVar[Opcode] = Opcode.PUNCH
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQI")

    file_id: int
    chunk_index: int
    offset: int

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "PUNCH reply")


@dataclass
class Free(_Fixed):
    """Free a file's chunks from ``first_chunk`` on. Body ``!QQ``: file id, first chunk index.
    Answered with a :class:`FreeReply`."""

    OPCODE: ClassVar[Opcode] = Opcode.FREE
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQ")

    file_id: int
    first_chunk: int

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> FreeReply:
        return FreeReply.decode(body, flags)


@dataclass
class FreeReply:
    """Reply to FREE, FREE_FILES and CLONE: a count (chunks freed; chunk keys made). Body ``!Q``."""

    freed: int

    def encode(self) -> tuple[_Parts, int]:
        return [_VERSION.pack(self.freed)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> FreeReply:
        _exact(body, _VERSION.size, "FREE reply")
        return cls(_VERSION.unpack_from(body)[0])


#: Sizes of the fixed parts, for transports that receive payloads in place.
READ_REPLY_FIXED = _VERSION.size
GATHER_REPLY_FIXED = GatherReply.LAYOUT.size
WRITE_FIXED = Write.LAYOUT.size
