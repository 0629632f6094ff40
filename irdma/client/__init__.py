"""The native client: a namespace of files striped in chunks over shards.

* :mod:`.pool` (:class:`~.pool.ShardPool`): the connections to shards, each shard's window of
  requests in flight, deadlines (one watchdog per client) and the shards held out after a failure.
* :mod:`.native` (:class:`~.native.Client`): reads the shard map, places chunks, builds
  replication chains, pulls and pushes with update ops, with one retry engine for every
  chained update; the path API over the metadata engine.
* :mod:`.moves`: the operator's moves of chunks (resync, drain, rebalance).
* :mod:`.sync` (:class:`~.sync.SyncClient`, :func:`~.sync.connect`): the same API for code
  without an event loop.

Below it: :mod:`irdma.wire`, :mod:`irdma.transport`, :mod:`irdma.meta`; it knows nothing of
FUSE (:mod:`irdma.fs` sits on top of it). Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .native import Client
    from .pool import ShardPool
    from .sync import SyncClient, connect

__getattr__, __dir__ = exports(__name__, {
    "Client": ".native", "ShardPool": ".pool", "SyncClient": ".sync", "connect": ".sync",
})
__all__ = ["Client", "ShardPool", "SyncClient", "connect"]
