"""Frames: the 16-byte header, :func:`encode_request` and :func:`encode_reply` (a message to
the buffers of its frame), :class:`FrameDecoder` (a byte stream, fed in pieces of any size, to
frames) and :func:`decode_request` and :func:`decode_reply` (a frame to its message). Each
looks the message's codec up in :data:`MESSAGES`; none does I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..._errors import LocalProtocolError, RemoteProtocolError, ShardUnavailable
from ._core import (
    BODY_SLACK,
    DEFAULT_MAX_PAYLOAD,
    FLAG_REPLY,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Status,
)
from ._data import GatherReply, ReadReply, Scatter, Write
from ._errors import ErrorReply
from ._table import _BY_TYPE, _REPLIES, MESSAGES, Call, Reply, Request


@dataclass
class Frame:
    """One decoded frame: header fields plus the body (a view into the decoder's buffer
    or the caller's buffer; copy it if it must outlive the next ``feed``)."""

    opcode: int
    request_id: int
    status: int
    flags: int
    body: memoryview = field(default_factory=lambda: memoryview(b""))
    version: int = PROTOCOL_VERSION
    body_len: int = 0  # as announced by the header

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)


# ---------------------------------------------------------------- encoding
class Parts(list):  # type: ignore[type-arg]
    """The buffers of one frame in the order they go on the wire (header first).

    ``payload``: how many of the frame's last bytes are tensor payload (the data of a WRITE or
    SCATTER, of a READ or GATHER reply): the bytes a connection under ``--security auth``
    leaves out of the frame's tag (:class:`irdma.wire.auth.Macs`). 0 for every other frame."""

    payload = 0


def _parts(items: list[bytes | memoryview], payload: int = 0) -> Parts:
    out = Parts(items)
    out.payload = payload
    return out


def _header(opcode: int, request_id: int, body_len: int, status: int = 0, flags: int = 0) -> bytes:
    if not 0 <= request_id < 1 << 32:
        raise LocalProtocolError(f"request id {request_id} does not fit in u32")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, opcode, request_id, status, flags, body_len)


def encode_request(msg: Request | Call[Any], request_id: int) -> Parts:
    """Encode a request as a list of buffers to send in order (the payload is not copied).

    Raises:
        LocalProtocolError: a field does not fit its wire type.
    """
    row = _BY_TYPE.get(type(msg))
    if row is None:
        raise LocalProtocolError(f"not a request: {msg!r}")
    try:
        parts, flags = row.encode(msg)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot encode {msg!r}: {exc}") from None
    body_len = sum(len(p) for p in parts)
    if body_len >= 1 << 32:
        raise LocalProtocolError(f"body of {body_len} bytes does not fit in u32")
    payload = len(msg.data) if isinstance(msg, Write) or (isinstance(msg, Scatter) and not msg.staged) else 0
    return _parts([_header(row.opcode, request_id, body_len, 0, flags), *parts], payload)


def encode_reply(opcode: int, request_id: int, msg: Reply) -> Parts:
    """Encode a reply to request ``opcode``; see :func:`encode_request`."""
    if type(msg) not in _REPLIES:
        raise LocalProtocolError(f"not a reply: {msg!r}")
    parts, more = msg.encode()
    status = msg.status if isinstance(msg, ErrorReply) else Status.OK
    body_len = sum(len(p) for p in parts)
    payload = len(msg.data) if isinstance(msg, GatherReply) or (isinstance(msg, ReadReply) and not msg.hole) else 0
    return _parts([_header(opcode, request_id, body_len, int(status), FLAG_REPLY | more), *parts], payload)


# ---------------------------------------------------------------- decoding
class FrameTooLarge(RemoteProtocolError):
    """A header announced a body longer than the receiver accepts (answer TOO_LARGE, close)."""


class UnknownOpcode(RemoteProtocolError):
    """The frame is intact but its opcode is not one this side knows."""


