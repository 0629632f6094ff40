"""What a shard holds: STAT, LIST (pages through its chunks, for ``irdma gc`` and ``irdma
fsck``), CHECKSUM (a chunk's version and CRC-32, to compare replicas) and SYNC.

SYNC returns once every update the shard applied before it is durable (``msync``/``fsync`` of
a shard with a data directory; nothing to do for one whose memory is volatile or whose
durability is ``memory``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar

from ..._errors import RemoteProtocolError
from ._core import _COUNT, Opcode, VersionReply, _exact, _Fixed, _need, _Parts

#: Most entries one LIST reply carries.
MAX_LIST_ENTRIES = 4096
_LIST_E = struct.Struct("!QQIQ")  # file id, chunk index, chunk size, version


@dataclass
class Stat(_Fixed):
    """The shard's id, capacity and use. Empty body; answered with a :class:`StatReply`."""

    OPCODE: ClassVar[Opcode] = Opcode.STAT
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!")

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> StatReply:
        return StatReply.decode(body, flags)


@dataclass
class StatReply:
    """Reply to STAT. ``metrics``: the shard's Prometheus exporter, ``HOST:PORT`` as UTF-8 after
    the fixed part (at most 255 bytes; empty: none), so ``irdma stats --meta`` finds it.
    Fixed part ``!IQQQ``: shard id, capacity, used, chunks."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!IQQQ")

    shard_id: int
    capacity: int
    used: int
    chunks: int
    metrics: str = ""

    def encode(self) -> tuple[_Parts, int]:
        parts: _Parts = [self.LAYOUT.pack(self.shard_id, self.capacity, self.used, self.chunks)]
        return parts + ([self.metrics.encode()[:255]] if self.metrics else []), 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> StatReply:
        fixed = cls.LAYOUT.size
        _need(body, fixed, "STAT reply")
        if len(body) > fixed + 255:
            raise RemoteProtocolError(f"STAT reply of {len(body)} bytes is longer than {fixed + 255}")
        try:
            metrics = bytes(body[fixed:]).decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError("STAT reply names its metrics address in bytes that are not UTF-8") from None
        sid, cap, used, nchunks = cls.LAYOUT.unpack_from(body)
        return cls(sid, cap, used, nchunks, metrics)


@dataclass
class Sync(_Fixed):
    """Make every update applied so far durable; answered with a VersionReply of 0."""

    OPCODE: ClassVar[Opcode] = Opcode.SYNC
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!")

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "SYNC reply")


@dataclass
class List(_Fixed):
    """Chunks of the shard after ``(after_file, after_chunk)`` in (file, chunk) order.
    Body ``!QQI``: after file id, after chunk index, max entries."""

    OPCODE: ClassVar[Opcode] = Opcode.LIST
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQI")

    after_file: int = 0
    after_chunk: int = 0
    max_entries: int = MAX_LIST_ENTRIES

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> ListReply:
        return ListReply.decode(body, flags)


@dataclass
class ChunkEntry:
    """One chunk in a LIST or FREEZE reply: ``!QQIQ`` (file id, chunk index, chunk size, version)."""

    file_id: int
    chunk_index: int
    chunk_size: int  # bytes
    version: int


def _entries_bytes(entries: list[ChunkEntry]) -> bytes:
    """A u32 count, then the entries."""
    return _COUNT.pack(len(entries)) + b"".join(_LIST_E.pack(x.file_id, x.chunk_index, x.chunk_size, x.version)
                                                for x in entries)


def _entries_at(body: memoryview, count: int) -> list[ChunkEntry]:
    """The ``count`` entries after the u32 count at the start of ``body`` (length checked)."""
    return [ChunkEntry(*_LIST_E.unpack_from(body, _COUNT.size + i * _LIST_E.size)) for i in range(count)]


@dataclass
class ListReply:
    """Body ``!I`` (entry count), then the :class:`ChunkEntry` records."""

    entries: list[ChunkEntry] = field(default_factory=list)

    def encode(self) -> tuple[_Parts, int]:
        return [_entries_bytes(self.entries)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> ListReply:
        _need(body, _COUNT.size, "LIST reply")
        (count,) = _COUNT.unpack_from(body)
        _exact(body, _COUNT.size + count * _LIST_E.size, "LIST reply")
        return cls(_entries_at(body, count))


@dataclass
class Checksum(_Fixed):
    """The version and CRC-32 of a chunk's bytes (to compare replicas). ``view``: the shard-map
    epoch the resync acts on; the receiver refuses an older one than it has seen (FENCED) and
    fences updates older than it from then on, so none can slip past the comparison.
    Body ``!QQQ``: file id, chunk index, view."""

    OPCODE: ClassVar[Opcode] = Opcode.CHECKSUM
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QQQ")

    file_id: int
    chunk_index: int
    view: int = 0

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> ChecksumReply:
        return ChecksumReply.decode(body, flags)


@dataclass
class ChecksumReply:
    """Body ``!QI``: version, CRC-32 of the chunk's bytes."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QI")

    version: int  # 0: no such chunk
    crc: int  # zlib CRC-32 of the whole chunk; 0 when missing

    def encode(self) -> tuple[_Parts, int]:
        return [self.LAYOUT.pack(self.version, self.crc)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> ChecksumReply:
        _exact(body, cls.LAYOUT.size, "CHECKSUM reply")
        return cls(*cls.LAYOUT.unpack_from(body))
