"""Server-side optimizers: one step of SGD, Adam, Adagrad, RMSprop or FTRL on a chunk's elements.

Where the state lives
---------------------
A chunk of a file whose update op is an optimizer has a *state chunk* beside it on every shard
that holds the chunk: chunk index ``STATE_BASE + i`` of the same file id (no real file reaches
that index: 2^62 chunks). It is allocated, persisted (the data directory's index), freed and,
for a replica brought level by a whole-chunk copy, copied with its chunk, so the state is
replicated and persisted exactly as the weights are. Its layout (``chunk_size`` = the data
chunk's size in bytes, ``n = chunk_size // 4`` elements)::

    [0, 4096)                     header: magic b"IRST", u8 op (irdma.wire.protocol.UpdateOp), zeros
    [4096 + k*chunk_size, ...)    slot k: n little-endian float32 (or u32 for ``step``)

    sgd      slot 0 momentum
    adam     slot 0 m (first moment), slot 1 v (second moment), slot 2 step (u32)
    adagrad  slot 0 accumulator (starts at initial_accumulator_value)
    rmsprop  slot 0 velocity, slot 1 momentum, slot 2 average gradient (centered)
    ftrl     slot 0 accumulator (starts at initial_accumulator_value), slot 1 linear

Adam's step is counted *per element* (how many gradients reached it), not per chunk: Keras
counts steps per optimizer and applies each to every variable once, which per element is the
same count, and per element stays right when a chunk holds several tensors pushed separately
(the unified buffer of SoftMemoryBox II) or a push covers part of a chunk.

The arithmetic follows Keras 3 (``keras/src/optimizers/{sgd,adam,adagrad,rmsprop,ftrl}.py``)
operation by operation in float32 (IEEE-754, round to nearest even): the hyperparameters are
cast to float32 as ``ops.cast`` does, and ``1 - beta`` is formed in float64 first, as Python
does before TensorFlow converts it. A different optimizer name than the header's starts the
state afresh (zeros; Adagrad's initial accumulator); a new learning rate or other argument keeps
it. A gradient must be float32-aligned (offset and length multiples of 4).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from irdma.wire.extents import row_view
from irdma.wire.optimizers import (  # noqa: F401  (the state layout, shared with the client)
    HEADER,
    MAGIC,
    SLOT_NAMES,
    SLOTS,
    STATE_BASE,
    header_op,
    is_state,
    slot_names,
    state_index,
    state_size,
)
from irdma.wire.protocol import OPT_CENTERED, OPT_NESTEROV, Update, UpdateOp

_F32 = np.float32


def init_state(update: Update, state: memoryview, chunk_size: int) -> None:
    """Make ``state`` a fresh state for ``update``'s optimizer (the header, zeros; Adagrad's
    accumulators at ``initial_accumulator_value``)."""
    state[:] = bytes(len(state))
    state[:4] = MAGIC
    state[4] = int(update.op)
    if update.op in (UpdateOp.ADAGRAD, UpdateOp.FTRL):  # both: the accumulator in slot 0
        acc = np.frombuffer(state[HEADER : HEADER + chunk_size], dtype="<f4")
        acc[:] = _F32(update.args[1])


def _slot(state: memoryview, chunk_size: int, k: int, start: int, stop: int, dtype: str = "<f4") -> np.ndarray:
    base = HEADER + k * chunk_size
    return np.frombuffer(state[base + start : base + stop], dtype=dtype)


def apply(update: Update, weights: memoryview, grad: memoryview | bytes, state: memoryview, chunk_size: int,
          offset: int) -> None:
    """Apply one optimizer step to the float32 elements ``weights`` (bytes ``[offset,
    offset+len(grad))`` of the chunk) with the float32 gradient ``grad``, using and updating the
    chunk's ``state`` (which the caller made with :func:`init_state` for this op).

    Raises nothing for well-formed input; the caller checks alignment and ranges.
    """
    stop = offset + len(grad)
    _step(update, np.frombuffer(weights, dtype="<f4"), np.frombuffer(grad, dtype="<f4"),
          lambda k, dtype: _slot(state, chunk_size, k, offset, stop, dtype))


def apply_region(update: Update, region: memoryview, grad: np.ndarray, weights: np.ndarray, states: np.ndarray,
                 slot_stride: int) -> None:
    """One optimizer step on float32 elements anywhere in a shard's memory region: the rows of
    a sparse push to many chunks at once (one gather, step and scatter for the whole request,
    not one per chunk). ``weights``: each element's index in ``region`` seen as float32 (int64,
    distinct); ``states``: the index of its state's slot 0 element (slot ``k`` is ``k *
    slot_stride`` further: ``chunk_size // 4``, the layout of the module docstring; a u32 slot
    reads the same positions as u32); ``grad``: float32, one value per element, in the same
    order. Element for element the same float32 arithmetic as :func:`apply` (elementwise
    operations only), so a push of 10,000 rows over 60 chunks costs a few numpy passes.

    Raises nothing for well-formed input; the caller checks alignment, ranges, that each
    element's chunk and state exist and that no element is named twice.
    """
    f32 = np.frombuffer(region, dtype="<f4")
    gathered: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def slot(k: int, dtype: str) -> np.ndarray:
        whole = f32 if dtype == "<f4" else np.frombuffer(region, dtype=dtype)
        at = states + k * slot_stride
        got: np.ndarray = whole[at]
        gathered.append((whole, at, got))
        return got

    var = f32[weights]
    _step(update, var, grad, slot)
    f32[weights] = var
    for whole, at, got in gathered:
        whole[at] = got


def apply_rows(update: Update, region: memoryview, grad: np.ndarray, weights: np.ndarray, states: np.ndarray,
               slot_stride: int) -> None:
    """:func:`apply_region` for rows of one length: ``weights``, ``states`` (int64) are the byte
    offsets in ``region`` of each row and of its state's slot 0 (slot ``k`` is ``k *
    slot_stride`` bytes further), ``grad`` the rows' gradients (float32, shape ``(rows,
    row_bytes // 4)``). Each row is taken out and put back as one element of ``row_bytes``
    bytes (one ``memcpy``, :func:`irdma.wire.extents.move`'s view), not float by float: the
    same float32 arithmetic, 3-4x fewer cycles on rows of 256 bytes here.

    Raises nothing for well-formed input (as :func:`apply_region`).
    """
    rows, per = grad.shape
    raw = np.frombuffer(region, dtype=np.uint8)
    whole = row_view(raw, 4 * per)
    gathered: list[tuple[np.ndarray, np.ndarray]] = []

    def slot(k: int, dtype: str) -> np.ndarray:
        at = states + k * slot_stride
        got = whole[at]
        gathered.append((at, got))
        typed: np.ndarray = got.view(dtype).reshape(rows, per)
        return typed

    taken = whole[weights]
    _step(update, taken.view("<f4").reshape(rows, per), grad, slot)
    whole[weights] = taken
    for at, got in gathered:
        whole[at] = got


def _step(update: Update, var: np.ndarray, g: np.ndarray, slot: Callable[[int, str], np.ndarray]) -> None:
    """The step itself, in place on ``var`` and on the state arrays ``slot(k, dtype)`` gives
    (views of the state, or gathered copies the caller writes back)."""
    a = update.args
    lr = _F32(a[0])
    with np.errstate(all="ignore"):  # a step to inf/nan is what Keras would compute too
        if update.op == UpdateOp.SGD:
            momentum = a[1]
            if momentum != 0:
                m = slot(0, "<f4")
                mu = _F32(momentum)
                m[:] = m * mu - g * lr
                if update.flags & OPT_NESTEROV:
                    var += m * mu - g * lr
                else:
                    var += m
            else:
                var -= g * lr
        elif update.op == UpdateOp.ADAM:
            beta_1, beta_2, eps = a[1], a[2], a[3]
            m = slot(0, "<f4")
            v = slot(1, "<f4")
            step = slot(2, "<u4")
            step += 1
            local_step = step.astype(_F32)
            beta_1_power = np.power(_F32(beta_1), local_step)
            beta_2_power = np.power(_F32(beta_2), local_step)
            alpha = lr * np.sqrt(_F32(1) - beta_2_power) / (_F32(1) - beta_1_power)
            m += (g - m) * _F32(1 - beta_1)
            v += (np.square(g) - v) * _F32(1 - beta_2)
            var -= (m * alpha) / (np.sqrt(v) + _F32(eps))
        elif update.op == UpdateOp.ADAGRAD:
            eps = a[2]
            acc = slot(0, "<f4")
            acc += np.square(g)
            var -= (lr * g) / np.sqrt(acc + _F32(eps))
        elif update.op == UpdateOp.RMSPROP:
            rho, momentum, eps = a[1], a[2], a[3]
            velocity = slot(0, "<f4")
            velocity[:] = _F32(rho) * velocity + _F32(1 - rho) * np.square(g)
            if update.flags & OPT_CENTERED:
                avg = slot(2, "<f4")
                avg[:] = _F32(rho) * avg + _F32(1 - rho) * g
                denominator = velocity - np.square(avg) + _F32(eps)
            else:
                denominator = velocity + _F32(eps)
            increment = (lr * g) / np.sqrt(denominator)
            if momentum > 0:
                velocity_m = slot(1, "<f4")
                velocity_m[:] = _F32(momentum) * velocity_m + increment
                var -= velocity_m
            else:
                var -= increment
        elif update.op == UpdateOp.FTRL:
            # Keras's Ftrl.update_step at learning_rate_power -0.5, beta 0, no shrinkage
            # (irdma.wire.optimizers.FIXED): FTRL-Proximal, McMahan et al., KDD 2013, Algorithm 1
            l1, l2 = _F32(a[2]), _F32(a[3])
            acc = slot(0, "<f4")
            linear = slot(1, "<f4")
            new_acc = acc + np.square(g)
            half = _F32(0.5)
            linear += g - ((np.power(new_acc, half) - np.power(acc, half)) / lr) * var
            quadratic = np.power(new_acc, half) / lr + _F32(2) * l2
            var[:] = (np.clip(linear, -l1, l1) - linear) / quadratic
            acc[:] = new_acc
        else:  # pragma: no cover - callers dispatch only optimizer ops here
            raise ValueError(f"{update.op!r} is not an optimizer")
