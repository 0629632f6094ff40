"""What a Keras optimizer is on the shards: the update op (:class:`irdma.wire.protocol.Update`)
that applies its step there with its arguments (:mod:`irdma.wire.optimizers`: Keras 3's names,
defaults and float32 arithmetic), its learning rate as it was given or at a step, and its state
both ways: a shards' state image (:mod:`irdma.client.optstate`) as the variables Keras gives the
same optimizer (what a saved file holds, so that stock Keras loads it), and those variables as an
image again (what a restore writes to the shards).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._errors import InvalidArgument
from ..wire.optimizers import ARGUMENTS, FIXED, HEADER, MAGIC, SLOT_NAMES, parse_update, state_size
from ..wire.protocol import Update, UpdateOp

#: Every chunk size a job's parameters get (bytes; :func:`irdma.train.distributed.chunk_size_for`):
#: the powers of two from 4 KiB to 4 MiB.
CHUNK_SIZES = tuple(4096 << i for i in range(11))

log = logging.getLogger("irdma.keras")

#: Each shard state slot (:data:`irdma.wire.optimizers.SLOT_NAMES`) as the attribute of the Keras
#: optimizer that lists that slot's variable per model variable, in build order (Keras 3's
#: ``build()`` of ``keras/src/optimizers/{sgd,adam,adagrad,rmsprop}.py``; an empty list where the
#: optimizer's config does not use the slot, e.g. SGD without momentum). Adam's per-element
#: ``step`` is Keras's ``iterations``.
KERAS_SLOTS: dict[UpdateOp, dict[str, str]] = {
    UpdateOp.SGD: {"momentum": "momentums"},
    UpdateOp.ADAM: {"m": "_momentums", "v": "_velocities"},
    UpdateOp.ADAGRAD: {"accumulator": "_accumulators"},
    UpdateOp.RMSPROP: {"velocity": "_velocities", "momentum": "_momentums", "average_gradient": "_average_gradients"},
    UpdateOp.FTRL: {"accumulator": "_accumulators", "linear": "_linears"},
}


def update_of(optimizer: keras.optimizers.Optimizer) -> Update:
    """The shard update op that applies ``optimizer``'s step, with its arguments at its initial
    learning rate (a schedule: at step 0).

    Raises:
        InvalidArgument: an optimizer the shards do not apply (SGD with momentum and Nesterov,
            Adam, AdamW, Adagrad, RMSprop, Ftrl are), or one that uses what they cannot do
            (``amsgrad``, ``use_ema``, gradient accumulation, a loss scale).
    """
    cfg = optimizer.get_config()
    kinds = {keras.optimizers.SGD: "sgd", keras.optimizers.Adam: "adam", keras.optimizers.AdamW: "adam",
             keras.optimizers.Adagrad: "adagrad", keras.optimizers.RMSprop: "rmsprop", keras.optimizers.Ftrl: "ftrl"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise InvalidArgument(f"the shards do not apply {type(optimizer).__name__}",
                              "wrap SGD, Adam, AdamW, Adagrad, RMSprop or Ftrl")
    for name, (value, why) in FIXED.get(parse_update(kind).op, {}).items():
        if name in cfg and float(cfg[name]) != value:
            raise InvalidArgument(f"{type(optimizer).__name__}({name}={cfg[name]!r}) cannot run on the shards", why)
    for name, why in (("amsgrad", "use Adam without amsgrad"), ("use_ema", "keep an EMA on the worker"),
                      ("gradient_accumulation_steps", "accumulate on the worker"),
                      ("loss_scale_factor", "unscale the gradient before the optimizer")):
        if cfg.get(name):
            raise InvalidArgument(f"{type(optimizer).__name__}({name}={cfg[name]!r}) cannot run on the shards", why)
    words = [kind, f"learning_rate={_lr_at(learning_rate_of(optimizer), 0)!r}"]
    words += [f"{k}={float(cfg[k])!r}" for k, _ in ARGUMENTS[parse_update(kind).op][1:] if k in cfg]
    words += [f"{k}={'true' if cfg[k] else 'false'}" for k in ("nesterov", "centered") if k in cfg]
    return parse_update(" ".join(words))


def learning_rate_of(optimizer: keras.optimizers.Optimizer) -> Any:
    """``optimizer``'s learning rate as it was given: its
    :class:`keras.optimizers.schedules.LearningRateSchedule`, else its variable (or value).

    Keras's public ``optimizer.learning_rate`` evaluates a schedule at the current step, and Keras
    has no public name for the schedule itself: this is the one place that reads the optimizer's
    ``_learning_rate``.
    """
    return optimizer._learning_rate  # Keras keeps the schedule only here (see above)


def _lr_at(lr: Any, step: int) -> float:
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return float(lr(step))
    return float(keras.ops.convert_to_numpy(lr)) if not isinstance(lr, float | int) else float(lr)


def _spec(update: Update) -> str:
    from ..wire.optimizers import format_update

    return format_update(update)


def _with_learning_rate(update: Update, lr: float) -> Update:
    return dataclasses.replace(update, args=(lr, *update.args[1:]))


class SavedAsKeras:
    """What Keras saves of a :class:`irdma.train.distributed.DistributedOptimizer` (mixed into it):
    the wrapped optimizer's stock Keras class with its config and variables, its slots holding
    the shards' state, so that any Keras loads the file (without irdma: an Adam that predicts and
    trains on as the job's); :func:`irdma.train.callbacks.load_model` wraps it again (Horovod's
    ``hvd.load_model``). Keras names a saved object by ``obj.__class__`` (``serialize_keras_object``,
    the legacy ``.h5`` format's ``model_metadata``) and walks what ``dir(obj)`` lists (which
    follows ``__class__``).

    The host provides ``inner`` (the wrapped optimizer), ``update`` (its update op), ``rounds``,
    ``_job`` (``restore``, ``view``, ``view_key``, ``joined``, ``vars``, ``sizes``, ``layout``),
    ``_state_image()`` and Keras's optimizer attributes.
    """

    _job: Any
    update: Update
    rounds: int
    inner: Any
    built: bool
    iterations: Any
    _iterations: Any
    _learning_rate: Any
    _variables: list[Any]

    def _state_image(self) -> bytes:  # pragma: no cover - the host's
        raise NotImplementedError

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        job = self.__dict__.get("_job")
        return type(job.inner) if job is not None else type(self)

    def get_config(self) -> dict[str, Any]:
        """The wrapped optimizer's config (its stock Keras class's), at this optimizer's current
        learning rate; this optimizer's own options (``sync_timeout``, ``compress`` ...) are not
        in it: :func:`load_model` takes them."""
        config = self.inner.get_config()
        if not isinstance(self._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            config["learning_rate"] = float(keras.ops.convert_to_numpy(self._learning_rate))
        return dict(config)

    @property
    def variables(self) -> list[Any]:
        """Read eagerly from a built optimizer, the wrapped optimizer's variables as stock Keras
        has them (:meth:`_keras_optimizer`: ``iterations``, the learning rate, its slots holding
        the shards' state): what ``model.save`` to ``.h5``, ``model.summary`` and
        ``model.export`` read. This optimizer's own (``iterations``, the learning rate) otherwise."""
        if self.built and tf.executing_eagerly():
            return list(self._keras_optimizer().variables)
        return self._variables[:]

    def _fresh_keras_optimizer(self) -> keras.optimizers.Optimizer:
        """A new stock Keras optimizer from :meth:`get_config`, with this one's ``iterations``,
        built on the model's variables when this one is (its slots at Keras's initial values)."""
        opt = type(self.inner).from_config(self.get_config())
        opt.iterations.assign(self.iterations)
        if self.built:
            opt.build(self._job.vars)
        return opt

    def _keras_optimizer(self) -> keras.optimizers.Optimizer:
        """The wrapped optimizer as stock Keras has it, with this one's state: ``iterations``
        and the learning rate this one's, the slots the shards' state (:func:`fill_from_image`:
        read once per round of this worker) or a restored checkpoint's not yet written to them.
        Adam's step on the shards is per element; Keras has one, ``iterations``."""
        job = self._job
        key = (self.rounds, int(keras.ops.convert_to_numpy(self.iterations)), id(job.restore), job.joined, self.built)
        if job.view is not None and job.view_key == key:
            return job.view
        if isinstance(job.restore, keras.optimizers.Optimizer):
            view = job.restore
        else:
            view = self._fresh_keras_optimizer()
            op, total = self.update.op, 4 * sum(job.sizes)
            image = self._state_image() if self.built else b""
            size = None
            if image and job.joined and len(image) == image_bytes(op, total, job.layout.chunk_size):
                size = job.layout.chunk_size
            elif image:
                size = chunk_size_of_image(len(image), op, total, CHUNK_SIZES)
            if size is not None:
                fill_from_image(view, op, image, size, job.sizes)
            elif image:  # another optimizer's state on the shards (the next step starts this one's), or an image of unknown chunks
                log.warning("the optimizer state (%d bytes) is not %s's: the file gets %s's initial slots", len(image),
                            type(self.inner).__name__, type(self.inner).__name__)
        job.view, job.view_key = view, key
        return view

    def _image_at(self, restore: Any, chunk_size: int) -> bytes:
        """A restored checkpoint's state (a Keras optimizer's variables, or a state image) as a
        state image of the job's file under ``chunk_size``; b"" (with a warning) for an image whose
        chunk size cannot be told."""
        op, sizes = self.update.op, self._job.sizes
        total = 4 * sum(sizes)
        if isinstance(restore, bytes):
            if len(restore) == image_bytes(op, total, chunk_size):
                return restore
            was = chunk_size_of_image(len(restore), op, total, CHUNK_SIZES)
            if was is None:
                log.warning("a restored optimizer state of %d bytes fits no chunk size: the job's state starts afresh",
                            len(restore))
                return b""
            view = self._fresh_keras_optimizer()
            fill_from_image(view, op, restore, was, sizes)
            restore = view
        return image_of(restore, op, chunk_size, sizes)

    def _take_state_of(self, opt: keras.optimizers.Optimizer) -> None:
        """Take a stock Keras optimizer's state (as loaded from a file): its ``iterations`` and
        learning rate now, its slots (where it has them) as the state written to the shards at
        the next join or step."""
        self._iterations.assign(opt.iterations)
        lr, theirs = learning_rate_of(self), learning_rate_of(opt)
        if isinstance(lr, keras.Variable) and isinstance(theirs, keras.Variable):
            lr.assign(theirs)
        if self.built and len(opt.variables) == len(self._fresh_keras_optimizer().variables):
            self._job.restore = opt  # (Keras 3 loads no slots from an .h5 file: the shards' state stays)

    def save_own_variables(self, store: Any) -> None:
        """Keras saving (``model.save``, ``save_weights``, ``ModelCheckpoint``,
        ``BackupAndRestore``): the variables of the wrapped optimizer as stock Keras saves them
        (:meth:`_keras_optimizer`: its slots hold the shards' state, read now)."""
        self._keras_optimizer().save_own_variables(store)

    def load_own_variables(self, store: Any) -> None:
        """The inverse of :meth:`save_own_variables` (a file of stock Keras with the wrapped
        optimizer's class loads too): ``iterations`` and the learning rate now, the slots written
        to the shards (with the model's weights) at the next join or step. A file saved before
        (its ``irdma_state``: the shards' state image) restores as it did."""
        keys = list(store.keys())
        if "irdma_state" in keys:
            own = [k for k in keys if k != "irdma_state"]
            if len(own) == len(self._variables):
                for i, variable in enumerate(self._variables):
                    variable.assign(store[str(i)])
            self._job.restore = np.asarray(store["irdma_state"]).astype(np.uint8).tobytes()
            return
        opt = self._fresh_keras_optimizer()
        opt.load_own_variables(store)  # Keras's check: a file of other variables is skipped, with its warning
        if len(keys) == len(opt.variables):
            self._take_state_of(opt)


def _slot_variables(optimizer: keras.optimizers.Optimizer, op: UpdateOp, name: str) -> list[Any]:
    return [v for v in getattr(optimizer, KERAS_SLOTS[op].get(name, ""), None) or [] if v is not None]


def fill_from_image(optimizer: keras.optimizers.Optimizer, op: UpdateOp, image: bytes, chunk_size: int,
                    sizes: list[int]) -> None:
    """Set the slot variables of ``optimizer`` (a stock Keras optimizer of ``op``'s kind, built on
    the model's variables of ``sizes`` elements, in the file's order) to a shards' state image of
    the file (:meth:`irdma.Client.read_state`: per ``chunk_size``-byte chunk a 4096-byte header,
    then each slot's ``chunk_size // 4`` little-endian float32). Elements of chunks that hold no
    state of ``op`` (never stepped) keep Keras's initial value (Adagrad's
    ``initial_accumulator_value``, else zeros). ``iterations`` is the caller's."""
    per, n = state_size(op, chunk_size), sum(sizes)
    img = np.frombuffer(image, dtype=np.uint8).reshape(-1, per)
    mine = (img[:, :4] == np.frombuffer(MAGIC, np.uint8)).all(axis=1) & (img[:, 4] == int(op))
    stepped = np.repeat(mine, chunk_size // 4)[:n]
    for k, name in enumerate(SLOT_NAMES[op]):
        variables = _slot_variables(optimizer, op, name)
        if not variables:
            continue
        flat = np.ascontiguousarray(img[:, HEADER + k * chunk_size : HEADER + (k + 1) * chunk_size]).reshape(-1)
        values, start = flat.view("<f4")[:n], 0
        for var, size in zip(variables, sizes, strict=True):
            now = np.asarray(keras.ops.convert_to_numpy(var), dtype=np.float32).reshape(-1)
            var.assign(np.where(stepped[start : start + size], values[start : start + size], now).reshape(var.shape))
            start += size


def image_of(optimizer: keras.optimizers.Optimizer, op: UpdateOp, chunk_size: int, sizes: list[int]) -> bytes:
    """The inverse of :func:`fill_from_image`: a state image of the file (every chunk's header
    names ``op``) holding ``optimizer``'s slot variables, Adam's per-element step its
    ``iterations``; a slot the optimizer does not use is zeros (as the shards start it)."""
    n, per = sum(sizes), state_size(op, chunk_size)
    chunks = -(-4 * n // chunk_size)
    img = np.zeros((chunks, per), dtype=np.uint8)
    img[:, :4] = np.frombuffer(MAGIC, np.uint8)
    img[:, 4] = int(op)
    for k, name in enumerate(SLOT_NAMES[op]):
        slot = np.zeros(chunks * chunk_size // 4, dtype="<u4" if name == "step" else "<f4")
        if name == "step":
            slot[:n] = int(keras.ops.convert_to_numpy(optimizer.iterations))
        elif variables := _slot_variables(optimizer, op, name):
            slot[:n] = np.concatenate([np.asarray(keras.ops.convert_to_numpy(v), dtype="<f4").reshape(-1)
                                       for v in variables])
        img[:, HEADER + k * chunk_size : HEADER + (k + 1) * chunk_size] = slot.view(np.uint8).reshape(chunks, -1)
    return img.tobytes()


def image_bytes(op: UpdateOp, size: int, chunk_size: int) -> int:
    """Bytes of the state image of a ``size``-byte file under ``op`` and ``chunk_size``."""
    return -(-size // chunk_size) * state_size(op, chunk_size)


def chunk_size_of_image(nbytes: int, op: UpdateOp, size: int, sizes: tuple[int, ...]) -> int | None:
    """The chunk size (one of ``sizes``) under which a state image of a ``size``-byte file under
    ``op`` is ``nbytes`` long, or None when none is or more than one is."""
    fits = {cs for cs in sizes if image_bytes(op, size, cs) == nbytes}
    return fits.pop() if len(fits) == 1 else None


__all__ = ["CHUNK_SIZES", "KERAS_SLOTS", "SavedAsKeras", "chunk_size_of_image", "fill_from_image", "image_bytes", "image_of", "learning_rate_of",
           "update_of"]
