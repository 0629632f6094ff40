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
  optimizer (:mod:`irdma.wire.optimizers`): the shards apply it (Keras's arithmetic, state on the
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

Snapshots of a :class:`irdma.train.distributed.DistributedOptimizer` job (issue 23):
:class:`SnapshotCallback` (rank 0, at epoch ends, copy-on-write through the native client) and
:func:`restore_snapshot` (a new process resumes from one), below; exported by :mod:`irdma.keras`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..wire.optimizers import parse_update
from .coord import XATTR_CONSISTENCY, XATTR_SYNC_TIMEOUT, XATTR_WORKERS, parse_consistency

PARAMS = "params"
LAYOUT = "layout.json"

_log = logging.getLogger("irdma.keras")


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
    from ..wire.optimizers import ARGUMENTS, FLAGS, argument

    u = parse_update(update)
    if not u.op.is_optimizer:
        raise ValueError(f"{update!r} is not an optimizer")
    kwargs: dict[str, Any] = {k: argument(u, k) for k, _ in ARGUMENTS[u.op]}
    kwargs.update({k: bool(u.flags & bit) for k, bit in FLAGS.get(u.op, ())})
    cls = {"SGD": keras.optimizers.SGD, "ADAM": keras.optimizers.Adam, "ADAGRAD": keras.optimizers.Adagrad,
           "RMSPROP": keras.optimizers.RMSprop, "FTRL": keras.optimizers.Ftrl}[u.op.name]
    return cls(**kwargs)


# ------------------------------------------------------------ snapshots (issue 23)
#: The worker's part of a job's training state, written into the job directory by
#: :class:`SnapshotCallback` before each snapshot (an ``.npz`` archive, no pickles).
WORKER_STATE = "keras-state.npz"


class SnapshotCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """At the end of every ``every_n_epochs``-th epoch, rank 0 takes a snapshot of the job's
    parameter directory (:meth:`irdma.Client.snapshot`), read-only at
    ``PATH/.snapshots/NAME``, keeping the newest ``keep``. Needs :func:`irdma.keras.init` and a
    model compiled with :class:`irdma.train.distributed.DistributedOptimizer`; put it after
    :class:`irdma.train.callbacks.BroadcastInitialWeights` in ``callbacks`` (that one applies
    the pulls in flight and, with ``sync_every`` > 1, takes the epoch's last global step, so
    the shards hold the epoch's result). Resume from one with :func:`restore_snapshot`.

    What it snapshots: the whole directory ``path`` (default: the job directory,
    :func:`irdma.keras.job_dir`): ``params`` (the trainable variables, little-endian float32
    at the offsets of ``layout.json``) with the shards' optimizer state beside each chunk
    (moments, per-element step counts: :meth:`irdma.Client.optimizer_state`), ``layout.json``,
    and ``keras-state.npz``, which rank 0 writes just before: what of the training lives on the
    worker, as an ``.npz`` archive (no pickles) of ``epoch`` (int64: epochs done, the
    ``initial_epoch`` to resume with), ``iterations`` (int64: the optimizer's step count, which
    a learning-rate schedule is evaluated at), ``learning_rate`` (float32; absent under a
    schedule: what ``LearningRateScheduler`` or ``ReduceLROnPlateau`` set) and ``v0``, ``v1``,
    ... the model's non-trainable variables in ``model.non_trainable_variables`` order
    (BatchNormalization's moving statistics, the dropout seed generators' states; dtype and
    shape as in the model). What it does not hold: the worker-side residuals of
    ``compress=`` (error feedback) and of ``drop=`` (gradients held back), which a resumed run
    starts at zero, and the order of the data (feed ``model.fit`` data whose order depends on
    the epoch only, e.g. ``shuffle=False`` or a ``tf.data`` pipeline seeded with the epoch:
    Keras's own ``shuffle=True`` starts its sequence again in a new process).

    The cut (:mod:`irdma.client.snapshots`): no barrier, the other workers keep training;
    each shard holds the client pushes to the directory's files for at most two round trips.
    Every push acknowledged before the snapshot was called is in it, none that started after
    it returned is; a multi-chunk push in flight while it is taken (another worker's step)
    may be in it for some chunks and not for others. With one worker the snapshot holds whole
    steps (this worker's pushes were all acknowledged when its epoch ended); with several it
    may hold part of another worker's step, under BSP too (a worker pushes its next step
    before its clock waits).

    Cost: O(files) metadata work and two round trips per shard; no byte of parameters is
    copied (the shards share the chunks copy-on-write: the first push to a chunk after the
    snapshot copies that chunk once). Each snapshot logs one line (logger ``irdma.keras``,
    INFO): its name, files, bytes and milliseconds.

    A snapshot of the same name already there (an earlier run's, e.g. epoch 3 of the run a
    restored snapshot of epoch 2 came from) is replaced, as ``ModelCheckpoint`` overwrites
    its file, with a warning.

    Args:
        path: the directory to snapshot, in the namespace (default: the job directory). When
            it is not the job directory or a directory above it, the snapshot does not hold
            ``keras-state.npz``.
        every_n_epochs: snapshot after epochs ``n``, ``2n``, ... (counted from 1, as Keras's
            ``initial_epoch`` counts, so a resumed run keeps the cadence).
        keep: how many of the directory's snapshots to keep (the oldest beyond it are
            deleted, whoever made them); None keeps all.
        name: the snapshot's name; ``{epoch}`` is the number of epochs done (1 after the first).

    Raises:
        InvalidArgument: at construction, a bad ``every_n_epochs``, ``keep`` or ``name``; when
            training begins, no :func:`irdma.keras.init` or no DistributedOptimizer.
        irdma.IrdmaError: from :meth:`irdma.Client.snapshot` at an epoch's end (e.g.
            ShardUnavailable: a shard holding the files is down; nothing was kept, and
            ``model.fit`` stops with it, as it does when ``ModelCheckpoint`` cannot write).
    """

    def __init__(self, path: str | None = None, every_n_epochs: int = 1, keep: int | None = 5,
                 name: str = "epoch-{epoch}") -> None:
        from .._errors import InvalidArgument, IrdmaError
        from ..meta.sql_rows import check_name

        super().__init__()
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise InvalidArgument(f"every_n_epochs={every_n_epochs!r}", "pass a whole number of epochs, 1 or more")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgument(f"keep={keep!r}", "keep 1 or more snapshots, or pass None to keep them all")
        try:
            check_name(os.fsencode(name.format(epoch=1)))
        except (KeyError, IndexError, ValueError, IrdmaError) as exc:  # IrdmaError: check_name's InvalidArgument
            raise InvalidArgument(f"name={name!r} cannot name a snapshot ({exc})",
                                  "pass a name without '/', with {epoch} as its only field, e.g. 'epoch-{epoch}'") from None
        self.path, self.every_n_epochs, self.keep, self.name = path, every_n_epochs, keep, name

    def on_train_begin(self, logs: Any = None) -> None:
        _distributed_optimizer(self.model, "SnapshotCallback")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        from .world import rank

        if (epoch + 1) % self.every_n_epochs == 0 and rank() == 0:
            self.snapshot(epoch + 1)

    def snapshot(self, epoch: int) -> Any:
        """Take the snapshot of ``epoch`` epochs done now (rank 0's ``on_epoch_end`` calls it).
        Returns its :class:`irdma.client.snapshots.SnapshotInfo`. Raises as the class says."""
        import time

        from .._errors import Exists
        from .world import _need, job_dir

        client, job = _need("client"), job_dir()
        path = "/" + (self.path or job).strip("/")
        name = self.name.format(epoch=epoch)
        started = time.monotonic()
        _save_worker_state(client, job, self.model, epoch)
        try:
            info = client.snapshot(path, name, keep=self.keep)
        except Exists:
            _log.warning("snapshot %s of %s exists (an earlier run's): replacing it", name, path)
            client.delete_snapshot(path, name)
            info = client.snapshot(path, name, keep=self.keep)
        _log.info("snapshot %s of %s after epoch %d: %d files, %d bytes, %.0f ms", info.path, path, epoch, info.files,
                  info.bytes, 1000 * (time.monotonic() - started))
        return info


def restore_snapshot(name: str, path: str | None = None, model: Any = None, timeout: float = 600.0) -> int:
    """Make the job what snapshot ``name`` (of :class:`SnapshotCallback`, or ``irdma snapshot
    create``) holds, in a process that has not trained yet, and return the epoch to resume at
    (``model.fit(..., initial_epoch=...)``; 0 when the snapshot holds no ``keras-state.npz``).

    Every rank calls it after :func:`irdma.keras.init` and ``model.compile``, before
    ``model.fit``; the job's other processes must be stopped. Rank 0 restores ``path``
    (default: the job directory) from the snapshot (:meth:`irdma.Client.restore_snapshot`: its
    entries swapped for copy-on-write copies of the snapshot's in one metadata transaction, no
    byte copied; the snapshots stay); with more than one worker every rank then passes the
    job barrier ``restore-NAME``. ``model.fit``'s join then pulls the snapshot's weights
    (:class:`irdma.train.callbacks.BroadcastInitialWeights`), and the shards step on from
    the snapshot's optimizer state. With ``model``, its optimizer's ``iterations`` and
    ``learning_rate`` and the model's non-trainable variables are set from the snapshot's
    ``keras-state.npz`` (see :class:`SnapshotCallback`): with one worker, data in the same
    order and deterministic ops (``tf.config.experimental.enable_op_determinism()``), the
    resumed run's weights and optimizer state equal an uninterrupted run's bit for bit
    (tests/test_snapshot_keras.py).

    Raises:
        InvalidArgument: no :func:`irdma.keras.init`; ``model``'s optimizer already joined the
            job (restore before ``model.fit``); ``keras-state.npz`` is of another model (other
            non-trainable variables): nothing changed.
        irdma.NotFound: no ready snapshot ``name`` of ``path`` (``irdma snapshot list PATH``
            lists them). irdma.IrdmaError: from :meth:`irdma.Client.restore_snapshot`, e.g.
            ShardUnavailable (nothing changed). irdma.train.coord.SyncTimeout: a rank did not
            reach the barrier within ``timeout`` seconds.
    """
    import io

    from .._errors import InvalidArgument, NotFound
    from .keras_updates import learning_rate_of
    from .world import _job_barrier, _need, job_dir, rank, size

    client, job = _need("client"), job_dir()
    path = "/" + (path or job).strip("/")
    opt = None
    if model is not None:
        opt = _distributed_optimizer(model, "restore_snapshot(model=...)")
        if opt.joined:
            raise InvalidArgument("the model's optimizer has joined the job already: its weights came from the"
                                  " shards before the restore", "call restore_snapshot before model.fit, in a new process")
    found = [s for s in client.snapshots(path) if s.name == name and s.state == "ready"]
    if not found:
        raise NotFound(f"{path} has no snapshot named {name!r}", f"`irdma snapshot list {path}` lists them")
    state: dict[str, np.ndarray] = {}
    base = path.rstrip("/")
    if job == base or job.startswith(base + "/"):
        try:
            raw = bytes(client.read(f"{found[0].path}{job[len(base):]}/{WORKER_STATE}"))
            with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
                state = {k: np.array(npz[k]) for k in npz.files}
        except NotFound:
            _log.warning("snapshot %s holds no %s: the optimizer's step count and the model's non-trainable"
                         " variables stay as they are", found[0].path, WORKER_STATE)
    variables = list(model.non_trainable_variables) if model is not None else []
    if model is not None and state:
        saved = [state.get(f"v{i}") for i in range(sum(k[:1] == "v" and k[1:].isdigit() for k in state))]
        if [tuple(s.shape) for s in saved if s is not None] != [tuple(v.shape) for v in variables]:
            raise InvalidArgument(f"snapshot {name}'s {WORKER_STATE} holds the non-trainable variables of another"
                                  " model: nothing restored", "restore it with the model that was trained")
    if rank() == 0:
        client.restore_snapshot(path, name)
        _log.info("restored %s from snapshot %s (epoch %d)", path, found[0].path, int(state.get("epoch", 0)))
    if size() > 1:
        _job_barrier(f"restore-{name}", timeout)
    if opt is not None and state:
        opt.iterations.assign(int(state["iterations"]))
        if "learning_rate" in state and not isinstance(learning_rate_of(opt),
                                                       keras.optimizers.schedules.LearningRateSchedule):
            opt.learning_rate = float(state["learning_rate"])
        for i, v in enumerate(variables):
            v.assign(state[f"v{i}"])
    return int(state.get("epoch", 0))


def _distributed_optimizer(model: Any, who: str) -> Any:
    """``model``'s DistributedOptimizer (InvalidArgument if it has another)."""
    from .._errors import InvalidArgument
    from .distributed import DistributedOptimizer

    opt = getattr(model, "optimizer", None)
    if not isinstance(opt, DistributedOptimizer):
        raise InvalidArgument(f"{who} needs a model compiled with irdma.keras.DistributedOptimizer (its parameters and"
                              f" optimizer state are the job's files), not {type(opt).__name__}",
                              "compile with optimizer=irdma.keras.DistributedOptimizer(...); a ShardOptimizer job on a"
                              " mount is snapshotted with `mkdir JOB/.snapshots/NAME`")
    return opt


def _save_worker_state(client: Any, job: str, model: Any, epoch: int) -> None:
    """Write ``JOB/keras-state.npz`` (see :class:`SnapshotCallback`)."""
    import io

    from .distributed import MIN_CHUNK
    from .keras_updates import learning_rate_of

    opt = model.optimizer
    arrays: dict[str, np.ndarray] = {"epoch": np.asarray(epoch, dtype=np.int64),
                                     "iterations": np.asarray(int(opt.iterations.numpy()), dtype=np.int64)}
    lr = learning_rate_of(opt)
    if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        arrays["learning_rate"] = np.asarray(keras.ops.convert_to_numpy(lr), dtype=np.float32)
    for i, v in enumerate(model.non_trainable_variables):
        arrays[f"v{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    data = buf.getvalue()
    target = f"{job}/{WORKER_STATE}"
    client.write(target, data, op="assign", chunk_size=MIN_CHUNK)
    client.truncate(target, len(data))  # an earlier, longer archive's tail goes
