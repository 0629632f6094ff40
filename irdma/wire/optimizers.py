"""Update ops as text: ``user.irdma.update`` values, parsed and printed (pure, no I/O).

A file's update op says what a write (a push) does to the bytes already on the shards:

``assign``
    overwrite (the default).
``add``
    element-wise float32 sum (ps-lite's push with a sum handle; SoftMemoryBox II's accumulate).
``sgd [learning_rate=F] [momentum=F] [nesterov=true|false]``
``adam [learning_rate=F] [beta_1=F] [beta_2=F] [epsilon=F]``
``adagrad [learning_rate=F] [initial_accumulator_value=F] [epsilon=F]``
``rmsprop [learning_rate=F] [rho=F] [momentum=F] [epsilon=F] [centered=true|false]``
``ftrl [learning_rate=F] [initial_accumulator_value=F] [l1_regularization_strength=F] [l2_regularization_strength=F]``
    a server-side optimizer step (MXNet's ``update_on_kvstore``, TensorFlow's parameter-server
    training): the bytes written are a *gradient* (little-endian float32, offset and length
    multiples of 4) and the shard applies one step of the optimizer to the elements written,
    with Keras 3's names, defaults and float32 arithmetic (``keras.optimizers.SGD`` and
    friends; Kingma & Ba, ICLR 2015 for Adam; Duchi et al., JMLR 2011 for Adagrad; Hinton's
    lecture 6e for RMSprop; McMahan et al., KDD 2013, "Ad Click Prediction: a View from the
    Trenches", for FTRL-Proximal, the recommendation models' choice). The optimizer state (momentum, moments, per-element step count)
    lives on the shard beside each chunk: see :mod:`irdma.server.optim`.

The Keras arguments that change what a step computes beyond these (``weight_decay``,
``clipnorm``, ``clipvalue``, ``global_clipnorm``, ``use_ema``, ``amsgrad``, ...) are refused:
clip or decay on the worker before the push. FTRL takes Keras's ``learning_rate_power``,
``beta`` and ``l2_shrinkage_regularization_strength`` at their defaults only (-0.5, 0, 0: the
paper's per-coordinate rate; fold a ``beta`` into ``l2_regularization_strength + beta / (2 *
learning_rate)``, which is what Keras computes). A learning-rate schedule is a rewrite of the xattr
with a new ``learning_rate``: the state is kept (only a different optimizer *name* starts it
afresh).

On the wire an update travels as :class:`irdma.wire.protocol.Update`: the op byte and, for the
optimizers, four float64 arguments and a flags word, in the order of :data:`ARGUMENTS`.
"""

from __future__ import annotations

import math

from .protocol import OPT_CENTERED, OPT_NESTEROV, Update, UpdateOp

#: Each optimizer's arguments in wire order, with Keras 3's defaults (float) or flag bits (bool).
ARGUMENTS: dict[UpdateOp, tuple[tuple[str, float], ...]] = {
    UpdateOp.SGD: (("learning_rate", 0.01), ("momentum", 0.0)),
    UpdateOp.ADAM: (("learning_rate", 0.001), ("beta_1", 0.9), ("beta_2", 0.999), ("epsilon", 1e-7)),
    UpdateOp.ADAGRAD: (("learning_rate", 0.001), ("initial_accumulator_value", 0.1), ("epsilon", 1e-7)),
    UpdateOp.RMSPROP: (("learning_rate", 0.001), ("rho", 0.9), ("momentum", 0.0), ("epsilon", 1e-7)),
    UpdateOp.FTRL: (("learning_rate", 0.001), ("initial_accumulator_value", 0.1), ("l1_regularization_strength", 0.0),
                    ("l2_regularization_strength", 0.0)),
}
#: Keras arguments the shards take at one value only: (the value, what to do instead).
FIXED: dict[UpdateOp, dict[str, tuple[float, str]]] = {
    UpdateOp.FTRL: {
        "learning_rate_power": (-0.5, "the shards apply FTRL-Proximal's 1/sqrt(n) rate only"),
        "beta": (0.0, "add beta / (2 * learning_rate) to l2_regularization_strength instead (what Keras does)"),
        "l2_shrinkage_regularization_strength": (0.0, "apply the shrinkage to the gradient on the worker"),
    },
}
#: Boolean arguments and the flag bit each sets.
FLAGS: dict[UpdateOp, tuple[tuple[str, int], ...]] = {
    UpdateOp.SGD: (("nesterov", OPT_NESTEROV),),
    UpdateOp.RMSPROP: (("centered", OPT_CENTERED),),
}
#: Keras arguments deliberately not taken on the shards, and what to do instead.
_REFUSED = {
    "weight_decay": "apply weight decay to the gradient on the worker",
    "clipnorm": "clip the gradient on the worker before the push",
    "clipvalue": "clip the gradient on the worker before the push",
    "global_clipnorm": "clip the gradients on the worker before the push",
    "use_ema": "keep an exponential moving average on the worker",
    "amsgrad": "use adam without amsgrad",
    "gradient_accumulation_steps": "accumulate on the worker, or push into an `add` file",
    "loss_scale_factor": "unscale the gradient on the worker",
}


