"""The messages of :mod:`irdma.train.hier` host groups, as bytes: pure code, no I/O (as h11 does).
The leader's side sends and reads them in :mod:`._hier_leader`, a member's in :mod:`._hier_member`.

Every message is one ``SOCK_SEQPACKET`` datagram: the 32-byte header :data:`HDR`, little endian
(magic ``b"IRHG"``, version u8, kind u8, op u8, one pad byte, rank u32, ndim u32, step u64,
extra u64), then ``ndim`` u64 dimensions when ``ndim`` is not :data:`NONE` (REQ, DONE), then a
payload: HELLO and WELCOME carry :data:`HELLO` (size u32, pid u32; extra is the group's nbytes),
ERROR carries UTF-8 ``message NUL hint`` (rank: the rank at fault or :data:`NONE`; step:
:data:`NO_STEP` while the group forms).
"""

from __future__ import annotations

import enum
import struct

MAGIC = b"IRHG"
VERSION = 1
HDR = struct.Struct("<4sBBBxIIQQ")  # magic, version, kind, op, rank, ndim, step, extra
HELLO = struct.Struct("<II")  # size, pid
NONE = 0xFFFFFFFF  # ndim of "no array", rank of "no rank in particular"
NO_STEP = 2**64 - 1
MAX_MSG = 16384  # receive buffer: a header, 64 dimensions, an error text
MAX_TEXT = 4000


class Kind(enum.IntEnum):
    HELLO = 1  # member -> leader: I am rank r of a group of size s and nbytes n
    WELCOME = 2  # leader -> member: everyone is in; the shared memory's fd is attached
    REQ = 3  # member -> leader: my part of step `step` of `op` is ready (shape of my array)
    DONE = 4  # leader -> member: step `step` is done (shape of the result)
    ERROR = 5  # leader -> member: the group failed, here is why


class Op(enum.IntEnum):
    JOIN = 0
    ALLREDUCE = 1
    REDUCE_TO_LEADER = 2
    BROADCAST = 3
    BARRIER = 4

    @property
    def call(self) -> str:
        """The name of the HostGroup method."""
        return self.name.lower()


def pack(kind: Kind, op: Op, rank: int, shape: tuple[int, ...] | None, step: int, payload: bytes = b"",
         extra: int = 0) -> bytes:
    """One message; ``shape=None`` means no array."""
    ndim = NONE if shape is None else len(shape)
    dims = b"" if shape is None else struct.pack(f"<{len(shape)}Q", *shape)
    return HDR.pack(MAGIC, VERSION, kind, op, rank, ndim, step, extra) + dims + payload


def pack_greeting(kind: Kind, rank: int, size: int, pid: int, nbytes: int) -> bytes:
    """A HELLO (member) or WELCOME (leader) message: ``rank`` of a group of ``size`` and ``nbytes``."""
    return pack(kind, Op.JOIN, rank, None, 0, HELLO.pack(size, pid), extra=nbytes)


def pack_error(message: str, hint: str, rank: int | None, step: int | None) -> bytes:
    """An ERROR message (text cut to :data:`MAX_TEXT` bytes)."""
    text = f"{message}\0{hint}".encode()[:MAX_TEXT]
    return pack(Kind.ERROR, Op.JOIN, NONE if rank is None else rank, None, NO_STEP if step is None else step, text)


def unpack(msg: bytes) -> tuple[Kind, int, int, tuple[int, ...] | None, int, int, bytes]:
    """``(kind, op, rank, shape or None, step, extra, payload)`` of one message.

    Raises:
        ValueError: not a message of this protocol version (short, bad magic or version,
            unknown kind, fewer dimension bytes than ``ndim`` says).
    """
    if len(msg) < HDR.size:
        raise ValueError(f"{len(msg)} bytes, shorter than a header")
    magic, version, kind, op, rank, ndim, step, extra = HDR.unpack_from(msg)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    rest = msg[HDR.size:]
    shape: tuple[int, ...] | None = None
    if ndim != NONE:
        if len(rest) < 8 * ndim:
            raise ValueError(f"ndim {ndim} but {len(rest)} bytes of dimensions")
        shape = struct.unpack_from(f"<{ndim}Q", rest)
        rest = rest[8 * ndim:]
    return Kind(kind), op, rank, shape, step, extra, rest


def op_name(op: int) -> str:
    """The call an op number stands for, for error messages."""
    try:
        return Op(op).call
    except ValueError:
        return f"op {op}"
