"""Error replies and the one table of statuses and the exceptions they stand for.

A reply whose status is not OK carries a UTF-8 message as its body (at most 4096 bytes); the
bodies of STALE and FORWARD_FAILED start with the u32 id of the replica concerned. A shard
turns an exception into its reply with :func:`error_reply`, a client turns the reply back into
the exception with :func:`raise_for_error`, both by :data:`STATUS_ERRORS`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..._errors import (
    BadRequest,
    DataLost,
    Dirty,
    Fenced,
    IrdmaError,
    NoSpace,
    ReplicaFailed,
    ReplicaStale,
    ShardUnavailable,
)
from ._core import Status, _Parts

#: Statuses whose error body starts with the u32 id of the shard concerned.
SHARD_STATUSES = (Status.STALE, Status.FORWARD_FAILED)

#: The one table of error statuses and the exceptions they stand for, read by both sides: a
#: shard answers an exception with the status of the first class here it is an instance of
#: (:func:`error_reply`), a client raises that class for the status (:func:`raise_for_error`).
#: (3FS's StatusCode, one table per direction being the bug this replaces.)
STATUS_ERRORS: tuple[tuple[Status, type[IrdmaError]], ...] = (
    (Status.NO_SPACE, NoSpace),
    (Status.BAD_REQUEST, BadRequest),
    (Status.CHUNK_LOST, DataLost),
    (Status.STALE, ReplicaStale),
    (Status.FORWARD_FAILED, ReplicaFailed),
    (Status.FENCED, Fenced),
    (Status.DIRTY, Dirty),
)
#: Statuses of a frame the shard refused before applying it: the client raises BadRequest.
REFUSED_STATUSES = (Status.BAD_REQUEST, Status.TOO_LARGE, Status.UNKNOWN_OPCODE)

_ERR_SHARD = struct.Struct("!I")


@dataclass
class ErrorReply:
    """A reply whose status is not OK: ``!I`` shard id (:data:`SHARD_STATUSES` only), then the
    UTF-8 message (cut at 4096 bytes)."""

    status: Status
    message: str = ""
    shard_id: int = 0  # STALE, FORWARD_FAILED: the replica concerned

    def encode(self) -> tuple[_Parts, int]:
        parts: _Parts = [self.message.encode()[:4096]]
        if self.status in SHARD_STATUSES:
            parts.insert(0, _ERR_SHARD.pack(self.shard_id))
        return parts, 0

    @classmethod
    def decode(cls, status: int, body: memoryview) -> ErrorReply:
        """The error reply of header status ``status`` (one this side does not know: INTERNAL)."""
        try:
            known = Status(status)
        except ValueError:
            known = Status.INTERNAL
        sid = 0
        if known in SHARD_STATUSES and len(body) >= _ERR_SHARD.size:
            (sid,) = _ERR_SHARD.unpack_from(body)
            body = body[_ERR_SHARD.size :]
        return cls(known, bytes(body).decode("utf-8", "replace"), sid)


def error_reply(exc: Exception, shard_id: int) -> ErrorReply | None:
    """The error reply a shard (``shard_id``) sends for a request that raised ``exc``
    (:data:`STATUS_ERRORS`; ShardUnavailable met while serving is INTERNAL); None for any other
    exception: a bug, which the caller logs and answers INTERNAL."""
    for status, cls in STATUS_ERRORS:
        if isinstance(exc, cls):
            # the class's own hint is not sent: the client's exception of the same class says it once
            said = exc.args[0] if exc.args and isinstance(exc.args[0], str) and getattr(exc, "hint", "") == getattr(type(exc), "hint", "") else str(exc)
            return ErrorReply(status, said, getattr(exc, "shard_id", 0) if status in SHARD_STATUSES else 0)
    if isinstance(exc, ShardUnavailable):
        return ErrorReply(Status.INTERNAL, f"shard {shard_id}: {exc}")
    return None


def raise_for_error(reply: object, address: str) -> None:
    """Raise the exception an error reply from the shard at ``address`` stands for
    (:data:`STATUS_ERRORS`); any other status is ShardUnavailable. Other replies pass.

    Raises:
        BadRequest: the shard refused the request (:data:`REFUSED_STATUSES`).
        NoSpace, DataLost, ReplicaStale, ReplicaFailed, Fenced, Dirty: as the table says.
        ShardUnavailable: INTERNAL, AUTH_FAILED and any status this side does not know.
    """
    if not isinstance(reply, ErrorReply):
        return
    where = f"shard at {address}"
    if reply.status in REFUSED_STATUSES:
        raise BadRequest(f"{where} refused the request: {reply.message}")
    for status, cls in STATUS_ERRORS:
        if reply.status == status:
            if status in SHARD_STATUSES:
                raise cls(f"{where}: {reply.message}", reply.shard_id)  # type: ignore[arg-type]
            raise cls(f"{where}: {reply.message}")
    name = reply.status.name if isinstance(reply.status, Status) else str(reply.status)
    raise ShardUnavailable(f"{where} answered {name}: {reply.message}")
