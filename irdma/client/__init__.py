"""The native client: a namespace of files striped in chunks over shards.

* :mod:`.view` (:class:`~.view.ShardView`): the shard map and its epoch, where chunks are
  placed, their replication chains, the health seen of each shard; it opens no connection.
* :mod:`.pool` (:class:`~.pool.ShardPool`, over the view): the connections to shards, each
  shard's window of requests in flight, deadlines (one watchdog per client) and the shards held
  out after a failure.
* :mod:`.datapath` (:class:`~.datapath.DataPath`, over the view and the pool): pulls and pushes
  by layout with update ops, one retry engine for every chained update, flush, truncate;
  :mod:`.sparse` (rows by GATHER and SCATTER) and :mod:`.optstate` (optimizer state images)
  send theirs through it; :mod:`.readcache` serves reads from a local cache.
* :mod:`.native` (:class:`~.native.Client`): the facade over them, and the path API over the
  metadata engine.
* :mod:`.moves` (over the view and the pool): the operator's moves of chunks (resync, drain,
  rebalance); :mod:`.snapshots`: snapshots of directories and files.
* :mod:`.sync` (:class:`~.sync.SyncClient`, :func:`~.sync.connect`): the same API for code
  without an event loop.

Below it: :mod:`irdma.wire`, :mod:`irdma.transport`, :mod:`irdma.meta`; it knows nothing of
FUSE (:mod:`irdma.fs` sits on top of it). Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .datapath import DataPath
    from .native import Client
    from .pool import ShardPool
    from .sync import SyncClient, connect
    from .view import ShardView

__getattr__, __dir__ = exports(__name__, {
    "Client": ".native", "DataPath": ".datapath", "ShardPool": ".pool", "ShardView": ".view",
    "SyncClient": ".sync", "connect": ".sync",
})
__all__ = ["Client", "DataPath", "ShardPool", "ShardView", "SyncClient", "connect"]
