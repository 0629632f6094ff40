"""``hvd.callbacks``: Horovod's Keras callbacks under Horovod's names, for scripts that port by
their import line (``import irdma.keras as hvd``).

* :class:`BroadcastInitialWeights` (Horovod's name: :class:`BroadcastGlobalVariablesCallback`):
  every rank starts from rank ``root_rank``'s weights, the job's weights on the shards.
* :class:`MetricAverageCallback`: each epoch's logs averaged over the ranks.
* :class:`LearningRateWarmupCallback` and :class:`LearningRateScheduleCallback`: Horovod's
  learning-rate warm-up (Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1
  Hour", 2017: from ``initial_lr / size()`` to ``initial_lr`` over the first epochs) and
  multiplier schedule, set on the optimizer per batch as Horovod does; the shards take each
  step's learning rate from it. Horovod's ``momentum_correction`` (for a momentum optimizer, scale
  the momentum by the learning rate's change for one step) is not done: the momentum lives on the
  shards, where the step with the new learning rate uses it as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from .._errors import InvalidArgument, IrdmaError
from .distributed import MIN_CHUNK, Compression, DistributedOptimizer
from .world import _job_barrier, _member, _need, _world, job_dir, rank, size

log = logging.getLogger("irdma.keras")


class BroadcastInitialWeights(keras.callbacks.Callback):  # type: ignore[misc]
    """Join the job when training begins: rank ``root_rank`` (0) writes the model's initial
    weights, every rank takes them (Horovod's ``BroadcastGlobalVariablesCallback``)."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        if root_rank != 0:
            raise InvalidArgument(f"root_rank {root_rank}: rank 0 writes the initial weights", "pass 0")

    def on_train_begin(self, logs: Any = None) -> None:
        opt = self.model.optimizer
        if not isinstance(opt, DistributedOptimizer):
            raise InvalidArgument("BroadcastInitialWeights needs a model compiled with irdma.keras.DistributedOptimizer",
                                  "compile with optimizer=irdma.keras.DistributedOptimizer(...)")
        opt.build(self.model.trainable_variables)
        opt.attach(self.model)
        opt.join()
        if _world.get("rejoin") and _world.get("rejoin_epoch", 0) > (self.model._initial_epoch or 0):
            # a restarted worker goes on in the epoch the job is in, as BackupAndRestore does
            self.model._initial_epoch = _world["rejoin_epoch"]

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        """Record the epoch this worker began (a worker that rejoins starts at the slowest
        live worker's)."""
        client = _need("client")
        try:
            client.run(client.client.meta.member_beat, _member(), _need("rank"), epoch)
        except IrdmaError as exc:  # only a rejoining worker's first epoch depends on it
            log.warning("could not record epoch %d of rank %d (%s)", epoch, _need("rank"), exc)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Apply the pulls in flight (per-layer rounds), and with ``sync_every`` > 1 take the
        epoch's last global step, so that the callbacks after this one (checkpoints) see the
        job's weights."""
        self.model.optimizer.synchronize()
        self.model.optimizer.flush()

    def on_train_end(self, logs: Any = None) -> None:
        self.model.optimizer.synchronize()
        self.model.optimizer.flush()


class MetricAverageCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """At each epoch's end, replace every number in ``logs`` by its mean over the job's
    workers (Horovod's callback of this name), so that callbacks after it (put it first:
    ``ModelCheckpoint``, ``ReduceLROnPlateau``, ``EarlyStopping``) decide alike on every rank.

    Each rank writes its numbers to ``JOB/metrics/RUN-eEPOCH-rRANK.json`` in the namespace,
    passes a barrier, and reads every rank's.

    Raises:
        irdma.train.coord.SyncTimeout: a rank did not reach the epoch's end within
            ``timeout`` seconds (it says which barrier).
    """

    def __init__(self, timeout: float = 600.0) -> None:
        super().__init__()
        self.timeout = float(timeout)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None or size() == 1:
            return
        client, job, run = _need("client"), job_dir(), _world.get("run", "") or "run"
        mine = {k: float(v) for k, v in logs.items() if isinstance(v, int | float | np.number)
                or (hasattr(v, "shape") and np.ndim(v) == 0)}
        client.makedirs(f"{job}/metrics")
        client.write(f"{job}/metrics/{run}-e{epoch}-r{rank()}.json", json.dumps(mine).encode(), op="assign",
                     chunk_size=MIN_CHUNK)
        key = _job_barrier(f"metrics-{epoch}", self.timeout)
        arrived = client.run(client.client.meta.arrivals, _member(), key)
        every = [json.loads(bytes(client.read(f"{job}/metrics/{run}-e{epoch}-r{r}.json"))) for r in arrived]
        for key in mine:
            values = [d[key] for d in every if key in d]
            logs[key] = float(np.mean(values))


class BroadcastGlobalVariablesCallback(BroadcastInitialWeights):
    """Horovod's ``BroadcastGlobalVariablesCallback(root_rank)``: every rank begins with the
    weights rank ``root_rank`` wrote to the shards (``device`` is accepted and unused)."""

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__(root_rank)


class _LearningRateCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Sets the optimizer's learning rate at each batch from :meth:`rate` (epoch, as a fraction)."""

    def __init__(self, initial_lr: float, start_epoch: int, end_epoch: int | None, staircase: bool,
                 steps_per_epoch: int | None, verbose: int) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.start_epoch, self.end_epoch = int(start_epoch), end_epoch
        self.staircase = bool(staircase)
        self.steps_per_epoch = steps_per_epoch
        self.verbose = int(verbose)
        self.current_epoch = 0

    def rate(self, epoch: float) -> float:
        raise NotImplementedError

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps") or 1
        epoch = float(self.current_epoch) if self.staircase else self.current_epoch + batch / steps
        self.model.optimizer.learning_rate = self.rate(epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if self.verbose and epoch + 1 == self.end_epoch:
            print(f"\nEpoch {epoch + 1}: finished learning rate adjustment, lr {logs and logs.get('lr')}")


class LearningRateWarmupCallback(_LearningRateCallback):
    """Horovod's warm-up: over the first ``warmup_epochs`` epochs the learning rate goes from
    ``initial_lr / size()`` to ``initial_lr`` (linearly, per batch), for scripts that scale
    ``initial_lr`` by ``size()``; Goyal et al. 2017. ``momentum_correction`` is accepted and not
    done (see the module docstring)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(initial_lr, 0, warmup_epochs, False, steps_per_epoch, verbose)
        self.warmup_epochs = int(warmup_epochs)

    def rate(self, epoch: float) -> float:
        n = size()
        return self.initial_lr / n * (epoch * (n - 1) / max(1, self.warmup_epochs) + 1)


class LearningRateScheduleCallback(_LearningRateCallback):
    """Horovod's schedule: from ``start_epoch`` to ``end_epoch`` (excluded; None: to the end) the
    learning rate is ``initial_lr * multiplier`` (a number, or a function of the epoch: whole
    epochs with ``staircase``, else fractional per batch)."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(initial_lr, start_epoch, end_epoch, staircase, steps_per_epoch, verbose)
        self.multiplier = multiplier

    def rate(self, epoch: float) -> float:
        m = self.multiplier(epoch) if callable(self.multiplier) else self.multiplier
        return self.initial_lr * float(m)


__all__ = ["load_model", "BroadcastInitialWeights", "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback"]


def load_model(filepath: str, custom_optimizers: list[type] | None = None, custom_objects: dict[str, Any] | None = None,
               compression: str = Compression.none, **options: Any) -> Any:
    """Horovod's ``hvd.load_model``: ``keras.models.load_model(filepath)`` (``.keras``, ``.h5``; saved
    with a :class:`DistributedOptimizer` or a plain Keras optimizer), its optimizer wrapped in a
    :class:`DistributedOptimizer` (``compression``, ``options``: its arguments), the model compiled
    with it as saved (loss, metrics), and the loaded ``iterations``, learning rate and slots
    (Adam's moments ...) written to the job's shards with the weights when this worker joins
    (:func:`irdma.keras.init` first). A model without an optimizer, or saved by irdma before its
    files named stock classes, is returned as loaded. ``custom_optimizers``: classes the file
    names (Horovod's); ``custom_objects``: as ``keras.models.load_model`` takes them.

    Raises:
        InvalidArgument: an optimizer the shards do not apply (:func:`update_of`); what
            ``keras.models.load_model`` raises (no such file, an unknown class).
    """
    objects = {**{c.__name__: c for c in custom_optimizers or ()}, **(custom_objects or {})}
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    saved = getattr(model, "optimizer", None)
    if saved is None or isinstance(saved, DistributedOptimizer):
        return model
    opt = DistributedOptimizer(saved, compression=compression, **options)
    model.compile(**{**keras.saving.deserialize_keras_object(model.get_compile_config()), "optimizer": opt})
    if saved.built:
        opt.build(model.trainable_variables)
    opt._take_state_of(saved)
    return model
