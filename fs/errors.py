"""The one errno table: every irdma error that may cross into FUSE, and its errno.

Only ``pyfuse3.FUSEError`` may leave a request handler: pyfuse3 ends its main loop on
anything else, and every process using the mount then gets ENOTCONN. So :func:`fuse_errors`
turns an irdma error into its errno, and any other exception (a bug) into EIO, logged once
with its traceback: that request fails, the mount goes on serving. The pattern is 3FS's
``StatusCode::toErrno``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator

import pyfuse3

from irdma import _errors as E
from irdma._errors import SyncDenied, SyncInterrupted, SyncTimeout

log = logging.getLogger("irdma.fs")

ERRNO: dict[type[E.IrdmaError], int] = {
    E.NotFound: errno.ENOENT,
    E.Exists: errno.EEXIST,
    E.NotADirectory: errno.ENOTDIR,
    E.IsADirectory: errno.EISDIR,
    E.NotEmpty: errno.ENOTEMPTY,
    E.NoAttribute: pyfuse3.ENOATTR,
    E.NameTooLong: errno.ENAMETOOLONG,
    E.NotPermitted: errno.EPERM,
    E.InvalidArgument: errno.EINVAL,
    E.BadRequest: errno.EINVAL,
    E.Busy: errno.EBUSY,
    E.ReadOnly: errno.EROFS,
    E.QuotaExceeded: errno.EDQUOT,
    E.NoSpace: errno.ENOSPC,
    E.ShardUnavailable: errno.EIO,
    E.RemoteProtocolError: errno.EIO,
    E.LocalProtocolError: errno.EIO,
    E.TransportUnavailable: errno.EIO,
    E.DataLost: errno.EIO,
    E.MetadataError: errno.EIO,
    E.Stale: errno.ESTALE,
    E.AuthFailed: errno.EACCES,
    SyncTimeout: errno.ETIMEDOUT,
    SyncDenied: errno.EACCES,
    SyncInterrupted: errno.EINTR,
}
#: The errno of an unexpected exception (a bug): the request fails, the mount lives on.
FALLBACK_ERRNO = errno.EIO


def to_errno(exc: E.IrdmaError) -> int:
    """The errno of an irdma error: the entry of its nearest class in :data:`ERRNO`."""
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]
    return errno.EIO


@contextlib.contextmanager
def fuse_errors(what: str) -> Iterator[None]:
    """Turn an :class:`IrdmaError` raised inside into ``FUSEError(errno)``, and any other
    exception (but a cancellation) into ``FUSEError(EIO)`` with its traceback logged."""
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except E.IrdmaError as exc:
        code = to_errno(exc)
        if code == errno.EIO:
            log.error("%s failed: %s", what, exc)
        else:
            log.debug("%s: %s (%s)", what, exc, errno.errorcode.get(code, code))
        raise pyfuse3.FUSEError(code) from None
    except Exception:
        log.exception("%s failed with an unexpected error (a bug: please report it); answered EIO", what)
        raise pyfuse3.FUSEError(FALLBACK_ERRNO) from None
