"""irdma: an RDMA parameter server exposed as a POSIX filesystem.

Public names are re-exported here from private modules (as trio does).
"""

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
from .client import Client
from .placement import DEFAULT_CHUNK_SIZE, Layout
from .protocol import UpdateOp
from .sync import SyncClient, connect

__version__ = "0.1.0"

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
