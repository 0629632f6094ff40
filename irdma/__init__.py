"""irdma: an RDMA parameter server exposed as a POSIX filesystem.

Public names are re-exported here from the modules that define them (as trio does); the heavy
ones are loaded on first use. The packages, bottom up:

* :mod:`irdma.wire`: the protocol's bytes, authentication, gradient encodings, framing.
* :mod:`irdma.transport`: how a client reaches shards (TCP, RDMA verbs).
* :mod:`irdma.meta`: the metadata engines (namespace, inodes, xattrs, chunk and shard maps).
* :mod:`irdma.client`: the native client (shard pool, chains, pull and push, moves).
* :mod:`irdma.train`: optimizers, consistency models, priorities, Keras.
* :mod:`irdma.ops`: the ``irdma`` command, clusters, fsck, metrics, benchmarks.
* ``irdma.fs`` (``fs/``): the FUSE mount; ``irdma.server`` (``server/``): the shards.

Beside them, shared by all: :mod:`irdma._errors`, :mod:`irdma.placement` (chunks to shards)
and :mod:`irdma.units`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from ._lazy import exports
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from .client.native import Client
    from .client.sync import SyncClient, connect
    from .placement import DEFAULT_CHUNK_SIZE, Layout
    from .wire.protocol import UpdateOp


#: Names loaded on first use (PEP 562), so that ``import irdma.wire.protocol`` in a shard process,
#: or ``import irdma`` for its errors, does not load the client, trio and the metadata engines.
_LAZY = {
    "Client": ".client.native",
    "SyncClient": ".client.sync",
    "connect": ".client.sync",
    "UpdateOp": ".wire.protocol",
    "Layout": ".placement",
    "DEFAULT_CHUNK_SIZE": ".placement",
}


__getattr__, __dir__ = exports(__name__, _LAZY)

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