def parse_update(text: str | bytes) -> Update:
    """Parse a ``user.irdma.update`` value.

    Args:
        text: e.g. ``"add"`` or ``"adam learning_rate=0.01 beta_1=0.8"`` (ASCII, arguments as
            ``name=value`` separated by spaces or commas, in any order).

    Returns:
        The update with every argument filled in (Keras defaults for those not given).

    Raises:
        ValueError: unknown op or argument, a value that is not a finite number (or
            ``true``/``false`` for the flags), a learning rate or epsilon that is not positive,
            a momentum, beta or rho outside [0, 1); the message names the valid choices.
    """
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    words = text.replace(",", " ").split()
    if not words:
        raise ValueError("empty update op: use assign, add, sgd, adam, adagrad, rmsprop or ftrl")
    op = UpdateOp.parse(words[0])
    if op in (UpdateOp.ASSIGN, UpdateOp.ADD):
        if len(words) > 1:
            raise ValueError(f"{op.name.lower()} takes no arguments, got {' '.join(words[1:])!r}")
        return Update(op)
    names = dict(ARGUMENTS[op])
    flags = dict(FLAGS.get(op, ()))
    values = dict(names)
    bits = 0
    for word in words[1:]:
        key, sep, raw = word.partition("=")
        if not sep or not raw:
            raise ValueError(f"{op.name.lower()}: argument {word!r} must be name=value")
        if key in _REFUSED:
            raise ValueError(f"{op.name.lower()}: {key} is not applied on the shards ({_REFUSED[key]})")
        fixed = FIXED.get(op, {}).get(key)
        if fixed is not None:
            try:
                same = float(raw) == fixed[0]
            except ValueError:
                same = False
            if not same:
                raise ValueError(f"{op.name.lower()}: {key} must be {fixed[0]:g} on the shards, not {raw} ({fixed[1]})")
            continue
        if key in flags:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{op.name.lower()}: {key} must be true or false, not {raw!r}")
            if raw.lower() in ("true", "1"):
                bits |= flags[key]
            continue
        if key not in names:
            valid = ", ".join([*names, *flags])
            raise ValueError(f"{op.name.lower()} has no argument {key!r}: use {valid}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{op.name.lower()}: {key}={raw!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{op.name.lower()}: {key} must be finite, not {raw}")
        values[key] = value
    _check(op, values)
    args = tuple(values[k] for k in names) + (0.0,) * (4 - len(names))
    return Update(op, args, bits)  # type: ignore[arg-type]


def _check(op: UpdateOp, values: dict[str, float]) -> None:
    name = op.name.lower()
    for key, value in values.items():
        if key in ("learning_rate", "epsilon") and not value > 0:
            raise ValueError(f"{name}: {key} must be > 0, not {value:g}")
        if key in ("beta_1", "beta_2", "rho") and not 0 <= value < 1:
            raise ValueError(f"{name}: {key} must be in [0, 1), not {value:g}")
        if key == "momentum" and not 0 <= value <= 1:
            raise ValueError(f"{name}: momentum must be in [0, 1], not {value:g}")
        if key == "initial_accumulator_value" and not value >= 0:
            raise ValueError(f"{name}: initial_accumulator_value must be >= 0, not {value:g}")
        if key.endswith("_regularization_strength") and not value >= 0:
            raise ValueError(f"{name}: {key} must be >= 0, not {value:g}")


def format_update(update: Update) -> str:
    """The canonical text of an update: its name, then every argument (``repr`` of the floats,
    so ``parse_update(format_update(u)) == u``)."""
    name = update.op.name.lower()
    if update.op in (UpdateOp.ASSIGN, UpdateOp.ADD):
        return name
    parts = [name] + [f"{k}={update.args[i]!r}" for i, (k, _) in enumerate(ARGUMENTS[update.op])]
    parts += [f"{k}={'true' if update.flags & bit else 'false'}" for k, bit in FLAGS.get(update.op, ())]
    return " ".join(parts)


def argument(update: Update, name: str) -> float:
    """One argument of an optimizer update by its Keras name.

    Raises:
        KeyError: the op has no such argument.
    """
    for i, (k, _) in enumerate(ARGUMENTS.get(update.op, ())):
        if k == name:
            return update.args[i]
    raise KeyError(name)


# ---------------------------------------------------------------- the state layout
# (shared by the shards, :mod:`irdma.server.optim`, and the client's state reads and restores)
#: Chunk indices from here on name state chunks (index ``STATE_BASE + i`` is chunk i's state).
STATE_BASE = 1 << 62
HEADER = 4096
MAGIC = b"IRST"
#: Slots of state per element for each optimizer.
SLOTS = {UpdateOp.SGD: 1, UpdateOp.ADAM: 3, UpdateOp.ADAGRAD: 1, UpdateOp.RMSPROP: 3, UpdateOp.FTRL: 2}
#: Slot names, in order (what :func:`slot_names` and ``irdma.Client.optimizer_state`` give).
SLOT_NAMES = {
    UpdateOp.SGD: ("momentum",),
    UpdateOp.ADAM: ("m", "v", "step"),
    UpdateOp.ADAGRAD: ("accumulator",),
    UpdateOp.RMSPROP: ("velocity", "momentum", "average_gradient"),
    UpdateOp.FTRL: ("accumulator", "linear"),
}


def state_index(chunk_index: int) -> int:
    """The chunk index of chunk ``chunk_index``'s state chunk."""
    return STATE_BASE + chunk_index


def is_state(chunk_index: int) -> bool:
    return chunk_index >= STATE_BASE


def state_size(op: UpdateOp, chunk_size: int) -> int:
    """Bytes of the state chunk of a ``chunk_size``-byte chunk (a multiple of 4096 when
    ``chunk_size`` is)."""
    return HEADER + SLOTS[op] * chunk_size


def slot_names(op: UpdateOp) -> tuple[str, ...]:
    return SLOT_NAMES[op]


def header_op(state: memoryview) -> UpdateOp | None:
    """The op a state chunk was made for, or None when it holds none yet (all zeros)."""
    if bytes(state[:4]) != MAGIC:
        return None
    return UpdateOp(state[4])
