"""Keras 3 on irdma: data-parallel ``model.fit`` with the optimizer on the shards.

A few lines change in a Keras script::

    from irdma.train.keras import ShardOptimizer
    opt = ShardOptimizer("/mnt/irdma/jobs/digits", worker=k, workers=4,
                         update="adam learning_rate=0.001", consistency="ssp:2")
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    opt.build(model.trainable_variables)              # join the job: shared initial weights
    model.fit(x_k, y_k, epochs=20, batch_size=32)     # this worker's part of the data
    opt.pull_weights()                                # the shards' latest weights, then evaluate

How it works (the design, and why)
----------------------------------
:class:`ShardOptimizer` is a Keras optimizer whose step is a *push and a pull through the
mount*, so ``model.fit``, callbacks, ``model.save`` and checkpoints keep working unchanged:

* The model's trainable variables live in one file, ``JOB/params`` (SoftMemoryBox II's
  unified buffer: every tensor at a documented offset, ``JOB/layout.json`` lists name, shape
  and byte offset; little-endian float32, C order), whose ``user.irdma.update`` is the
  optimizer (:mod:`irdma.train.optimizers`): the shards apply it (Keras's arithmetic, state on the
  shards, replicated and persisted with the weights).
* Each training step writes the step's gradients to ``params`` as one buffer (one ``pwrite``
  of the whole model: a push), advances the worker's clock (a read of ``JOB/.irdma-clock@K``,
  which under BSP/SSP returns only once the slowest worker is close enough: :mod:`irdma.train.coord`),
  then reads the whole buffer back (one ``pread``: a pull) into the variables. The file stays
  open across steps, so a step is a handful of FUSE requests whatever the number of tensors.
* Worker 0 writes the initial weights (while the op is still ``assign``) and then sets the
  optimizer; every worker passes the barrier ``.irdma/barrier/JOBNAME-start@N`` and pulls them,
  so all start from the same weights.

The step runs as a ``tf.py_function`` inside Keras's compiled train function (TensorFlow
backend). The job directory gets ``user.irdma.consistency`` and ``user.irdma.workers`` from
worker 0 before the barrier. Errors (a shard down, a wait past its deadline: ETIMEDOUT) stop
``model.fit`` with the OSError.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._concurrency import open_nursery
from .._errors import IrdmaError
from ..wire.protocol import Update, UpdateOp
from . import comm
from .comm import DEFAULT_SLICE_ELEMS, parse_drop, parse_slice
from .coord import XATTR_CONSISTENCY, XATTR_SYNC_TIMEOUT, XATTR_WORKERS, parse_consistency
from .optimizers import parse_update

PARAMS = "params"
LAYOUT = "layout.json"


def _mount_root(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path) and path != "/":
        path = os.path.dirname(path)
    return path


class ShardOptimizer(keras.optimizers.Optimizer):  # type: ignore[misc]  # Keras ships no types
    """A Keras optimizer that pushes gradients to, and pulls weights from, an irdma job directory.

    Args:
        job_dir: a directory on an irdma mount (created by worker 0 if missing).
        worker: this worker's id, 0 to ``workers - 1``.
        workers: how many workers train the job.
        update: the optimizer the shards apply, as ``user.irdma.update`` takes it
            (e.g. ``"sgd learning_rate=0.05 momentum=0.9"``).
        consistency: ``asp``, ``bsp`` or ``ssp:S``.
        sync_timeout: seconds a clock or barrier wait may take before it fails (ETIMEDOUT).

    Raises:
        ValueError: a bad ``update`` or ``consistency`` (before anything is written).
    """

    def __init__(self, job_dir: str, worker: int, workers: int, update: str = "sgd",
                 consistency: str = "asp", sync_timeout: float = 60.0, name: str = "irdma", **kwargs: Any) -> None:
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.job_dir = os.path.abspath(job_dir)
        self.worker, self.workers = int(worker), int(workers)
        if not 0 <= self.worker < self.workers:
            raise ValueError(f"worker {worker} is not one of {workers} workers")
        self.update_spec = update
        parse_update(update)  # raises ValueError early
        self.consistency = parse_consistency(consistency).name
        self.sync_timeout = float(sync_timeout)
        self._fd: int | None = None
        self._vars: list[Any] = []
        self._sizes: list[int] = []
        self.rounds = 0

    # ------------------------------------------------------------ set-up
    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._vars = list(variables)
        self._sizes = [int(np.prod(v.shape)) for v in self._vars]
        params = os.path.join(self.job_dir, PARAMS)
        job = os.path.basename(self.job_dir.rstrip("/"))
        if self.worker == 0:
            os.makedirs(self.job_dir, exist_ok=True)
            os.setxattr(self.job_dir, XATTR_CONSISTENCY, self.consistency.encode())
            os.setxattr(self.job_dir, XATTR_WORKERS, str(self.workers).encode())
            os.setxattr(self.job_dir, XATTR_SYNC_TIMEOUT, str(self.sync_timeout).encode())
            layout, offset = [], 0
            for v, n in zip(self._vars, self._sizes, strict=True):
                layout.append({"name": v.path, "shape": list(v.shape), "offset": offset, "dtype": "<f4"})
                offset += 4 * n
            tmp = os.path.join(self.job_dir, LAYOUT + ".tmp")
            with open(tmp, "w") as f:
                json.dump(layout, f, indent=1)
            os.replace(tmp, os.path.join(self.job_dir, LAYOUT))
            with open(params, "wb") as f:  # the initial weights, while the op is assign
                f.write(self._flat([np.asarray(v.numpy()) for v in self._vars]))
            os.setxattr(params, "user.irdma.update", self.update_spec.encode())
        self._barrier(f"{job}-start")
        self._fd = os.open(params, os.O_RDWR)
        self._clock_path = os.path.join(self.job_dir, f".irdma-clock@{self.worker}")
        self.pull_weights()

    def _barrier(self, name: str) -> None:
        with open(os.path.join(_mount_root(self.job_dir), ".irdma", "barrier", f"{name}@{self.workers}")) as f:
            f.read()

    @staticmethod
    def _flat(arrays: list[np.ndarray]) -> memoryview:
        """Every tensor in layout order as one little-endian float32 buffer (one copy)."""
        flat = np.concatenate([np.asarray(a, dtype="<f4").ravel() for a in arrays])
        return memoryview(flat).cast("B")  # type: ignore[arg-type]

    # ------------------------------------------------------------ the step
    def _pull(self) -> list[np.ndarray]:
        assert self._fd is not None
        total = 4 * sum(self._sizes)
        buf = bytearray(total)
        view, got = memoryview(buf), 0
        while got < total:
            n = os.preadv(self._fd, [view[got:]], got)
            if n <= 0:
                raise OSError(f"{self.job_dir}/{PARAMS} ended at {got} of {total} bytes")
            got += n
        flat = np.frombuffer(buf, dtype="<f4")
        out, start = [], 0
        for v, n in zip(self._vars, self._sizes, strict=True):
            out.append(flat[start : start + n].reshape(v.shape))
            start += n
        return out

    def pull_weights(self) -> None:
        """Set the model's variables to the shards' current weights (eager). The file is opened
        afresh first: an open drops this mount's read-ahead windows (close-to-open), so a
        restore made by another worker, on another mount, is seen."""
        assert self._fd is not None
        fd, self._fd = self._fd, os.open(os.path.join(self.job_dir, PARAMS), os.O_RDWR)
        os.close(fd)
        for v, w in zip(self._vars, self._pull(), strict=True):
            v.assign(w)

    def _push_pull(self, *grads: Any) -> list[np.ndarray]:
        assert self._fd is not None
        data = self._flat([g.numpy() for g in grads])
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], done)
        with open(self._clock_path) as f:  # the end of this round: waits under BSP/SSP
            f.read()
        self.rounds += 1
        return self._pull()

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> Any:
        variables = list(trainable_variables) if trainable_variables is not None else self._vars
        if not self.built:
            raise RuntimeError("call opt.build(model.trainable_variables) after compile and before fit:"
                               " it joins the job (worker 0 writes the initial weights, every worker pulls them)")
        grads = [tf.convert_to_tensor(g, dtype=tf.float32) for g in grads]
        new = tf.py_function(self._push_pull, grads, Tout=[tf.float32] * len(grads))
        for v, w in zip(variables, new, strict=True):
            v.assign(tf.reshape(w, v.shape))
        self._iterations.assign_add(1)
        return self._iterations

    # ------------------------------------------------------------ checkpoints
    def save_state(self, path: str) -> int:
        """Copy the shards' optimizer state of the job (``JOB/.irdma-state@params``: the state
        image of :meth:`irdma.Client.state_of`) to ``path`` (any filesystem), beside a
        ``model.save_weights`` of the pulled weights. Returns the bytes written.

        Raises:
            OSError: e.g. a shard unavailable (EIO) or ``path`` not writable.
        """
        return _copy(os.path.join(self.job_dir, f".irdma-state@{PARAMS}"), path, atomic=True)

    def restore_state(self, path: str) -> None:
        """Make the job's weights the model's current variables (e.g. after
        ``model.load_weights``) and its optimizer state the image saved in ``path`` by
        :meth:`save_state`: the op goes to ``assign`` for the weights, back to this optimizer,
        then the state is written. One worker restores; the others pass a barrier after it and
        call :meth:`pull_weights`.

        Raises:
            OSError: EINVAL when the image's size is not this job's (another model, optimizer
                or chunk size); nothing of the state is written then.
        """
        params = os.path.join(self.job_dir, PARAMS)
        state = os.path.join(self.job_dir, f".irdma-state@{PARAMS}")
        have, want = os.path.getsize(path), os.stat(state).st_size
        if have != want:
            raise OSError(errno.EINVAL, f"{path} holds {have} bytes of optimizer state; this job's image is {want}"
                          " (another model, optimizer or chunk size): nothing restored")
        os.setxattr(params, "user.irdma.update", b"assign")
        try:
            with open(params, "r+b") as f:
                f.write(self._flat([np.asarray(v.numpy()) for v in self._vars]))
        finally:
            os.setxattr(params, "user.irdma.update", self.update_spec.encode())
        _copy(path, state)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _copy(src: str, dst: str, atomic: bool = False) -> int:
    """Copy ``src`` to ``dst`` by plain reads and writes (the state image is a virtual file:
    no sendfile or copy_file_range); ``atomic``: through ``DST.tmp`` renamed over ``dst`` once
    written and fsynced, so a failed save leaves the previous checkpoint whole."""
    with open(src, "rb", buffering=0) as f:
        data = f.read()
    out = dst + ".tmp" if atomic else dst
    with open(out, "wb", buffering=0) as g:
        view, done = memoryview(data), 0
        while done < len(view):
            done += g.write(view[done:]) or 0
        os.fsync(g.fileno())  # a restore: durable on every replica (close does it too)
    if atomic:
        os.replace(out, dst)
    return len(data)


def keras_optimizer(update: str) -> keras.optimizers.Optimizer:
    """The Keras optimizer a ``user.irdma.update`` value names, with the same arguments (the
    single-process baseline of a job).

    Raises:
        ValueError: a bad spec, or ``assign``/``add`` (not optimizers).
    """
    from .optimizers import ARGUMENTS, FLAGS, argument

    u = parse_update(update)
    if not u.op.is_optimizer:
        raise ValueError(f"{update!r} is not an optimizer")
    kwargs: dict[str, Any] = {k: argument(u, k) for k, _ in ARGUMENTS[u.op]}
    kwargs.update({k: bool(u.flags & bit) for k, bit in FLAGS.get(u.op, ())})
    cls = {"SGD": keras.optimizers.SGD, "ADAM": keras.optimizers.Adam, "ADAGRAD": keras.optimizers.Adagrad,
           "RMSPROP": keras.optimizers.RMSprop}[u.op.name]
    return cls(**kwargs)


# ---------------------------------------------------------------- less and smarter communication
OVERLAPS = ("none", "fifo", "p3")


@dataclass
class CommStats:
    """What a :class:`CommTrainer` moved and skipped, since it was built.

    Bytes are payload bytes of pushes and pulls as the trainer counts them (a compressed push
    at :func:`irdma.wire.compress.wire_bytes` per slice: an estimate, since the client also cuts at
    chunk boundaries; the link's own counters are the measure); ``skipped`` counts layer pushes
    held back by layer dropping; ``steps`` the training steps and ``step_s`` their wall-clock seconds.
    """

    pushed_bytes: int = 0
    pulled_bytes: int = 0
    pushes: int = 0
    skipped: int = 0
    steps: int = 0
    step_s: list[float] = field(default_factory=list)


class CommTrainer:
    """Data-parallel training of a ``keras.Sequential`` with issue 12's communication techniques.

    Every layer with trainable weights is one file ``JOB/layer-NNN`` (its variables in order,
    little-endian float32, C order) whose ``user.irdma.update`` is the shards' optimizer and
    whose ``user.irdma.priority`` is the layer's index in the forward pass (0 first). A step runs
    the model layer by layer in eager mode, so that:

    * ``overlap="p3"`` (P3, Jayarajan et al., SysML 2019): back-propagation pushes each layer's
      gradient as soon as it is computed and then pulls the layer's new weights, in slices of
      ``slice_elems`` float32 scheduled by priority (:func:`irdma.train.comm.priority`): the first
      layers, which the next forward pass needs first, overtake the big later ones; the forward
      pass of the next step waits only for the layer it is about to run.
    * ``overlap="fifo"``: the same overlap in whole tensors and arrival order (no priority), the
      baseline P3 is measured against; ``overlap="none"``: back-propagation, then every push,
      then every pull, then the next forward pass.
    * ``drop`` (layer dropping with a residual cache, :class:`irdma.train.comm.ResidualCache`): a
      layer's push is skipped while ``learning_rate * ||accumulated gradient||_1 <
      drop * ||weights||_1``; what was skipped is added to its next push (nothing is lost).
    * ``compress`` (``"topk:F"`` or ``"sign"``, :mod:`irdma.wire.compress`): pushes are encoded per
      slice, decoded on the shards, and the compression error is kept per layer and added to
      the next push (error feedback).
    * ``group`` (a :class:`irdma.train.hier.HostGroup`, DASO-style hierarchy): the workers of a host
      sum their gradients in shared memory, the group's leader pushes the sum once for the host
      and pulls once, and hands the weights to the others. With ``sync_every=K`` > 1 (DASO's
      global synchronisation every K steps) the workers of a host take K local steps of plain
      SGD with the host's mean gradient, then each leader adds its host's change, divided by
      the number of hosts, to the shards' model (files of op ``add``) and all pull the result.

    Args:
        model: a built ``keras.Sequential``.
        client: an :func:`irdma.connect` client (its ``window`` bounds the requests in flight
            per shard: P3 wants a few, e.g. 4).
        job: the job's directory in the namespace (created by worker 0).
        worker, workers: this worker's id and the job's worker count (for the start barrier).
        update: the optimizer the shards apply (``user.irdma.update``).
        loss: a Keras loss (name or object).
        overlap, slice_elems, drop, compress, group, sync_every: as above.
        timeout: seconds a transfer (a layer's push and pull) or the start barrier may take;
            at most the group's. A transfer past it is cancelled and the trainer stops: every
            later step raises the error (updates not acknowledged are back in the residual cache).

    Raises:
        ValueError: a model that is not a built Sequential, or a bad flag (before anything is
            written).
    """

    def __init__(self, model: Any, client: Any, job: str, *, worker: int = 0, workers: int = 1,
                 update: str = "sgd learning_rate=0.05", loss: Any = "sparse_categorical_crossentropy",
                 overlap: str = "p3", slice_elems: int = DEFAULT_SLICE_ELEMS, drop: float = 0.0,
                 compress: str | None = None, group: Any = None, sync_every: int = 1, timeout: float = 120.0) -> None:
        if not isinstance(model, keras.Sequential) or not model.built:
            raise ValueError("CommTrainer runs a built keras.Sequential layer by layer: build it first"
                             " (model.build(input_shape) or call it once)")
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap {overlap!r}: use one of {', '.join(OVERLAPS)}")
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of {workers} workers")
        self.op = parse_update(update)
        if not self.op.op.is_optimizer:
            raise ValueError(f"update {update!r} is not an optimizer: use e.g. 'sgd learning_rate=0.05'")
        self.update_spec = update
        self.sync_every = int(sync_every)
        if self.sync_every < 1:
            raise ValueError(f"sync_every {sync_every!r}: use 1 (every step) or more local steps per synchronisation")
        if self.sync_every > 1:
            if self.op.op != UpdateOp.SGD or self.op.args[1] or self.op.flags:
                raise ValueError("sync_every > 1 takes local steps of plain SGD on the workers (DASO): use"
                                 f" update='sgd learning_rate=...' with no momentum, not {update!r}")
            if overlap != "none" or drop or compress:
                raise ValueError("sync_every > 1 synchronises whole models every K steps: use overlap='none',"
                                 " and no drop or compress")
        self.slice_bytes = 4 * parse_slice(str(slice_elems))
        self.drop = parse_drop(str(drop))
        self.compress = compress
        self._codec = None
        if compress is not None:
            from ..wire import compress as _compress

            self._codec = _compress.parse_compress(compress)
        self.model, self.client, self.job = model, client, job.rstrip("/") or "/"
        self.worker, self.workers, self.overlap, self.timeout = int(worker), int(workers), overlap, float(timeout)
        self.group = group
        if group is not None:
            # a member waits in broadcast for at most the group's deadline: the leader must give
            # up on a transfer before that, and say so (its close reaches the members at once)
            self.timeout = min(self.timeout, float(group.timeout))
        self.loss_fn = keras.losses.get(loss)
        self.layers = [layer for layer in model.layers if layer.trainable_weights]
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self._sizes = [[int(np.prod(v.shape)) for v in layer.trainable_weights] for layer in self.layers]
        lr = self.op.args[0] if self.op.args[0] > 0 else 1.0
        self.cache = comm.ResidualCache(self.drop, scale=lr)
        self._feedback: dict[int, np.ndarray] = {}  # compression error per layer (error feedback)
        self._pulls: dict[int, Any] = {}  # layer -> future of its weights (float32, flat)
        self._pushes: list[Any] = []
        self._unacked: dict[int, np.ndarray] = {}  # layer dropping: pushed updates not acknowledged yet
        self._broken: BaseException | None = None
        self._held: list[tuple[int, np.ndarray]] = []  # overlap "none": this step's gradients until back-prop ends
        self._pending = False  # whether every layer's pull of the last step is in flight
        self._anchor: list[np.ndarray] = []
        self.layer_compute_s: list[list[float]] = []  # per step run with communicate=False: seconds per layer
        self.backward_share: list[float] = []  # and the share of back-propagation in them
        self._layouts: list[Any] = []
        self._chunks: list[Any] = []
        self.stats = CommStats()

    # ------------------------------------------------------------ set-up
    @property
    def leader(self) -> bool:
        """Whether this worker talks to the shards (every worker, or its host group's leader)."""
        return self.group is None or self.group.rank == 0

    def path(self, i: int) -> str:
        return f"{self.job}/layer-{i:03d}"

    def _flat(self, i: int) -> np.ndarray:
        return np.concatenate([np.asarray(v.numpy(), dtype="<f4").ravel() for v in self.layers[i].trainable_weights])

    def build(self) -> None:
        """Join the job: worker 0 writes every layer's initial weights (op ``assign``), then sets
        the optimizer and the xattrs; every worker passes the start barrier and pulls."""
        c = self.client
        if self.worker == 0:
            c.makedirs(self.job)
            meta = c.client.store
            job_ino = c.stat(self.job).ino
            meta.setxattr(job_ino, comm.XATTR_SLICE, str(self.slice_bytes // 4).encode())
            meta.setxattr(job_ino, comm.XATTR_DROP, repr(self.drop).encode())
            # what `irdma tune --layout JOB/layout.json` reads: a tensor per layer file, in forward order
            layout = [{"name": self.layers[i].name, "file": f"layer-{i:03d}", "shape": [sum(self._sizes[i])],
                       "offset": 0, "dtype": "<f4"} for i in range(len(self.layers))]
            c.write(f"{self.job}/{LAYOUT}", json.dumps(layout, indent=1).encode(), op="assign")
            for i in range(len(self.layers)):
                c.write(self.path(i), self._flat(i), op="assign")
                # K > 1: the hosts push their models' changes, averaged: the shards add them
                c.set_update_op(self.path(i), self.update_spec if self.sync_every == 1 else "add")
                meta.setxattr(c.stat(self.path(i)).ino, comm.XATTR_PRIORITY, str(i).encode())
        c._run(c.client.barrier, f"{self.job.strip('/').replace('/', '-')}-start", self.workers, self.timeout)

        async def locate(cl: Any) -> tuple[list[Any], list[Any]]:
            from ..client.native import layout_of

            layouts, chunks = [], []
            for i in range(len(self.layers)):
                inode = await cl.meta.resolve(self.path(i))
                layouts.append(layout_of(inode))
                chunks.append(await cl.meta.chunk_map(inode.ino))
            return layouts, chunks

        self._layouts, self._chunks = c._run(locate, c.client)
        self._pull_all()
        self._anchor = [self._flat(i) for i in range(len(self.layers))]  # the weights at the last synchronisation

    # ------------------------------------------------------------ transfers
    def _level(self, i: int) -> tuple[int, int]:
        return (i, self.slice_bytes) if self.overlap == "p3" else (0, 0)

    def _transfer(self, i: int, grad: np.ndarray | None, pull: bool, op: Any = None) -> Any:
        """Start pushing layer ``i``'s gradient (unless None), then pulling its weights (if
        ``pull``), as one task at the layer's priority; returns its future (the weights, or None)."""
        layout, chunks = self._layouts[i], self._chunks[i]
        level, cut = self._level(i)
        n = sum(self._sizes[i])
        op, feedback, data = op or self.op, None, None
        if grad is not None:
            data = np.ascontiguousarray(grad, dtype="<f4")
            if self._codec is not None:
                from ..wire import compress as _compress

                feedback = self._feedback.setdefault(i, np.zeros(data.size, np.float32))
                data = data + feedback  # error feedback: what earlier pushes left out goes now
                self.stats.pushed_bytes += sum(_compress.wire_bytes(k, self._codec)
                                               for k in _pieces(data.size, cut // 4 or data.size))
            else:
                self.stats.pushed_bytes += data.nbytes
            self.stats.pushes += 1
        if pull:
            self.stats.pulled_bytes += 4 * n

        out = np.empty(n, dtype="<f4") if pull else None  # a fresh buffer per pull: none is reused in flight
        created: list[Any] = []

        async def piece(cl: Any, a: int, b: int) -> None:
            """Elements [a, b): push them, then pull them (each slice on its own: P3 pulls a slice
            as soon as its push is applied, so a big layer streams both ways at once)."""
            if data is not None:
                created.extend(await cl.write_from(layout, 4 * a, data[a:b], op, chunks, compress=self._codec,
                                                   feedback=None if feedback is None else feedback[a:b]))
            if out is not None:
                await cl.read_into(layout, 4 * a, memoryview(out[a:b]).cast("B"), chunks)  # type: ignore[arg-type]

        async def run(cl: Any) -> np.ndarray | None:
            per = cut // 4 if cut and self.overlap == "p3" else n
            if per >= n:
                await piece(cl, 0, n)
            else:
                async with open_nursery() as nursery:  # an IrdmaError comes out as itself
                    for a in range(0, n, per):
                        nursery.start_soon(piece, cl, a, min(n, a + per))
            if created:  # chunks the file had not stored (a replica back from a failure): record them
                await cl.meta.extend(layout.file_id, 4 * n, time.time_ns(), tuple(created))
                for index, shard, incarnation in created:
                    chunks.setdefault(index, {})[shard] = incarnation
            if grad is not None:
                self._unacked.pop(i, None)  # acknowledged by every shard: the update is applied
            return out

        if grad is not None and self.drop:
            self._unacked[i] = np.asarray(grad, dtype=np.float32)  # back to the residual cache if the push fails
        return self.client.submit(run, priority=level, slice_bytes=cut, timeout=self.timeout)

    def _start_pull(self, i: int) -> None:
        if self.leader:
            self._pulls[i] = self._transfer(i, None, True)

    def _send(self, i: int, grad: np.ndarray) -> None:
        """Layer ``i``'s gradient (float32, flat) is ready: push it (or cache it), then pull."""
        if self.sync_every > 1:  # DASO: a local step with the host's mean gradient, no transfer
            if self.group is not None:
                grad = self.group.allreduce(grad) / np.float32(self.group.size)
            self._set_flat(i, self._flat(i) - np.float32(self.op.args[0]) * grad)
            return
        if self.group is not None:
            grad = self.group.reduce_to_leader(grad)
            if not self.leader:
                return
        keep = self.cache.offer(i, grad, self._flat(i)) if self.drop else grad
        if keep is None:
            self.stats.skipped += 1  # layer dropping: held back in the residual cache
        if self.overlap == "none":
            if keep is not None:
                self._held.append((i, keep))  # pushed once back-propagation is over
        else:
            self._pulls[i] = self._transfer(i, keep, True)  # other workers' updates still come in

    def _result(self, fut: Any) -> Any:
        """A transfer's result (it has its own deadline: ``timeout``). A failure breaks the
        trainer: updates not acknowledged go back to the residual cache, the host group (if
        any) is told, and every later step raises the same error."""
        try:
            return fut.result()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
            for i, update in list(self._unacked.items()):
                self.cache.restore(i, update)
            self._unacked.clear()
            if self.group is not None:
                self.group.close()  # the others learn at once that this worker is gone

    def _set_weights(self, i: int) -> None:
        if self.leader:
            flat = self._result(self._pulls.pop(i))
        else:
            flat = None
        if self.group is not None:
            flat = self.group.broadcast(flat)
        self._set_flat(i, flat)

    def _set_flat(self, i: int, flat: np.ndarray) -> None:
        at = 0
        for v, n in zip(self.layers[i].trainable_weights, self._sizes[i], strict=True):
            v.assign(flat[at : at + n].reshape(v.shape))
            at += n

    def _wait_pushes(self) -> None:
        pushes, self._pushes = self._pushes, []
        for fut in pushes:
            self._result(fut)

    # ------------------------------------------------------------ the step
    def train_step(self, x: Any, y: Any, *, communicate: bool = True) -> float:
        """One step on a batch: returns the batch's loss (float). ``communicate=False`` runs the
        same computation with no push or pull (the model's weights do not change): what the
        cost model takes as the computation time. Raises what a transfer raised (e.g.
        ShardUnavailable), or TimeoutError past ``timeout``."""
        if self._broken is not None:
            raise IrdmaError(f"this trainer stopped on an earlier error: {self._broken!r}",
                             "build a new CommTrainer (and restore the last checkpoint)") from self._broken
        t0 = time.perf_counter()
        h = tf.convert_to_tensor(x)
        records = []
        spent: dict[int, float] = {}  # layer -> seconds of its forward and back-prop (communicate=False)
        backward = 0.0
        if not communicate:
            self.finish()
        pending, self._pending = self._pending and communicate, False
        for layer in self.model.layers:
            i = self._index.get(id(layer))
            if i is not None and pending:
                self._set_weights(i)  # waits for this layer's pull only
            t1 = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(h)
                out = layer(h, training=True)
            records.append((layer, tape, h, out))
            if not communicate:
                spent[id(layer)] = time.perf_counter() - t1
            h = out
        with tf.GradientTape() as tape:
            tape.watch(h)
            # tf.identity: a softmax output carries its logits, from which Keras's losses would
            # compute the loss (and gradient) around ``h``, leaving none for it
            loss = tf.reduce_mean(self.loss_fn(y, tf.identity(h)))
        g = tape.gradient(loss, h)
        for layer, tape, hin, out in reversed(records):
            weights = layer.trainable_weights
            t1 = time.perf_counter()
            grads = tape.gradient(out, [hin, *weights], output_gradients=g)
            if not communicate:
                spent[id(layer)] += time.perf_counter() - t1
                backward += time.perf_counter() - t1
            g = grads[0]
            i = self._index.get(id(layer))
            if i is not None and communicate:
                self._send(i, np.concatenate([np.asarray(t, dtype="<f4").ravel() for t in grads[1:]]))
        if not communicate:
            # what the cost model takes per tensor: a layer with weights, plus the layers
            # without weights that follow it (the first ones go to the first layer with weights)
            per, cur = [0.0] * len(self.layers), 0
            for layer in self.model.layers:
                cur = self._index.get(id(layer), cur)
                per[cur] += spent.get(id(layer), 0.0)
            self.layer_compute_s.append(per)
            self.backward_share.append(backward / max(sum(per), 1e-9))
            return float(loss)
        if self.sync_every > 1:
            if (self.stats.steps + 1) % self.sync_every == 0:
                self._synchronise()
        elif self.overlap == "none":
            self._pushes = [self._transfer(i, keep, False) for i, keep in self._held]
            self._held.clear()
            self._wait_pushes()
            self._pull_all()
        else:
            self._pending = True  # every layer's pull is on its way: the next forward pass waits for each
        self.stats.steps += 1
        self.stats.step_s.append(time.perf_counter() - t0)
        return float(loss)

    def fit(self, x: np.ndarray, y: np.ndarray, *, epochs: int = 1, batch_size: int = 32,
            seed: int = 0, steps: int | None = None) -> list[float]:
        """Train on ``x``, ``y`` (this worker's part of the data) for ``epochs`` epochs, or
        ``steps`` steps; returns the mean loss of each epoch."""
        rng = np.random.default_rng(seed)
        losses, done = [], 0
        for _ in range(epochs):
            order = rng.permutation(len(x))
            total, n = 0.0, 0
            for s in range(0, len(x) - batch_size + 1, batch_size):
                idx = order[s : s + batch_size]
                total += self.train_step(x[idx], y[idx])
                n += 1
                done += 1
                if steps is not None and done >= steps:
                    break
            losses.append(total / max(n, 1))
            if steps is not None and done >= steps:
                break
        self.finish()
        return losses

    def _synchronise(self) -> None:
        """DASO's global step: each host's leader adds its model's change since the last one,
        divided by the number of hosts, to the shards' model (op ``add``: the average of the
        hosts' changes), then every worker takes the result."""
        hosts = self.workers // (self.group.size if self.group is not None else 1)
        if self.leader:
            self._pushes = [self._transfer(i, (self._flat(i) - self._anchor[i]) / np.float32(hosts), False,
                                           op=Update(UpdateOp.ADD)) for i in range(len(self.layers))]
        self._wait_pushes()
        self._pull_all()
        self._anchor = [self._flat(i) for i in range(len(self.layers))]

    def finish(self) -> None:
        """Wait for every transfer in flight and set the model to the weights they pulled."""
        self._wait_pushes()
        if self._pending:
            self._pending = False
            for i in range(len(self.layers)):
                self._set_weights(i)

    def _pull_all(self) -> None:
        for i in range(len(self.layers)):
            self._start_pull(i)
        for i in range(len(self.layers)):
            self._set_weights(i)

    def pull_weights(self) -> None:
        """Set the model's variables to the shards' current weights (every worker of a group calls it)."""
        self.finish()
        self._pull_all()


def _pieces(n: int, per: int) -> list[int]:
    """Sizes of ``n`` elements cut in pieces of at most ``per``."""
    return [min(per, n - at) for at in range(0, n, per)] or [0]
