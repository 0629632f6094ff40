"""The FUSE filesystem: POSIX requests translated to irdma client calls.

Importable only as ``irdma.fs`` (see setup.cfg). Decides no placement, and holds no data
beyond the mount's caches: :mod:`irdma.fs.operations` translates the requests,
:mod:`irdma.fs.cache` holds a file's pushes in flight (write-behind), its read-ahead windows and
the residuals of compressed pushes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IrdmaFS", "ERRNO", "to_errno"]


def __getattr__(name: str) -> Any:
    """The package's names, imported on first use: ``irdma.fs.options`` (what ``irdma`` and the
    fstab helper read) must not load pyfuse3, which a host without FUSE cannot."""
    if name == "IrdmaFS":
        from .operations import IrdmaFS

        return IrdmaFS
    if name in ("ERRNO", "to_errno"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
