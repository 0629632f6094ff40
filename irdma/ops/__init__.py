"""The operator's tools: the ``irdma`` command and what it drives.

* :mod:`.cli`: the ``irdma`` command (click, rich); :mod:`.launch`: ``irdma run``, the launcher of training jobs.
* :mod:`.cluster`: starting, registering and stopping shard processes (``irdma up``/``down``).
* :mod:`.info`: ``irdma info PATH``: a file's chunks and replicas, a directory's summary.
* :mod:`.stats`: ``irdma stats`` (the collectors are :mod:`irdma.metrics`).
* :mod:`.bench` and :mod:`.testbed`: ``irdma bench`` and multi-host test beds.
* :mod:`.fstab` and :mod:`.cli.mount_helper`: ``mount -t fuse.irdma`` and fstab lines.

The top layer: it may import every other one (it assembles mounts and shards), and none
imports it (``tests/test_layers.py``); the namespace check is :mod:`irdma.client.fsck`, the
processes :mod:`irdma._proc`. Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .cli import main

__getattr__, __dir__ = exports(__name__, {"main": ".cli"})
__all__ = ["main"]
