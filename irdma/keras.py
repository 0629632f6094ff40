"""``import irdma.keras as hvd``: data-parallel Keras on irdma, shaped as Horovod's Keras API.

The names (loaded with TensorFlow on first use of this module):

* :func:`init`, :func:`shutdown`, :func:`rank`, :func:`size`, :func:`local_rank`,
  :func:`job_dir`, :func:`shard_dataset`, :func:`barrier`: :mod:`irdma.train.world`;
  :class:`DistributedOptimizer`, ``Average`` and ``Sum`` (``op=`` of a BSP round):
  :mod:`irdma.train.distributed`, with :func:`load_model` (:mod:`irdma.train.callbacks`; Horovod's ``hvd.load_model``);
  :class:`BroadcastInitialWeights`, :class:`MetricAverageCallback`: :mod:`irdma.train.callbacks` (run the
  script with ``irdma run -n N -- python train.py``).
* ``callbacks`` (Horovod's ``hvd.callbacks``: ``BroadcastGlobalVariablesCallback``,
  ``MetricAverageCallback``, ``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``):
  :mod:`irdma.train.callbacks`; :func:`allreduce`, :func:`allgather`, :func:`broadcast` of small
  values through the shards: :mod:`irdma.train.collectives`; ``Compression``, ``local_size``,
  ``cross_rank``, ``cross_size``, ``is_initialized`` as Horovod has them.
* :class:`Embedding`: an embedding layer whose table lives on the shards
  (:mod:`irdma.train.embedding`).
* :class:`ShardOptimizer` (the optimizer step through a FUSE mount): :mod:`irdma.train.keras`.
* :class:`SnapshotCallback` (rank 0 snapshots the job directory at epoch ends: weights, the
  shards' optimizer state and ``keras-state.npz``, copy-on-write, no barrier) and
  :func:`restore_snapshot` (a new process resumes from one, bit-identically with one worker
  and deterministic ops): :mod:`irdma.train.keras`, docs/keras.md "Snapshots".
  P3 priorities, compression, layer dropping, the host hierarchy and DASO's global step are
  options of :class:`DistributedOptimizer`.
"""

from __future__ import annotations

from .train import callbacks
from .train.callbacks import BroadcastInitialWeights, MetricAverageCallback, load_model
from .train.collectives import allgather, allreduce, broadcast
from .train.distributed import Average, Compression, DistributedOptimizer, Sum
from .train.embedding import Embedding
from .train.keras import ShardOptimizer, SnapshotCallback, restore_snapshot
from .train.world import (
    barrier,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    job_dir,
    local_rank,
    local_size,
    rank,
    shard_dataset,
    shutdown,
    size,
)

__all__ = ["Average", "Sum", "Compression", "BroadcastInitialWeights", "DistributedOptimizer", "Embedding",
           "MetricAverageCallback", "ShardOptimizer", "SnapshotCallback", "allgather", "allreduce", "barrier",
           "broadcast", "callbacks", "cross_rank", "cross_size", "init", "is_initialized", "job_dir", "local_rank",
           "load_model", "local_size", "rank", "restore_snapshot", "shard_dataset", "shutdown", "size"]
