"""irdma: an RDMA parameter server exposed as a POSIX filesystem.

Public names are re-exported here from private modules (as trio does); the heavy ones are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    BadRequest,
    Busy,
    DataLost,
    InvalidArgument,
    IrdmaError,
    LocalProtocolError,
    MetadataError,
    NoSpace,
    NotFound,
    RemoteProtocolError,
    ShardUnavailable,
    Stale,
    TransportUnavailable,
)

if TYPE_CHECKING:
    from .client import Client
    from .placement import DEFAULT_CHUNK_SIZE, Layout
    from .protocol import UpdateOp
    from .sync import SyncClient, connect

__version__ = "0.1.0"

#: Names loaded on first use (PEP 562), so that ``import irdma.protocol`` in a shard process,
#: or ``import irdma`` for its errors, does not load the client, trio and the metadata engines.
_LAZY = {
    "Client": ".client",
    "SyncClient": ".sync",
    "connect": ".sync",
    "UpdateOp": ".protocol",
    "Layout": ".placement",
    "DEFAULT_CHUNK_SIZE": ".placement",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'irdma' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Client",
    "SyncClient",
    "connect",
    "UpdateOp",
    "Layout",
    "DEFAULT_CHUNK_SIZE",
    "IrdmaError",
    "BadRequest",
    "NoSpace",
    "NotFound",
    "ShardUnavailable",
    "TransportUnavailable",
    "DataLost",
    "InvalidArgument",
    "Stale",
    "Busy",
    "MetadataError",
    "LocalProtocolError",
    "RemoteProtocolError",
]
