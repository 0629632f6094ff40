"""The message table: every request kind, by opcode, built from the message classes.

Each request kind is one row of :data:`MESSAGES`: its opcode, its class, and the class's own
codec (how it is encoded: the parts after the header and the header's flags; how its body is
decoded; how the body of its OK reply is decoded). :func:`~irdma.wire.protocol.encode_request`,
``decode_request`` and ``decode_reply`` only look rows up; a new request is a class with its
codec and one name in :data:`_REQUEST_CLASSES` (and its handling in :mod:`irdma.server.dispatch`).

A request class names its reply class once, as the return type of its ``decode_reply``: mypy
reads it there (:class:`Call`, so ``ShardConnection.call(Stat())`` is typed ``StatReply``) and
so does :func:`reply_kind` (the class a transport checks the reply against).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, Union, cast

from ._chain import Resync
from ._core import Opcode, VersionReply, _Parts
from ._data import (
    Free,
    FreeReply,
    Gather,
    GatherReply,
    Punch,
    Read,
    ReadReply,
    Scatter,
    Write,
)
from ._errors import ErrorReply
from ._handshake import Auth, AuthChallenge, Hello, HelloReply
from ._inventory import Checksum, ChecksumReply, List, ListReply, Stat, StatReply, Sync
from ._snapshots import Admit, Clone, FreeFiles, Freeze, FreezeReply, Thaw, Usage, UsageReply
from ._verbs import Locate, LocateReply, RemoteWrite, VerbsConnect, VerbsConnectReply

Request = Union[Hello, Read, Write, Stat, Free, Punch, VerbsConnect, Locate, RemoteWrite, List, Sync, Resync, Checksum,
                Auth, Gather, Scatter, Freeze, Clone, Thaw, Usage, Admit, FreeFiles]
Reply = Union[
    HelloReply, ReadReply, VersionReply, StatReply, FreeReply, ErrorReply, VerbsConnectReply, LocateReply, ListReply,
    ChecksumReply, AuthChallenge, GatherReply, UsageReply, FreezeReply,
]


@dataclass(frozen=True)
class Message:
    """One request kind of the protocol: a row of :data:`MESSAGES`.

    ``encode(msg) -> (parts, flags)``: the body's buffers after the header (payloads as views)
    and the header's flags. ``decode(body, flags)``: the request from its body (views into
    it). ``reply(body, flags)``: the OK reply from its body. Both decoders raise
    RemoteProtocolError for a body that does not match (framing is intact: answer an error).
    """

    opcode: Opcode
    request: type
    encode: Callable[[Any], tuple[_Parts, int]]
    decode: Callable[[memoryview, int], Any]
    reply: Callable[[memoryview, int], Any]


class _RequestClass(Protocol):
    """What a request class of this package has: its opcode and its codec."""

    OPCODE: ClassVar[Opcode]

    def encode(self) -> tuple[_Parts, int]: ...

    @classmethod
    def decode(cls, body: memoryview, flags: int) -> Any: ...

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> Any: ...


_R_co = TypeVar("_R_co", covariant=True)
_R = TypeVar("_R")


class Call(Protocol[_R_co]):
    """A request whose OK reply is a ``_R_co``: every request class of this package is one, its
    ``decode_reply`` names which (``Stat`` is a ``Call[StatReply]``)."""

    OPCODE: ClassVar[Opcode]

    def encode(self) -> tuple[_Parts, int]: ...

    @classmethod
    def decode_reply(cls, body: memoryview, flags: int) -> _R_co: ...


def _row(cls: type[_RequestClass]) -> Message:
    return Message(cls.OPCODE, cls, cls.encode, cls.decode, cls.decode_reply)


#: The request classes, in opcode-table order.
_REQUEST_CLASSES: tuple[type[_RequestClass], ...] = (
    Hello, Auth, Read, Write, Stat, Free, Punch, VerbsConnect, Locate, RemoteWrite, List, Sync, Resync, Checksum,
    Gather, Scatter, Freeze, Clone, Thaw, Usage, Admit, FreeFiles,
)
#: Every request kind, by opcode: the one registry of the protocol.
MESSAGES: dict[Opcode, Message] = {m.opcode: m for m in map(_row, _REQUEST_CLASSES)}
_BY_TYPE: dict[type, Message] = {m.request: m for m in MESSAGES.values()}
_REQUEST_OPCODE: dict[type, Opcode] = {m.request: m.opcode for m in MESSAGES.values()}
#: Every reply class (each owns its ``encode()``); an instance of another is not a reply.
_REPLIES: frozenset[type] = frozenset(typing.get_args(Reply))
#: The reply class of each request class: the return type of its ``decode_reply`` (a request
#: answered with one of several kinds, HELLO and AUTH, has none here).
_REPLY_KIND: dict[type, type] = {
    cls: kind for cls in _REQUEST_CLASSES
    if isinstance(kind := typing.get_type_hints(cls.decode_reply)["return"], type)
}


def reply_kind(request: Call[_R]) -> type[_R]:
    """The class of the OK reply that answers ``request`` (``StatReply`` for a ``Stat``).

    Raises:
        KeyError: ``request`` is not a request answered with one kind of reply (HELLO, AUTH).
    """
    return cast("type[_R]", _REPLY_KIND[type(request)])