def parse_header(buf: bytes | bytearray | memoryview, max_body: int, *, any_version: bool = False) -> Frame:
    """Parse one 16-byte header (the body is left empty).

    ``any_version`` skips the version check: for the HELLO that opens a connection, whose body
    says which versions the peer speaks (negotiation happens there, not in the header).

    Raises:
        FrameTooLarge: a body longer than ``max_body``.
        RemoteProtocolError: bad magic or a protocol version this code does not speak.
            Framing is lost: close the connection.
    """
    magic, version, opcode, request_id, status, flags, body_len = HEADER.unpack(buf[:HEADER_SIZE])
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {bytes(magic)!r}: not an irdma peer")
    if not any_version and not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"frame of protocol version {version}; this side speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    if body_len > max_body:
        raise FrameTooLarge(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return Frame(opcode, request_id, status, flags, version=version, body_len=body_len)


class FrameDecoder:
    """Incremental splitter of a byte stream into frames.

    Feed bytes in pieces of any size with :meth:`feed`; take frames with :meth:`next_frame`
    until it returns ``None``. A frame's body is a fresh ``bytes`` object.

    Args:
        max_body: largest body accepted, in bytes.
    """

    def __init__(self, max_body: int = DEFAULT_MAX_PAYLOAD + BODY_SLACK) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._pending: Frame | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned in a frame."""
        return len(self._buf)

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None when more bytes are needed.

        Raises:
            RemoteProtocolError: see :func:`parse_header`.
        """
        if self._pending is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._pending = parse_header(self._buf, self.max_body)
            del self._buf[:HEADER_SIZE]
        n = self._pending.body_len
        if len(self._buf) < n:
            return None
        frame, self._pending = self._pending, None
        frame.body = memoryview(bytes(self._buf[:n]))
        del self._buf[:n]
        return frame


def decode_request(frame: Frame) -> Request:
    """Turn a request frame into a message. Payloads are views into ``frame.body``.

    Raises:
        RemoteProtocolError: unknown opcode, a reply where a request was due, or a body
            whose length does not match its opcode. Framing is intact: answer with an error.
    """
    if frame.is_reply:
        raise RemoteProtocolError("got a reply frame where a request was expected")
    row = MESSAGES.get(frame.opcode)  # type: ignore[call-overload]
    if row is None:
        raise UnknownOpcode(f"unknown opcode {frame.opcode}")
    return row.decode(frame.body, frame.flags)  # type: ignore[no-any-return]


def decode_reply(frame: Frame) -> Reply:
    """Turn a reply frame into a message.

    Raises:
        RemoteProtocolError: a request where a reply was due, an unknown opcode, or a body
            that does not match.
    """
    if not frame.is_reply:
        raise RemoteProtocolError("got a request frame where a reply was expected")
    if frame.status != Status.OK:
        return ErrorReply.decode(frame.status, frame.body)
    row = MESSAGES.get(frame.opcode)  # type: ignore[call-overload]
    if row is None:
        raise UnknownOpcode(f"unknown opcode {frame.opcode} in a reply")
    return row.reply(frame.body, frame.flags)  # type: ignore[no-any-return]


class UnexpectedReply(RemoteProtocolError, ShardUnavailable):
    """The peer answered a request with a reply of another kind (a READ answered as a STAT,
    say): the peer is at fault (a :class:`RemoteProtocolError`), and a transport that meets
    one declares the connection broken, so its callers treat it as a lost shard
    (:class:`ShardUnavailable`: reconnect, fail over)."""


_R = TypeVar("_R")


def expect_reply(reply: Reply, kind: type[_R], request: str, peer: str) -> _R:
    """``reply`` when it is a ``kind``: the check of what a peer sent back, so never an
    ``assert`` (``python -O`` strips those).

    Args:
        reply: the decoded reply (an error reply was turned into an exception before).
        kind: the reply class ``request`` is answered with.
        request: the request's name, for the message (``"WRITE"``).
        peer: who answered, for the message (``"shard at HOST:PORT"``).

    Raises:
        UnexpectedReply: ``reply`` is of another kind.
    """
    if not isinstance(reply, kind):
        raise UnexpectedReply(f"{peer} answered a {request} request with a {type(reply).__name__},"
                              f" not a {kind.__name__}: connection closed")
    return reply
