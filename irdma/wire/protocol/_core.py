"""The frame's header and what every message shares: versions, flags, opcodes, statuses, the
limits, and the helpers each message's codec uses to check a body's length.

Every message class of this package owns its layout (``struct`` formats beside its fields) and
its codec: a request's ``encode()`` returns ``(parts, flags)``, the body's buffers after the
header (payloads as views, never copied) and the header's flags; its ``decode(body, flags)``
classmethod parses a body (views into it) and ``decode_reply(body, flags)`` parses the body of
its OK reply. A reply's ``encode()`` and ``decode(body, flags)`` are the same for the reply
side. Decoders raise RemoteProtocolError for a body that does not match (framing is intact:
answer an error), encoders LocalProtocolError for a field that does not fit.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass
from typing import ClassVar, Self

from ..._errors import RemoteProtocolError

PROTOCOL_VERSION = 14
#: Oldest protocol version this code speaks (3 added chain replication, 4 authentication, 5 GMAC
#: frame tags, 6 optimizer update ops, 7 GATHER and SCATTER of extents: sparse rows, 8 encoded
#: (compressed) gradients in WRITE and REMOTE_WRITE, 9 push parts (FLAG_PART) and ADMIT: a
#: snapshot keeps a push whole; FREE_FILES; 10 no new frame: CLONE ends the freeze on its shard,
#: and a frozen shard holds forwarded updates until its clone, so pushes wait one round trip
#: of the snapshot's creator, not three; a creator of protocol 9 still sends THAW, a no-op then;
#: 11 rounds: a push may be one member's contribution to a synchronous round, ROUND_BIT;
#: 12 elastic rounds: ROUND_ELASTIC and ROUND_CLOSE, and a SCATTER's rounds with empty extents;
#: and a whole-chunk copy, FLAG_REPLACE, may carry the chunk's first bytes only, zeros after
#: them, as a shard holds a chunk in an extent sized to its bytes: a shard sends such a copy
#: only to a successor of protocol 12, :data:`SHORT_COPIES`;
#: 13 FLAG_STAGED_EXTENTS: a staged SCATTER's extents in the staging buffer too, verbs;
#: 14 the FTRL update op: a shard of 13 answers it BadRequest).
MIN_PROTOCOL_VERSION = 9
#: The protocol version from which a whole-chunk copy (FLAG_REPLACE) may be shorter than its chunk.
SHORT_COPIES = 12
MAGIC = b"IR"
HEADER = struct.Struct("!2sBBIHHI")
HEADER_SIZE = HEADER.size  # 16
#: Default largest payload (bytes) of one READ or WRITE; shards advertise theirs in HELLO.
DEFAULT_MAX_PAYLOAD = 16 << 20
#: Seconds at most between an update a shard with a data directory (durability ``fsync``)
#: applied and its own sync of it when no client asks (SYNC: ``fsync(2)`` on a mount,
#: ``Client.flush()``): a mount's ``close`` leaves the sync to the shards, as a local
#: filesystem's ``close`` leaves its pages to the kernel's writeback, which writes a dirty page
#: within ``vm.dirty_expire_centisecs`` (30 s). Not shorter: a sync writes back every page
#: dirtied since the last, and on 2 cores that writeback halved the sequential reads that
#: followed a write (make bench's fio: 0.73 -> 0.54 of the passthrough at 5 s).
SYNC_INTERVAL_S = 30.0
#: Room for the fixed part of any body on top of the payload.
BODY_SLACK = 256

FLAG_REPLY = 0x1
FLAG_HOLE = 0x2
#: On a WRITE request: apply only to an existing chunk, else answer CHUNK_LOST.
FLAG_EXISTING = 0x4
#: On WRITE and REMOTE_WRITE: the body carries a replication :class:`Chain` after the fixed part.
FLAG_CHAIN = 0x8
#: On a forwarded WRITE: the payload is the whole chunk; set it and the chunk's version to
#: ``chain.expect`` (how a predecessor brings a stale replica up to date).
FLAG_REPLACE = 0x10
#: On READ: answer DIRTY rather than bytes some replica after this one may not have yet.
FLAG_CLEAN = 0x20
#: On the reply to HELLO: a challenge (the shard's nonce); prove the key with AUTH.
FLAG_CHALLENGE = 0x40
#: On SCATTER: the payload is not in the frame but in the connection's staging buffer at
#: ``staging_offset`` (verbs: it moved there by RDMA WRITE).
FLAG_STAGED = 0x80
#: On WRITE, REMOTE_WRITE and SCATTER with FLAG_CHAIN: a :class:`Part` follows the chain (the
#: update is one of several requests of one push; a snapshot's cut keeps a push whole).
FLAG_PART = 0x100
#: On a staged SCATTER (protocol 13): its extents are in the staging buffer too, at
#: ``staging_offset``, ahead of the payload; the frame carries only their count (verbs: a round's
#: rows of one chunk are one request however many extents they take).
FLAG_STAGED_EXTENTS = 0x200


class Opcode(enum.IntEnum):
    HELLO = 1
    READ = 2
    WRITE = 3
    STAT = 4
    FREE = 5
    PUNCH = 6
    VERBS_CONNECT = 7
    LOCATE = 8
    REMOTE_WRITE = 9
    LIST = 10
    SYNC = 11
    RESYNC = 12
    CHECKSUM = 13
    AUTH = 14
    GATHER = 15
    SCATTER = 16
    FREEZE = 17
    CLONE = 18
    THAW = 19
    USAGE = 20
    ADMIT = 21
    FREE_FILES = 22


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    NO_SPACE = 2
    UNKNOWN_OPCODE = 3
    TOO_LARGE = 4
    UNSUPPORTED_VERSION = 5
    AUTH_FAILED = 6
    INTERNAL = 7
    BAD_FRAME = 8
    CHUNK_LOST = 9
    STALE = 10  # a replica's chunk version does not follow the forwarded one (it missed updates)
    FENCED = 11  # the request's view of the shard map is older than one this shard has seen
    DIRTY = 12  # FLAG_CLEAN read of a chunk whose last update is not yet on every replica
    FORWARD_FAILED = 13  # applied here, but a successor failed or missed the forward deadline


#: The buffers of a body, in order, as a message's ``encode()`` returns them.
_Parts = list[bytes | memoryview]
#: A u64: a chunk version (the body of VERSION, READ's fixed part) or a count (FREE's reply).
_VERSION = struct.Struct("!Q")
#: A u32 count of the records that follow (LIST, USAGE and FREEZE replies, file lists).
_COUNT = struct.Struct("!I")


def _need(body: memoryview, n: int, what: str) -> None:
    if len(body) < n:
        raise RemoteProtocolError(f"{what} body of {len(body)} bytes is shorter than its {n}-byte fixed part")


def _exact(body: memoryview, n: int, what: str) -> None:
    if len(body) != n:
        raise RemoteProtocolError(f"{what} body must be {n} bytes, got {len(body)}")


@dataclass
class VersionReply:
    """Reply to WRITE and PUNCH: the chunk's version after the update.

    Also the reply of REMOTE_WRITE, SCATTER and RESYNC, and of SYNC and THAW (version 0).
    Body: ``!Q``, the version.
    """

    version: int

    def encode(self) -> tuple[_Parts, int]:
        return [_VERSION.pack(self.version)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int, what: str) -> VersionReply:
        """Parse the reply of request ``what`` (named in the error, ``"WRITE reply"``)."""
        _exact(body, _VERSION.size, what)
        return cls(_VERSION.unpack_from(body)[0])


#: The field names of each fixed request class, in order (filled on first use).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _Fixed:
    """A request that is one fixed struct of its fields, in order (``LAYOUT``), with no flags.
    A subclass is a dataclass naming its ``OPCODE`` and ``LAYOUT``."""

    OPCODE: ClassVar[Opcode]
    LAYOUT: ClassVar[struct.Struct]

    def encode(self) -> tuple[_Parts, int]:
        names = _field_names(type(self))
        return ([self.LAYOUT.pack(*(getattr(self, n) for n in names))] if names else []), 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Self:
        _exact(body, cls.LAYOUT.size, cls.OPCODE.name)
        return cls(*cls.LAYOUT.unpack_from(body))
