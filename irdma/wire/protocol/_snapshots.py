"""A snapshot's cut and its files: FREEZE, ADMIT, CLONE, THAW (the cut, in the order a
snapshot's creator sends them: :mod:`irdma.client.snapshots`), USAGE and FREE_FILES.

Requests are applied in order per connection and answered in order, but an update to a file
a FREEZE holds is answered once applied, after the shard's CLONE (or THAW); the connection's
later requests to other files go on meanwhile. File lists travel as a u32 count and u64 ids.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar, Self

import numpy as np

from ..._errors import LocalProtocolError, RemoteProtocolError
from ._chain import _PART, Part
from ._core import _COUNT, Opcode, VersionReply, _exact, _Fixed, _need, _Parts
from ._data import FreeReply
from ._inventory import _LIST_E, ListReply, _entries_at, _entries_bytes

#: Most push ids one ADMIT names.
MAX_ADMIT = 4096
#: Most files one FREEZE or CLONE names (a bigger snapshot sends several).
MAX_SNAPSHOT_FILES = 65536
#: Seconds a shard remembers the push parts it applied (a push's parts land within a few
#: milliseconds of one another; a FREEZE reports those of the last half of this).
PART_MEMORY_S = 10.0


def _ids(body: memoryview, at: int) -> tuple[int, ...]:
    """The u64 ids from ``body[at:]`` to its end."""
    return tuple(int(i) for i in np.frombuffer(body[at:], dtype=">u8").tolist())


#: FREEZE's and ADMIT's fixed part: token (u64), milliseconds (u32), id count (u32).
_TOKEN_IDS = struct.Struct("!QII")


def _token_ids_bytes(what: str, token: int, ms: int, ids: tuple[int, ...], limit: int, noun: str) -> _Parts:
    """FREEZE's or ADMIT's body: ``!QII`` (token, milliseconds, count), then the u64 ids.

    Raises:
        LocalProtocolError: more than ``limit`` ids."""
    if len(ids) > limit:
        raise LocalProtocolError(f"{what} of {len(ids)} {noun}: at most {limit}")
    return [_TOKEN_IDS.pack(token, ms, len(ids)), np.asarray(ids, dtype=">u8").tobytes()]


def _token_ids_at(body: memoryview, what: str, limit: int, noun: str) -> tuple[int, int, tuple[int, ...]]:
    """(token, milliseconds, ids) of a FREEZE or ADMIT body.

    Raises:
        RemoteProtocolError: a short or long body, or more than ``limit`` ids."""
    _need(body, _TOKEN_IDS.size, what)
    token, ms, n = _TOKEN_IDS.unpack_from(body)
    if n > limit:
        raise RemoteProtocolError(f"{what} of {n} {noun}: at most {limit}")
    _exact(body, _TOKEN_IDS.size + 8 * n, what)
    return token, ms, _ids(body, _TOKEN_IDS.size)


@dataclass
class FreezeReply(ListReply):
    """Reply to FREEZE and ADMIT: ``entries``, the frozen files' chunks here (file id, chunk
    index, chunk size, version), and ``parts``, the push parts (:class:`Part`) this shard
    applied of those files: for FREEZE, those of the last :data:`PART_MEMORY_S` seconds; for
    ADMIT, those of the pushes it names. Body: the LIST reply's, then a u32 part count and the
    parts (``!QII`` each)."""

    parts: list[Part] = field(default_factory=list)

    def encode(self) -> tuple[_Parts, int]:
        return [_entries_bytes(self.entries) + _COUNT.pack(len(self.parts))
                + b"".join(p.encode() for p in self.parts)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> FreezeReply:
        _need(body, _COUNT.size, "FREEZE reply")
        (count,) = _COUNT.unpack_from(body)
        at = _COUNT.size + count * _LIST_E.size
        _need(body, at + _COUNT.size, "FREEZE reply")
        (nparts,) = _COUNT.unpack_from(body, at)
        at += _COUNT.size
        _exact(body, at + nparts * _PART.size, "FREEZE reply")
        return cls(_entries_at(body, count), [Part.decode(body, at + k * _PART.size) for k in range(nparts)])


@dataclass
class Freeze:
    """Hold the updates to these files until CLONE or THAW with ``token``, or until
    ``lease_ms`` passed (the snapshot that asked is then void): the first phase of a snapshot's
    cut (:mod:`irdma.client.snapshots`). Clients' updates are held, and so are the updates a
    replica forwards down a chain (protocol 10), until this shard's CLONE: those the cut has
    (their version not past it) are applied before the clone, the rest after; a shard not
    cloned within a second (less when the held forwards' deadlines are shorter) lets forwards go on,
    and refuses the clone if one reached a chunk past the cut.
    Answered with a LIST reply of every chunk of those files here (optimizer state left out:
    it follows its chunk). Body ``!QII`` (token, lease in milliseconds, file count), then the
    u64 file ids."""

    OPCODE: ClassVar[Opcode] = Opcode.FREEZE
    LAYOUT: ClassVar[struct.Struct] = _TOKEN_IDS

    token: int  # u64, non-zero, chosen by the snapshot's creator
    lease_ms: int
    file_ids: tuple[int, ...] = ()

    def encode(self) -> tuple[_Parts, int]:
        return _token_ids_bytes("FREEZE", self.token, self.lease_ms, self.file_ids, MAX_SNAPSHOT_FILES, "files"), 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Freeze:
        return cls(*_token_ids_at(body, "FREEZE", MAX_SNAPSHOT_FILES, "files"))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> FreezeReply:
        return FreezeReply.decode(body, flags)


@dataclass
class Admit:
    """Between FREEZE and CLONE: the pushes ``push_ids`` were split by the freeze (some of their
    parts were applied before it on some shard, some not): apply their parts this shard holds
    now, and those that come later at once, so the cut takes them whole. Waits up to ``wait_ms``
    for one to come when none is held. Answered with a :class:`FreezeReply` of the chunks of
    the files those parts touched and every part of those pushes this shard applied.
    Body ``!QII`` (token, wait in milliseconds, push id count), then the u64 push ids."""

    OPCODE: ClassVar[Opcode] = Opcode.ADMIT
    LAYOUT: ClassVar[struct.Struct] = _TOKEN_IDS

    token: int
    wait_ms: int = 0
    push_ids: tuple[int, ...] = ()

    def encode(self) -> tuple[_Parts, int]:
        return _token_ids_bytes("ADMIT", self.token, self.wait_ms, self.push_ids, MAX_ADMIT, "pushes"), 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Admit:
        return cls(*_token_ids_at(body, "ADMIT", MAX_ADMIT, "pushes"))

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> FreezeReply:
        return FreezeReply.decode(body, flags)


@dataclass
class Clone:
    """Second phase of a snapshot's cut: once every chunk named in ``expect`` is at that
    version here (a replica catching up on forwarded updates, held or on their way; waited
    for up to the freeze's lease), make each pair's clone file share the source's chunks (no
    byte copied: :meth:`irdma.server.shard.Shard.clone`), then end the freeze here: the held
    updates are applied in the order they came (protocol 10; before, the freeze stayed until
    THAW, sent once every shard had cloned). Token 0: no
    freeze, no versions (the sources are read-only: a snapshot's files, cloned back into the
    live namespace). Answered with a FREE reply giving how many chunk keys were made.
    Body ``!QII`` (token, pair count, expected-version count), the pairs ``!QQ`` (source file
    id, clone's file id), then the expected versions ``!QQQ`` (file id, chunk index, version)."""

    OPCODE: ClassVar[Opcode] = Opcode.CLONE
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!QII")
    PAIR: ClassVar[struct.Struct] = struct.Struct("!QQ")
    EXPECT: ClassVar[struct.Struct] = struct.Struct("!QQQ")

    token: int
    pairs: tuple[tuple[int, int], ...] = ()  # (source file id, clone's file id)
    expect: tuple[tuple[int, int, int], ...] = ()  # (file id, chunk index, version)

    def encode(self) -> tuple[_Parts, int]:
        if len(self.pairs) > MAX_SNAPSHOT_FILES:
            raise LocalProtocolError(f"CLONE of {len(self.pairs)} files: at most {MAX_SNAPSHOT_FILES}")
        return [self.LAYOUT.pack(self.token, len(self.pairs), len(self.expect)),
                b"".join(self.PAIR.pack(*p) for p in self.pairs), b"".join(self.EXPECT.pack(*e) for e in self.expect)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Clone:
        _need(body, cls.LAYOUT.size, "CLONE")
        token, n, m = cls.LAYOUT.unpack_from(body)
        if n > MAX_SNAPSHOT_FILES or m > MAX_SNAPSHOT_FILES * 1024:
            raise RemoteProtocolError(f"CLONE of {n} files and {m} chunks is too large")
        _exact(body, cls.LAYOUT.size + n * cls.PAIR.size + m * cls.EXPECT.size, "CLONE")
        at = cls.LAYOUT.size
        pairs = tuple(cls.PAIR.unpack_from(body, at + k * cls.PAIR.size) for k in range(n))
        at += n * cls.PAIR.size
        expect = tuple(cls.EXPECT.unpack_from(body, at + k * cls.EXPECT.size) for k in range(m))
        return cls(token, pairs, expect)

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> FreeReply:
        return FreeReply.decode(body, flags)


@dataclass
class Thaw(_Fixed):
    """Release freeze ``token``: the held updates are applied (when a snapshot is given up
    before this shard's CLONE, which ends a freeze itself; a no-op for a freeze that is over).
    Answered with a VERSION reply of 0. Body ``!Q``: the token."""

    OPCODE: ClassVar[Opcode] = Opcode.THAW
    LAYOUT: ClassVar[struct.Struct] = struct.Struct("!Q")

    token: int

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> VersionReply:
        return VersionReply.decode(body, flags, "THAW reply")


class _FileList:
    """A request that is only a list of file ids (``file_ids``: u32 count, then u64 ids), at
    most :data:`MAX_SNAPSHOT_FILES`. A subclass is a dataclass naming its ``OPCODE``."""

    OPCODE: ClassVar[Opcode]
    file_ids: tuple[int, ...]

    def encode(self) -> tuple[_Parts, int]:
        if len(self.file_ids) > MAX_SNAPSHOT_FILES:
            raise LocalProtocolError(f"{self.OPCODE.name} of {len(self.file_ids)} files: at most {MAX_SNAPSHOT_FILES}")
        return [_COUNT.pack(len(self.file_ids)), np.asarray(self.file_ids, dtype=">u8").tobytes()], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Self:
        what = cls.OPCODE.name
        _need(body, _COUNT.size, what)
        (n,) = _COUNT.unpack_from(body)
        if n > MAX_SNAPSHOT_FILES:
            raise RemoteProtocolError(f"{what} of {n} files: at most {MAX_SNAPSHOT_FILES}")
        _exact(body, _COUNT.size + 8 * n, what)
        return cls(_ids(body, _COUNT.size))  # type: ignore[call-arg]


@dataclass
class Usage(_FileList):
    """How many bytes each file holds on this shard alone and how many it shares with other
    files (a snapshot and its live file: copy-on-write). Answered with a USAGE reply."""

    OPCODE: ClassVar[Opcode] = Opcode.USAGE

    file_ids: tuple[int, ...] = ()

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> UsageReply:
        return UsageReply.decode(body, flags)


@dataclass
class UsageReply:
    """Body: a u32 count, then ``!QQQ`` per file (file id, bytes it holds alone, bytes it shares)."""

    ENTRY: ClassVar[struct.Struct] = struct.Struct("!QQQ")

    entries: list[tuple[int, int, int]] = field(default_factory=list)  # (file id, alone, shared) bytes

    def encode(self) -> tuple[_Parts, int]:
        return [_COUNT.pack(len(self.entries)), b"".join(self.ENTRY.pack(*e) for e in self.entries)], 0

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> UsageReply:
        _need(body, _COUNT.size, "USAGE reply")
        (n,) = _COUNT.unpack_from(body)
        _exact(body, _COUNT.size + n * cls.ENTRY.size, "USAGE reply")
        return cls([cls.ENTRY.unpack_from(body, _COUNT.size + k * cls.ENTRY.size) for k in range(n)])


@dataclass
class FreeFiles(_FileList):
    """FREE of every chunk of each file (a snapshot's delete: all its files on this shard in one
    request, one chunk-index transaction). Answered with a FREE reply of the chunks freed."""

    OPCODE: ClassVar[Opcode] = Opcode.FREE_FILES

    file_ids: tuple[int, ...] = ()

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> FreeReply:
        return FreeReply.decode(body, flags)
