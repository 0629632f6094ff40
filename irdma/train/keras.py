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
from typing import Any

import keras
import numpy as np
import tensorflow as tf

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
