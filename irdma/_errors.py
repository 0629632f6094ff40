"""The exceptions of irdma, split by who is at fault (as h11 does).

Every error a user can meet derives from :class:`IrdmaError`. Each carries a
``hint``: the next thing to do. The FUSE layer maps these to errno values in
exactly one table (``irdma.fs.errors``).
"""

from __future__ import annotations


class IrdmaError(Exception):
    """Base class of every irdma error.

    Args:
        message: what went wrong, with the inputs that made it go wrong.
        hint: what the user should do next (shown by the CLI).
    """

    hint: str = ""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        if hint:
            self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} ({self.hint})" if self.hint else base


def message_of(exc: BaseException | str) -> str:
    """An error's message without its hint (an :class:`IrdmaError`'s ``str`` appends it): for
    a new error that says the same, whose own hint is added once."""
    if isinstance(exc, IrdmaError) and exc.args:
        return str(exc.args[0])
    return str(exc)


class LocalProtocolError(IrdmaError):
    """The caller asked for something the protocol cannot express (our fault)."""


class RemoteProtocolError(IrdmaError):
    """The peer sent bytes that break the protocol (their fault)."""


class BadRequest(IrdmaError):
    """A request that is well formed but not valid: it was refused and changed nothing."""


class NoSpace(IrdmaError):
    """A shard's memory region is full (ENOSPC); nothing was written."""

    hint = "free space (rm files, `irdma snapshot delete`, `irdma gc`) or add a shard (`irdma shard add`)"


class NotFound(IrdmaError):
    """A path or inode does not exist (ENOENT)."""


class Exists(IrdmaError):
    """The target already exists (EEXIST)."""


class NotADirectory(IrdmaError):
    """A path component is not a directory (ENOTDIR)."""


class IsADirectory(IrdmaError):
    """A file operation was asked of a directory (EISDIR)."""


class NotEmpty(IrdmaError):
    """A directory to remove or replace is not empty (ENOTEMPTY)."""


class NoAttribute(IrdmaError):
    """An extended attribute does not exist (ENODATA)."""


class InvalidArgument(IrdmaError):
    """An argument out of its domain, such as an unknown update op (EINVAL)."""


class NameTooLong(InvalidArgument):
    """A file name longer than 255 bytes (ENAMETOOLONG)."""


class NotPermitted(IrdmaError):
    """The operation is not permitted on this kind of object, such as a hard link to a
    directory (EPERM)."""


class QuotaExceeded(IrdmaError):
    """A limit the namespace sets was reached, such as a directory's
    ``user.irdma.max_snapshots`` (EDQUOT); nothing was made."""


class ReadOnly(IrdmaError):
    """A change asked of a read-only object: a snapshot's files (EROFS)."""


class Busy(IrdmaError):
    """The object is in use and cannot change that way now (EBUSY)."""


class ShardUnavailable(IrdmaError):
    """A shard could not be reached or dropped the connection (EIO)."""

    hint = "check `irdma shard list`; restart the shard or the cluster (`irdma up`)"


class DataLost(IrdmaError):
    """Bytes the metadata records as written are gone from their shard (EIO): the shard
    restarted and lost its memory, or the chunk was freed behind the namespace's back. Never
    answered with zeros."""

    hint = "`irdma status` and `irdma fsck` list the damaged files; rewrite them or restore a checkpoint"


class Stale(IrdmaError):
    """The inode was removed (ESTALE): the kernel looks the path up again."""


class MetadataError(IrdmaError):
    """The metadata database failed (EIO): the message names the database error."""

    hint = "check the metadata database (disk full? permissions?) and retry"


class TransportUnavailable(IrdmaError):
    """The requested transport cannot run on this machine (missing device, memlock limit)."""


class ReplicaError(ShardUnavailable):
    """A replica of a chain failed while the head applied an update (chain replication).

    Attributes:
        shard_id: the replica concerned.
    """

    def __init__(self, message: str, shard_id: int, hint: str = "") -> None:
        super().__init__(message, hint)
        self.shard_id = shard_id


class ReplicaFailed(ReplicaError):
    """A replica did not take a forwarded update in time; every replica before it has it. The
    client marks it down and retries the same request id along the shorter chain."""


class ReplicaStale(ReplicaError):
    """A replica's chunk does not follow its predecessor's (it missed updates while down);
    raised only by the shard code, which then sends it the whole chunk."""


class Fenced(ShardUnavailable):
    """The request acted on a view of the shard map older than one the shard has seen: read
    the shard map again and retry."""


class Dirty(ShardUnavailable):
    """A clean read found a chunk whose last update is not yet on every replica: read it from
    the chain's tail."""


class AuthFailed(IrdmaError):
    """A peer did not prove it holds the cluster key, refused ours, belongs to another cluster,
    or a frame's authentication tag did not verify (see :mod:`irdma.wire.auth`)."""


# ---------------------------------------------------------------- synchronization (irdma.client.coord)
class SyncTimeout(IrdmaError):
    """A barrier, lock or clock wait reached its deadline (ETIMEDOUT through the mount)."""


class SyncInterrupted(IrdmaError):
    """A wait ended because its caller was interrupted: a signal to the process waiting
    through the mount (EINTR; a barrier arrival is withdrawn first)."""


class SyncDenied(IrdmaError):
    """The caller's uid may not use a sync object: its permission bits, or its directory's,
    do not let it (EACCES through the mount)."""
