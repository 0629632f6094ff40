"""Training on irdma: what a data-parallel job needs beyond pull and push.

* :mod:`.coord` and :mod:`.comm`: consistency models (BSP, SSP, ASP), per-worker clocks,
  barriers, locks; P3 priorities and layer dropping. The code is the client's
  (:mod:`irdma.client.coord`, :mod:`irdma.client.comm`; the mount uses them too), re-exported
  here under the names training code knows. The server-side optimizer update ops and their
  state layout are :mod:`irdma.wire.optimizers` (the shards, the mount and the client share them).
* :mod:`.hier` (with :mod:`._hier_wire`): hierarchical aggregation inside a host before the shards.
* :mod:`.costmodel`: the model that picks shard counts and placements for a job.
* :mod:`.distributed`: the Horovod-shaped Keras API (``import irdma.keras as hvd``):
  ``DistributedOptimizer`` wrapping any Keras SGD/Adam/AdamW/Adagrad/RMSprop/Ftrl, checkpoints that
  hold the shards' optimizer state, and as its options P3 and layer dropping (:mod:`.overlap`),
  compression, the host hierarchy and DASO's global step every K steps.
* :mod:`.keras`: ``ShardOptimizer`` (the step through a FUSE mount).

Built on :mod:`irdma.client`; nothing below imports it, nor the mount or the shards
(``tests/test_layers.py``). Names are re-exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from irdma._lazy import exports

if TYPE_CHECKING:
    from .coord import Consistency

__getattr__, __dir__ = exports(__name__, {"Consistency": ".coord"})
__all__ = ["Consistency"]
