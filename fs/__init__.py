"""The FUSE filesystem: POSIX requests translated to irdma client calls.

Importable only as ``irdma.fs`` (see setup.cfg). Holds no data and decides no placement.
"""

from .errors import ERRNO, to_errno
from .operations import IrdmaFS

__all__ = ["IrdmaFS", "ERRNO", "to_errno"]
