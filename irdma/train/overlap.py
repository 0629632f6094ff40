"""P3 and layer dropping inside ``model.fit``: the per-layer rounds of
:class:`irdma.keras.DistributedOptimizer` with ``overlap="p3"`` or ``"fifo"``.

P3 (Jayarajan et al., "Priority-based Parameter Propagation for Distributed DNN Training",
SysML 2019) inside Keras's compiled train step, with no trainer of its own:

* **Pushes overlap back-propagation.** The optimizer's ``apply`` makes one ``tf.py_function``
  per layer (a *group*: the variables one layer owns), last layer first, each taking only that
  layer's gradients. TensorFlow runs an op as soon as its inputs are ready, so a layer's push
  starts (:meth:`irdma.client.sync.SyncClient.submit`: it returns at once, the transfer runs on
  the client's loop) while the earlier layers' gradients are still being computed.
* **By priority, in slices.** With ``"p3"`` each layer's requests go at priority = its index in
  the forward pass (0 first) in slices of ``slice_elems`` float32 (P3's 40,000 by default):
  :func:`irdma.train.comm.priority`. ``"fifo"`` sends whole tensors in arrival order, the
  baseline P3 is measured against.
* **Pulls overlap the next forward pass.** At the round's end (every push acknowledged, the
  worker's clock ticked: BSP/SSP wait here) every layer's pull starts, by priority, and the step
  returns. Each layer's ``call`` waits for its own pull only (a ``tf.py_function`` the layer's
  variable reads depend on), so the next forward pass runs layer 0 while the big later layers
  are still arriving. The hooks are installed on the model by
  :class:`irdma.keras.BroadcastInitialWeights` (``attach``); without it the round waits for its
  pulls at its end. Pulls still in flight are applied before anything reads the weights from
  outside a forward pass (a checkpoint, ``pull_weights``, the end of ``fit``, each epoch's end).

Layer dropping (the seed paper, Applied Sciences 2020) with ``drop=T``: a layer's push is
skipped while ``learning_rate * ||accumulated gradient||_1 < T * ||weights||_1``; the gradient
waits in a :class:`irdma.train.comm.ResidualCache` on the worker and goes with the layer's next
push (nothing computed is lost). A skipped layer is still pulled (the other workers' updates).
Under BSP a skipped layer's push is a zero contribution to the job's round (a top-k payload of
one zero element), so the round, which sums every worker's contribution to each range, never
waits for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from .._concurrency import open_nursery
from .._errors import InvalidArgument
from ..wire.compress import Compression
from ..wire.protocol import Encoding, UpdateOp
from . import comm

#: What ``overlap=`` takes.
OVERLAPS = ("none", "fifo", "p3")


#: A dropped layer's zero contribution to a BSP round: top-k keeping one element (of zero).
EMPTY = Compression(Encoding.TOPK, fraction=1e-12)


def check(overlap: str, slice_elems: int, drop: float) -> None:
    """Raises InvalidArgument for a bad ``overlap``, ``slice_elems`` or ``drop``."""
    if overlap not in OVERLAPS:
        raise InvalidArgument(f"overlap={overlap!r}", f"use one of {', '.join(OVERLAPS)}")
    if isinstance(slice_elems, bool) or not isinstance(slice_elems, int) or not 0 <= slice_elems < 1 << 28:
        raise InvalidArgument(f"slice_elems={slice_elems!r}", "float32 elements per slice, e.g. 40000 (P3's); 0: none")
    if not (0.0 <= drop <= 1.0):
        raise InvalidArgument(f"drop={drop!r}", "a relative L1 threshold in [0, 1], e.g. 0.001; 0: never drop")


def _runs(indices: list[int], offsets: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """The element ranges ``[a, b)`` of the flat parameters the variables ``indices`` cover,
    adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for i in sorted(indices, key=lambda i: offsets[i]):
        a, b = offsets[i], offsets[i] + sizes[i]
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class Rounds:
    """The per-layer rounds of one optimizer (see the module docstring).

    Args:
        overlap: ``"fifo"`` or ``"p3"``.
        slice_elems: P3's slice (float32 elements; 0: none).
        drop: layer dropping's relative threshold (0: never).
        variables: the optimizer's variables, in the flat layout's order.
        sizes: their element counts.
    """

    def __init__(self, overlap: str, slice_elems: int, drop: float, variables: list[Any], sizes: list[int]) -> None:
        self.overlap, self.slice_bytes = overlap, 4 * slice_elems if overlap == "p3" else 0
        self.vars, self.sizes = variables, sizes
        self.offsets = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
        self.groups: list[list[int]] = []  # variable indices per layer, in forward order
        self.runs: list[list[tuple[int, int]]] = []
        self.pieces: list[list[tuple[int, int, int]]] = []
        self.hooked: set[int] = set()  # groups whose layer waits for its own pull
        self.pending: dict[int, Any] = {}  # group -> future of its pulled weights (float32, flat)
        self.pushes: list[Any] = []
        self.cache = comm.ResidualCache(drop) if drop else None
        self.residuals: dict[int, np.ndarray] = {}  # compression's error feedback, per group
        self.pushed = self.skipped = self.waited_in_forward = 0
        self.pushed_bytes = 0  # push payload (gradients after compression, and weight decay), bytes
        self.started = False  # a round's first push happened (join, a restored checkpoint)
        #: An ASP job: no clock wait comes between a layer's push and its pull, so each layer's
        #: pull follows its own push at once (in the same task), overlapping back-propagation too.
        self.asp = False

    # ------------------------------------------------------------ layers
    def group_by_path(self) -> None:
        """Groups from the variables' paths (``model/layer/kernel``: one per layer), when no
        model was attached before the first step."""
        if self.groups:
            return
        by: dict[str, list[int]] = {}
        for i, v in enumerate(self.vars):
            by.setdefault(str(getattr(v, "path", i)).rsplit("/", 1)[0], []).append(i)
        self._set(list(by.values()))

    def attach(self, model: Any, wait: Callable[[int], int]) -> None:
        """One group per layer that owns trainable variables, in the model's layer order, and a
        hook in each such layer's ``call`` that runs ``wait(group)`` before its variables are
        read. Variables of no layer found form a last group without a hook."""
        if self.groups:
            return
        index = {id(v): i for i, v in enumerate(self.vars)}
        groups, layers = [], []
        for layer in model._flatten_layers(include_self=False):
            own = [index.pop(id(v)) for v in getattr(layer, "_trainable_variables", []) if id(v) in index]
            if own:
                groups.append(own)
                layers.append(layer)
        if index:
            groups.append(sorted(index.values()))
        self._set(groups)
        for g, layer in enumerate(layers):
            _hook(layer, functools.partial(wait, g))
            self.hooked.add(g)

    def _set(self, groups: list[list[int]]) -> None:
        self.groups = groups
        self.runs = [_runs(g, self.offsets, self.sizes) for g in groups]
        per = self.slice_bytes // 4
        self.pieces = []  # per group: (file element, buffer element, count), at most one slice each
        for runs in self.runs:
            out, at = [], 0
            for a, b in runs:
                step = per or b - a
                out += [(x, at + x - a, min(step, b - x)) for x in range(a, b, step)]
                at += b - a
            self.pieces.append(out)

    def flat(self, g: int, arrays: list[Any]) -> np.ndarray:
        """Group ``g``'s tensors (in the group's order) as one float32 buffer in run order."""
        order = sorted(range(len(self.groups[g])), key=lambda j: self.offsets[self.groups[g][j]])
        return np.concatenate([np.asarray(arrays[j], dtype="<f4").ravel() for j in order])

    def scatter(self, g: int, flat: np.ndarray) -> None:
        """Assign group ``g``'s variables from ``flat`` (run order)."""
        at = 0
        for i in sorted(self.groups[g], key=lambda i: self.offsets[i]):
            v, n = self.vars[i], self.sizes[i]
            v.assign(flat[at : at + n].reshape(v.shape))
            at += n

    # ------------------------------------------------------------ transfers
    def push(self, client: Any, g: int, layout: Any, chunks: Any, total: int, update: Any, data: np.ndarray,
             decay: np.ndarray | None, codec: Any, lr: float, timeout: float, decay_op: Any = UpdateOp.ADD) -> None:
        """Start group ``g``'s push (after dropping and error feedback); returns at once.
        ``decay_op``: the update of the weight decay's push (``add``; in a BSP round, with it)."""
        import time

        push: np.ndarray | None = data
        empty = False  # a BSP round's zero contribution of a dropped layer
        if self.cache is not None:
            self.cache.scale = max(float(lr), 1e-12)
            push = self.cache.offer(g, data, self.flat(g, [self.vars[i].numpy() for i in self.groups[g]]))
            if push is None:
                self.skipped += 1
                if getattr(update, "round", None) is not None:
                    # the round waits for every worker's contribution to each range: a dropped
                    # layer's is zero (one top-k element: a few bytes), its gradient kept here
                    push, empty = np.zeros(data.size, np.float32), True
                elif decay is None:
                    if self.asp:  # the other workers' updates still come in
                        self._start_pull(client, g, layout, chunks, timeout)
                    return
        if empty:
            codec = EMPTY
        fb = None
        if codec is not None and push is not None and not empty:  # error feedback: what earlier pushes left out goes now
            fb = self.residuals.setdefault(g, np.zeros(data.size, np.float32))
            push = push + fb
        # An ASP job pulls each slice as soon as its push is acknowledged:
        # a big layer streams both ways of a full-duplex link at once instead of one after the other
        out = np.empty(data.size, dtype="<f4") if self.asp else None

        async def piece(cl: Any, a: int, at: int, n: int) -> list[Any]:
            created: list[Any] = []
            if decay is not None:
                created += await cl.write_from(layout, 4 * a, decay[at : at + n], decay_op, chunks)
            if push is not None:
                created += await cl.write_from(layout, 4 * a, push[at : at + n], update, chunks, compress=codec,
                                               feedback=None if fb is None else fb[at : at + n])
            if out is not None:
                await cl.read_into(layout, 4 * a, memoryview(out[at : at + n]).cast("B"), chunks)  # type: ignore[arg-type]
            return created

        pieces = self.pieces[g]

        async def send(cl: Any) -> np.ndarray | None:
            created: list[Any] = []
            if len(pieces) == 1:
                created = await piece(cl, *pieces[0])
            else:
                async def one(p: tuple[int, int, int]) -> None:
                    created.extend(await piece(cl, *p))

                async with open_nursery() as nursery:  # an IrdmaError comes out as itself
                    for p in pieces:
                        nursery.start_soon(one, p)
            if created:  # chunks the file had not stored (a replica back from a failure): record them
                await cl.meta.extend(layout.file_id, 4 * total, time.time_ns(), tuple(created))
                for index, shard, incarnation in created:
                    chunks.setdefault(index, {})[shard] = incarnation
            return out

        if push is not None:
            self.pushed += not empty
            self.pushed_bytes += sum(payload_bytes(n, codec) for _, _, n in pieces)
        if decay is not None:
            self.pushed_bytes += 4 * data.size
        fut = client.submit(send, priority=g if self.overlap == "p3" else 0, slice_bytes=self.slice_bytes,
                            timeout=timeout)
        if self.asp:
            self.pending[g] = fut  # the layer's next forward pass waits for its push and pull
        else:
            self.pushes.append(fut)

    def wait_pushes(self) -> None:
        pushes, self.pushes = self.pushes, []
        for fut in pushes:
            fut.result()  # each has its deadline (submit's timeout)

    def _pull_fn(self, g: int, layout: Any, chunks: Any) -> Callable[[Any], Any]:
        """A coroutine function pulling group ``g`` into a fresh buffer (none is reused in flight)."""
        runs = self.runs[g]
        out = np.empty(sum(b - a for a, b in runs), dtype="<f4")

        async def pull(cl: Any) -> np.ndarray:
            at = 0
            for a, b in runs:
                await cl.read_into(layout, 4 * a, memoryview(out[at : at + b - a]).cast("B"), chunks)  # type: ignore[arg-type]
                at += b - a
            return out

        return pull

    def _start_pull(self, client: Any, g: int, layout: Any, chunks: Any, timeout: float) -> None:
        self.pending[g] = client.submit(self._pull_fn(g, layout, chunks), priority=g if self.overlap == "p3" else 0,
                                        slice_bytes=self.slice_bytes, timeout=timeout)

    def start_pulls(self, client: Any, layout: Any, chunks: Any, timeout: float) -> None:
        """Start the pull of every group that has none in flight, by priority."""
        for g in range(len(self.runs)):
            if g not in self.pending:
                self._start_pull(client, g, layout, chunks, timeout)

    def apply_pull(self, g: int) -> int:
        """Group ``g``'s pull in flight, if any: wait for it and assign its variables."""
        fut = self.pending.pop(g, None)
        if fut is not None:
            self.scatter(g, fut.result())
        return 0

    def flush(self) -> None:
        """Apply every pull in flight (before anything reads the weights outside a forward pass)."""
        for g in sorted(self.pending):
            self.apply_pull(g)


def payload_bytes(n: int, codec: Any) -> int:
    """Bytes of push payload that carry ``n`` float32 elements (compressed with ``codec``, if any)."""
    if codec is None:
        return 4 * n
    from ..wire.compress import wire_bytes

    return int(wire_bytes(n, codec))


def _hook(layer: Any, wait: Callable[[], int]) -> None:
    """Make ``layer``'s variable reads in ``call`` wait for ``wait()`` (a ``tf.py_function``
    they depend on). Symbolic calls (Keras tensors: building a functional model) skip it."""
    original = layer.call

    def call(*args: Any, **kwargs: Any) -> Any:
        import keras

        if any(isinstance(t, keras.KerasTensor) for t in tf.nest.flatten((args, kwargs))):
            return original(*args, **kwargs)
        done = tf.py_function(lambda: wait(), [], Tout=tf.int64)
        with tf.control_dependencies([done]):
            return original(*args, **kwargs)

    object.__setattr__(layer, "call", call)  # this instance only; Keras's attribute tracking skipped
