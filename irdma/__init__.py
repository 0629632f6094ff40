"""irdma: an RDMA parameter server exposed as a POSIX filesystem.

Public names are re-exported here from the modules that define them (as trio does); the heavy
ones are loaded on first use. The packages, bottom up:

* the shared vocabulary: :mod:`irdma._errors`, :mod:`irdma.units`, :mod:`irdma.placement`
  (chunks to shards), :mod:`irdma.xattrs` (the job and communication xattrs),
  :mod:`irdma.metrics` (the Prometheus collectors), :mod:`irdma._proc` (process identity).
* :mod:`irdma.wire`: the protocol's bytes, authentication, gradient encodings, framing, the
  optimizer-state layout.
* :mod:`irdma.transport`: how a client reaches shards (TCP, RDMA verbs).
* :mod:`irdma.meta`: the metadata engines (namespace, inodes, xattrs, chunk and shard maps).
* :mod:`irdma.client`: the native client (shard pool, chains, pull and push, moves,
  consistency models and clocks, priorities, fsck).
* :mod:`irdma.train` (distributed training, Keras) beside ``irdma.fs`` (``fs/``: the FUSE
  mount) and ``irdma.server`` (``server/``: the shards): none of the three imports another.
* :mod:`irdma.ops`: the ``irdma`` command, clusters, benchmarks; :mod:`irdma.keras` on top.

An import never runs up this list (``tests/test_layers.py``).
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
