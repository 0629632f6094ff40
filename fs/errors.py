"""The one errno table: every irdma error that may cross into FUSE, and its errno.

Only ``pyfuse3.FUSEError`` may leave a request handler; any other exception is a bug, is
logged with its traceback by pyfuse3 and ends the main loop (the tests fail on it). The
pattern is 3FS's ``StatusCode::toErrno``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator

import pyfuse3

from irdma import _errors as E

log = logging.getLogger("irdma.fs")

ERRNO: dict[type[E.IrdmaError], int] = {
    E.NotFound: errno.ENOENT,
    E.Exists: errno.EEXIST,
    E.NotADirectory: errno.ENOTDIR,
    E.IsADirectory: errno.EISDIR,
    E.NotEmpty: errno.ENOTEMPTY,
    E.NoAttribute: pyfuse3.ENOATTR,
    E.NameTooLong: errno.ENAMETOOLONG,
    E.InvalidArgument: errno.EINVAL,
    E.BadRequest: errno.EINVAL,
    E.Busy: errno.EBUSY,
    E.NoSpace: errno.ENOSPC,
    E.ShardUnavailable: errno.EIO,
    E.RemoteProtocolError: errno.EIO,
    E.LocalProtocolError: errno.EIO,
    E.TransportUnavailable: errno.EIO,
}


def to_errno(exc: E.IrdmaError) -> int:
    """The errno of an irdma error: the entry of its nearest class in :data:`ERRNO`."""
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]  # type: ignore[index]
    return errno.EIO


@contextlib.contextmanager
def fuse_errors(what: str) -> Iterator[None]:
    """Turn an :class:`IrdmaError` raised inside into ``FUSEError(errno)``."""
    try:
        yield
    except E.IrdmaError as exc:
        code = to_errno(exc)
        if code == errno.EIO:
            log.error("%s failed: %s", what, exc)
        else:
            log.debug("%s: %s (%s)", what, exc, errno.errorcode.get(code, code))
        raise pyfuse3.FUSEError(code) from None
