"""The operator's tools: the ``irdma`` command and what it drives.

* :mod:`.cli`: the ``irdma`` command (click, rich); :mod:`.launch`: ``irdma run``, the launcher of training jobs.
* :mod:`.cluster`: starting, registering and stopping shard processes (``irdma up``/``down``).
* :mod:`.fsck`: checking the chunk map against the shards.
* :mod:`.info`: ``irdma info PATH``: a file's chunks and replicas, a directory's summary.
* :mod:`.stats` and :mod:`.metrics`: Prometheus metrics of shards and mounts, and ``irdma stats``.
* :mod:`.bench` and :mod:`.testbed`: ``irdma bench`` and multi-host test beds.
* :mod:`._proc`: child processes with deadlines.

The top layer: it may import every other one, and none imports it but :mod:`.metrics`
(counted in the client, the mount and the shards). Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .cli import main

__getattr__, __dir__ = exports(__name__, {"main": ".cli"})
__all__ = ["main"]
