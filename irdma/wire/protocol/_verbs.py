"""The verbs transport's messages: VERBS_CONNECT (queue pairs and memory regions), LOCATE
(where a chunk lives in the shard's region, for one-sided RDMA READ and WRITE) and
REMOTE_WRITE (a write whose payload already moved by RDMA WRITE). See
:mod:`irdma.transport.verbs` and :mod:`irdma.server.verbs`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from ._chain import Chain, _chain_bytes, _chain_of
from ._core import FLAG_EXISTING, Opcode, VersionReply, _exact, _Fixed, _need, _Parts
from ._update import Update, UpdateOp, _decode_update, _encode_update


@dataclass
class VerbsConnect(_Fixed):
    """Verbs transport: the client's RC queue pair, to be connected to a new one on the shard.
    Body ``!II16s``: QP number, PSN, GID."""

    OPCODE: ClassVar[Opcode] = Opcode.VERBS_CONNECT
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!II16s")

    qp_num: int
    psn: int
    gid: bytes  # 16 bytes, network order

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VerbsConnectReply:
        return VerbsConnectReply.decode(body, flags)


@dataclass
class VerbsConnectReply:
    """The shard's queue pair and the remote memory it lets this client touch.

    ``region_*``: the memory region of chunks (RDMA READ and WRITE). ``versions_*``: the table
    of chunk versions, little-endian u64, slot ``chunk_offset // 4096`` (RDMA READ).
    ``staging_*``: this connection's staging buffer (RDMA WRITE, then REMOTE_WRITE).
    Body ``!II16sQQIQIQIIHI``: the fields in order.
    """

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!II16sQQIQIQIIHI")

    qp_num: int
    psn: int
    gid: bytes
    region_addr: int
    region_len: int
    region_rkey: int
    versions_addr: int
    versions_rkey: int
    staging_addr: int
    staging_len: int
    staging_rkey: int
    recv_slots: int  # requests the shard can take at once on this QP
    slot_size: int  # largest request frame it takes over SEND, bytes

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(self.qp_num, self.psn, self.gid, self.region_addr, self.region_len, self.region_rkey,
                                 self.versions_addr, self.versions_rkey, self.staging_addr, self.staging_len,
                                 self.staging_rkey, self.recv_slots, self.slot_size)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> VerbsConnectReply:
        _exact(body, cls.LAYOUT.size, "VERBS_CONNECT reply")
        return cls(*cls.LAYOUT.unpack_from(body))


@dataclass
class Locate(_Fixed):
    """Where a chunk lives in the region; ``create_size`` > 0 allocates it if missing.
    Body ``!QQI``: file id, chunk index, chunk size to create with (0: do not)."""

    OPCODE: ClassVar[Opcode] = Opcode.LOCATE
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQI")

    file_id: int
    chunk_index: int
    create_size: int = 0

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> LocateReply:
        return LocateReply.decode(body, flags)


@dataclass
class LocateReply:
    """``shared``: the chunk shares its extent with another key (a snapshot's): its place may
    change at the next update (copy-on-write), so a client must not cache it (sent as
    ``exists`` = 2). Body ``!B3xQIQ``: exists, region offset, chunk size, version slot index."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!B3xQIQ")

    exists: bool
    region_offset: int = 0
    chunk_size: int = 0
    version_slot: int = 0
    shared: bool = False

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(2 if self.exists and self.shared else int(self.exists), self.region_offset,
                                 self.chunk_size, self.version_slot)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> LocateReply:
        _exact(body, cls.LAYOUT.size, "LOCATE reply")
        exists, roff, csize, slot = cls.LAYOUT.unpack_from(body)
        return cls(bool(exists), roff, csize, slot, exists == 2)


@dataclass
class RemoteWrite:
    """A write whose payload already moved by RDMA WRITE.

    ``in_place``: the bytes were written straight into the chunk at ``region_offset`` (assign);
    the shard checks the chunk is still there and bumps its version. Otherwise the payload
    sits in the connection's staging buffer at ``staging_offset`` and the shard applies ``op``.

    Body ``!QQIIBB2xIQQ`` (file id, chunk index, chunk size, offset, op byte, in place, length,
    staging offset, region offset), the optimizer's arguments, then the chain and its part.
    Answered with a :class:`VersionReply`.
    """

    OPCODE: ClassVar[Opcode] = Opcode.REMOTE_WRITE
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQIIBB2xIQQ")

    file_id: int
    chunk_index: int
    chunk_size: int
    offset: int
    op: UpdateOp | Update
    in_place: bool
    length: int
    staging_offset: int = 0
    region_offset: int = 0
    existing: bool = False  # FLAG_EXISTING: never create the chunk
    chain: Chain | None = None  # FLAG_CHAIN: replicate along this chain

    def encode(self) -> tuple[_Parts, int]:
        opv, optim = _encode_update(self.op)
        chain, flags = _chain_bytes(self.chain)
        parts: _Parts = [self.LAYOUT.pack(self.file_id, self.chunk_index, self.chunk_size, self.offset, opv,
                                          int(self.in_place), self.length, self.staging_offset, self.region_offset)
                         + optim + chain]
        return parts, (FLAG_EXISTING if self.existing else 0) | flags

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> RemoteWrite:
        _need(body, cls.LAYOUT.size, "REMOTE_WRITE")
        fid, idx, csize, off, opv, in_place, n, soff, roff = cls.LAYOUT.unpack_from(body)
        uop, at = _decode_update(opv, body, cls.LAYOUT.size)
        chain, at = _chain_of(body, at, flags)
        _exact(body, at, "REMOTE_WRITE")
        return cls(fid, idx, csize, off, uop, bool(in_place), n, soff, roff, bool(flags & FLAG_EXISTING), chain)

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "REMOTE_WRITE reply")
