"""The FUSE filesystem: POSIX requests translated to irdma client calls.

Importable only as ``irdma.fs`` (see setup.cfg). Decides no placement, and holds no data
beyond the mount's caches: :mod:`irdma.fs.operations` translates the requests,
:mod:`irdma.fs.cache` holds a file's pushes in flight (write-behind), its read-ahead windows and
the residuals of compressed pushes.
"""

from .errors import ERRNO, to_errno
from .operations import IrdmaFS

__all__ = ["IrdmaFS", "ERRNO", "to_errno"]
