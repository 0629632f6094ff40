"""What a Keras optimizer is on the shards: the update op (:class:`irdma.wire.protocol.Update`)
that applies its step there with its arguments (:mod:`irdma.wire.optimizers`: Keras 3's names,
defaults and float32 arithmetic), and its learning rate as it was given or at a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from .._errors import InvalidArgument
from ..wire.optimizers import ARGUMENTS, parse_update
from ..wire.protocol import Update


def update_of(optimizer: keras.optimizers.Optimizer) -> Update:
    """The shard update op that applies ``optimizer``'s step, with its arguments at its initial
    learning rate (a schedule: at step 0).

    Raises:
        InvalidArgument: an optimizer the shards do not apply (SGD with momentum and Nesterov,
            Adam, AdamW, Adagrad, RMSprop are), or one that uses what they cannot do
            (``amsgrad``, ``use_ema``, gradient accumulation, a loss scale).
    """
    cfg = optimizer.get_config()
    kinds = {keras.optimizers.SGD: "sgd", keras.optimizers.Adam: "adam", keras.optimizers.AdamW: "adam",
             keras.optimizers.Adagrad: "adagrad", keras.optimizers.RMSprop: "rmsprop"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        raise InvalidArgument(f"the shards do not apply {type(optimizer).__name__}",
                              "wrap SGD, Adam, AdamW, Adagrad or RMSprop")
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


__all__ = ["update_of", "learning_rate_of"]
