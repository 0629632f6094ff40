"""Horovod-shaped data-parallel Keras on irdma: ``init``, ``rank``, ``size``,
``DistributedOptimizer``, ``BroadcastInitialWeights``, ``shard_dataset``.

A Horovod Keras script ports by changing its import (``import irdma.keras as hvd``) and runs
under ``irdma run -n N -- python train.py`` (:mod:`irdma.ops.launch`)::

    import irdma.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    model.fit(hvd.shard_dataset(ds), callbacks=[hvd.BroadcastInitialWeights(0)], epochs=5)

How it works
------------
The model's trainable variables are one file of the job directory, ``JOB/params`` (every
tensor at its offset in ``JOB/layout.json``; little-endian float32, C order), on the shards. A
training step of :class:`DistributedOptimizer` is, in one ``tf.py_function`` inside Keras's
compiled train step:

1. on the worker, what Keras does before an optimizer's update: gradient clipping
   (``clipnorm``, ``clipvalue``, ``global_clipnorm``, Keras's own code) and the learning rate
   at this step (a ``LearningRateSchedule`` evaluated at ``iterations``; what a
   ``LearningRateScheduler`` or ``ReduceLROnPlateau`` callback set);
2. decoupled weight decay (AdamW's, and any optimizer's ``weight_decay``; Loshchilov & Hutter,
   ICLR 2019) as a push of ``-variable * weight_decay * learning_rate`` with update op ``add``;
3. a push of the gradients with the wrapped optimizer's update op, *this step's* learning rate
   carried in the request (:class:`irdma.wire.protocol.Update`): the shards apply Keras's
   arithmetic with the optimizer state beside each chunk (:mod:`irdma.wire.optimizers`);
4. the end of the worker's round (its clock: under BSP/SSP it waits for the slowest worker to
   be close enough, :mod:`irdma.train.coord`), then a pull of the whole file into the variables.

Under BSP the pushes of steps 2 and 3 carry the job's round (:class:`irdma.wire.protocol.Round`:
the run, this worker's clock, its rank, the job's size): the shards sum the workers' pushes and
apply each once, to their mean (:mod:`irdma.server.rounds`), Horovod's averaging allreduce and
one optimizer step.

With one worker, every step equals the wrapped Keras optimizer's (float32, to rounding).

Saved files (``model.save`` to ``.keras``/``.h5``, ``save_weights``, ``ModelCheckpoint``) name the
wrapped optimizer's stock Keras class, its slots holding the shards' state (any Keras loads them,
without irdma: :class:`irdma.train.keras_updates.SavedAsKeras`); :func:`load_model` (Horovod's
``hvd.load_model``) wraps the loaded optimizer again and writes its state to the shards.

Joining the job: rank 0 writes the initial weights (op ``assign``) unless the job already holds
parameters of this model (a job run again resumes from the shards' weights), then every rank
passes the barrier ``JOB-start`` and pulls them. That happens at ``on_train_begin`` with
:class:`BroadcastInitialWeights` (so each rank's first gradient is taken at the shared
weights, as Horovod's callback of that name does), else at the first step.

The job's chunk size follows the model: the largest power of two not above the parameters'
bytes per shard, between 4 KiB and 4 MiB, so a small model's optimizer state is small.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._errors import InvalidArgument, NoAttribute, NotFound
from ..wire.protocol import ROUND_ELASTIC, ROUND_SUM, Round, Update, UpdateOp
from . import coord
from .comm import DEFAULT_SLICE_ELEMS
from .coord import XATTR_SYNC_TIMEOUT
from .keras_updates import (
    CHUNK_SIZES,
    SavedAsKeras,
    _lr_at,
    _spec,
    _with_learning_rate,
    learning_rate_of,
    update_of,
)
from .world import _host_group, _member, _need, _wait_for, _world, barrier_name, cross_rank, cross_size

#: ``op=`` of :class:`DistributedOptimizer` (Horovod's ``hvd.Average`` and ``hvd.Sum``): what a BSP
#: round applies, the mean of the workers' gradients or their sum.
Average = "average"
Sum = "sum"



class Compression:
    """Horovod's ``hvd.Compression`` for ``DistributedOptimizer(compression=...)``: ``none``
    (dense float32 pushes, the default). Horovod's ``fp16`` has no counterpart on the wire (a
    push is float32 or an encoded gradient) and is refused with the alternatives: irdma's own
    encodings, ``compress="topk:F"`` or ``"sign"`` with error feedback."""

    none = "none"
    fp16 = "fp16"


PARAMS = "params"
LAYOUT = "layout.json"
#: Bounds of a job's chunk size (bytes).
MIN_CHUNK, MAX_CHUNK = CHUNK_SIZES[0], CHUNK_SIZES[-1]

log = logging.getLogger("irdma.keras")


def series_of(job_ino: int) -> int:
    """The :class:`irdma.wire.protocol.Round` series of this run of job ``job_ino``: the same for
    every worker of one ``irdma run`` launch (``$IRDMA_RUN_ID``), another for the next launch, so
    a new run never adds into a round a dead one left on the shards. A u64 (BLAKE2b)."""
    import hashlib

    run = str(_world.get("run", ""))
    return int.from_bytes(hashlib.blake2b(f"{run}:{job_ino}".encode(), digest_size=8).digest(), "big")


def chunk_size_for(nbytes: int, shards: int) -> int:
    """The chunk size of a job whose parameters are ``nbytes`` over ``shards`` shards (see the
    module docstring)."""
    per = max(1, nbytes // max(1, shards))
    size = MIN_CHUNK
    while size * 2 <= min(per, MAX_CHUNK):
        size *= 2
    return size


@dataclasses.dataclass
class _JobState:
    """What a :class:`DistributedOptimizer` knows of its job. A plain object, so that Keras and
    TensorFlow do not track it (its chunk map has integer keys; the wrapped optimizer is config)."""

    inner: Any
    vars: list[Any] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    layout: Any = None
    chunks: Any = None
    joined: bool = False
    restore: Any = None  # a checkpoint's state (an image, or a Keras optimizer's variables): written at the next join or step
    view: Any = None  # the wrapped optimizer as stock Keras has it, with this one's state (SavedAsKeras._keras_optimizer)
    view_key: Any = None  # what the view was read at: (rounds, iterations, the restore's id, joined, built)
    codec: Any = None  # the gradients' compression, or None
    residual: np.ndarray | None = None  # error feedback: what compression left out so far (float32)
    rounds: Any = None  # overlap "fifo"/"p3": the per-layer rounds (irdma.train.overlap.Rounds)
    group: Any = None  # hierarchy: this host's workers (irdma.train.hier.HostGroup)
    anchor: np.ndarray | None = None  # sync_every > 1: the weights at the last global step (float32, flat)
    since_sync: int = 0  # sync_every > 1: local steps since the last global step
    series: int | None = None  # BSP: the run's rounds (Round.series): pushes are summed on the shards
    clock: int = 0  # this worker's clock: the round its next push belongs to
    accumulated: list[np.ndarray] | None = None  # backward_passes_per_step > 1: the gradients so far
    passes: int = 0  # backward_passes_per_step > 1: the steps added into them


@keras.saving.register_keras_serializable(package="irdma")
class DistributedOptimizer(SavedAsKeras, keras.optimizers.Optimizer):  # type: ignore[misc]  # Keras ships no types
    """Wrap a Keras optimizer so that its steps run on the shards for every worker of the job
    (Horovod's ``hvd.DistributedOptimizer``; see the module docstring).

    Args:
        optimizer: a ``keras.optimizers`` SGD, Adam, AdamW, Adagrad, RMSprop or Ftrl (or its name).
            Its class and config decide what the shards apply; its ``learning_rate`` (a number
            or a schedule), ``weight_decay`` and clipping what the worker does each step.
        sync_timeout: seconds a clock or barrier wait, or a step's pushes, may take before the
            step fails (rank 0 writes it as the job's ``user.irdma.sync_timeout``).
        compress: ``"topk:F"`` (the largest F of each piece's elements) or ``"sign"`` (scaled
            signs): each step's gradients are encoded before the push (:mod:`irdma.wire.compress`)
            with error feedback (what a push leaves out is added to the next step's gradient,
            kept on this worker: Applied Sciences 2020's residual cache). Weight decay is pushed
            uncompressed.
        overlap: ``"none"`` (one push and one pull of the whole model per step), ``"p3"`` or
            ``"fifo"``: per-layer pushes during back-propagation and pulls during the next
            forward pass, by priority in slices of ``slice_elems`` float32 with ``"p3"``
            (:mod:`irdma.train.overlap`; the forward hooks come with :class:`BroadcastInitialWeights`).
        slice_elems: P3's slice, float32 elements (40,000: P3's own; 0: none).
        drop: layer dropping (with ``"p3"``/``"fifo"``): a layer's push waits on the worker
            while ``learning_rate * ||accumulated gradient||_1 < drop * ||weights||_1``.
        hierarchy: the workers of one host (``IRDMA_LOCAL_RANK``/``IRDMA_LOCAL_SIZE``, as ``irdma
            run -H`` sets them; ranks of a host are consecutive) sum their gradients in shared
            memory (:class:`irdma.train.hier.HostGroup`, DASO's node-local step) and the host's
            local rank 0 pushes the sum once (its weight decay times the host's workers) and
            pulls once for all of them; every worker still ticks its clock. With
            ``overlap="none"`` only.
        op: what a BSP round applies (:data:`Average`, Horovod's ``hvd.Average``: the mean of the
            workers' gradients; :data:`Sum`: their sum). Under ``--consistency bsp`` each step's
            pushes of the job's workers are summed on the shards and the wrapped optimizer takes
            one step on their mean (:mod:`irdma.server.rounds`), so N workers with batch B train
            as one process with batch N B; under SSP and ASP each push is a step of its own. In
            an elastic job (``--elastic``) a round whose worker died mid-round completes with the
            workers that pushed, its step on their mean (logged); a layer ``drop`` skips is a zero
            contribution; with ``hierarchy`` the hosts' local ranks 0 are the round's members, each
            pushing its host's sum times hosts / workers, so the round's mean is the workers'. Not
            with ``sync_every`` > 1: DASO's global step keeps its own average.
        compression: Horovod's ``hvd.Compression.none`` (``fp16`` is refused; ``compress`` is irdma's).
        backward_passes_per_step: Horovod's local gradient aggregation: the gradients of this many
            steps are added up on the worker (divided by their count with
            ``average_aggregated_gradients``) and pushed once, the weights unchanged between.
            With ``overlap="none"`` only. ``gradient_predivide_factor`` must stay 1.0;
            ``sparse_as_dense``, ``device_dense`` and ``device_sparse`` are accepted (every
            gradient is pushed dense, from the host).
        sync_every: DASO's global step every K steps (Coquelin et al., "Accelerating neural
            network training with distributed asynchronous and selective optimization (DASO)",
            J. Big Data 2022; local SGD, Stich, ICLR 2019). With K > 1 each step is a local step
            of plain SGD on the worker (with ``hierarchy=True``: with the mean gradient of the
            host's workers, summed in shared memory), and every K-th step, and at each epoch's
            end (:class:`BroadcastInitialWeights`), the worker (the host's local rank 0) adds
            its model's change since the last global step, times its host's workers over the
            job's, to the shards' weights (op ``add``: under BSP the shards then hold the
            average of the workers' models; under ASP a running mix), ticks its clock (BSP/SSP
            wait here) and every worker pulls the result. The cross-host traffic is 1/K of ``sync_every=1``.
            K > 1 needs a plain SGD optimizer (no momentum: the state would stay on one worker)
            and ``overlap="none"``, no ``compress``, no ``drop``, and no ``--elastic`` (the
            average divides by a fixed number of pushers).

    Raises:
        InvalidArgument: see :func:`update_of`; a bad ``overlap``, ``slice_elems``, ``drop`` or
            ``sync_every`` (or ``drop`` without per-layer rounds; ``sync_every`` > 1 with
            something it cannot go with).
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer | str | dict[str, Any], sync_timeout: float = 60.0,
                 name: str | None = None, compress: str | None = None, overlap: str = "none",
                 slice_elems: int = DEFAULT_SLICE_ELEMS, drop: float = 0.0, hierarchy: bool = False,
                 sync_every: int = 1, op: str = "average", compression: str = Compression.none,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False, device_dense: str = "",
                 device_sparse: str = "", **kwargs: Any) -> None:
        from . import overlap as _overlap

        if compression == Compression.fp16:
            raise InvalidArgument("compression=hvd.Compression.fp16: pushes are float32 or an encoded gradient",
                                  "use hvd.Compression.none, or compress='topk:0.01' or compress='sign' (with error"
                                  " feedback)")
        if compression != Compression.none:
            raise InvalidArgument(f"compression={compression!r}", "pass hvd.Compression.none, or compress='topk:F'/'sign'")
        if float(gradient_predivide_factor) != 1.0:
            raise InvalidArgument(f"gradient_predivide_factor={gradient_predivide_factor!r}: the shards divide the"
                                  " round's sum by the workers once", "leave it at 1.0")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise InvalidArgument(f"backward_passes_per_step={backward_passes_per_step!r}",
                                  "steps whose gradients are added up before a push: 1 or more")
        if backward_passes_per_step > 1 and (overlap != "none" or sync_every > 1 or hierarchy):
            raise InvalidArgument(f"backward_passes_per_step={backward_passes_per_step} adds up whole steps'"
                                  " gradients on the worker", "pass overlap='none', no hierarchy and sync_every=1")

        _overlap.check(overlap, slice_elems, float(drop))
        if op not in (Average, Sum):
            raise InvalidArgument(f"op={op!r}", f"pass op={Average!r} (hvd.Average, the default) or {Sum!r} (hvd.Sum)")
        if hierarchy and overlap != "none":
            raise InvalidArgument("hierarchy=True sums a whole step's gradients on the host first",
                                  "pass overlap='none' with it")
        if drop and overlap == "none":
            raise InvalidArgument("drop= skips pushes per layer: it needs per-layer rounds", "pass overlap='p3' too")
        inner = optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else keras.optimizers.get(optimizer)
        update = update_of(inner)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise InvalidArgument(f"sync_every={sync_every!r}", "steps per global step: 1 (every step) or more")
        if sync_every > 1:
            if update.op != UpdateOp.SGD or update.args[1] or update.flags:
                raise InvalidArgument(f"sync_every={sync_every} takes local steps of plain SGD on the workers (DASO),"
                                      f" not {_spec(update)!r}", "use keras.optimizers.SGD(lr) with no momentum")
            if overlap != "none" or compress or drop:
                raise InvalidArgument(f"sync_every={sync_every} moves whole models every {sync_every} steps",
                                      "pass overlap='none' and no compress or drop with it")
        cfg = inner.get_config()
        lr = learning_rate_of(inner)
        if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            lr = _lr_at(lr, 0)
        for key in ("learning_rate", "weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "name"):
            kwargs.pop(key, None)
        super().__init__(learning_rate=lr, weight_decay=cfg.get("weight_decay"), clipnorm=cfg.get("clipnorm"),
                         clipvalue=cfg.get("clipvalue"), global_clipnorm=cfg.get("global_clipnorm"),
                         name=name or f"distributed_{inner.name}", **kwargs)
        self.update = update
        for attr in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))
        self.sync_timeout = float(sync_timeout)
        self.compress = compress
        self.overlap, self.slice_elems, self.drop = overlap, int(slice_elems), float(drop)
        self.hierarchy = bool(hierarchy)
        self.sync_every = int(sync_every)
        self.reduce_op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.sparse_as_dense = bool(sparse_as_dense)  # every gradient is pushed dense
        self._job = _JobState(inner, codec=_codec(compress))
        self.rounds = 0
        self.pushes = 0  # whole-model pushes this worker made (overlap "none")
        self.pushed_bytes = 0  # push payload this worker sent (overlap "none"; per-layer: rounds.pushed_bytes)

    @property
    def inner(self) -> keras.optimizers.Optimizer:
        """The wrapped Keras optimizer (its config; it never steps)."""
        return self._job.inner

    @property
    def joined(self) -> bool:
        """Whether this worker joined the job already (:meth:`join`): its weights came from the
        shards."""
        return bool(self._job.joined)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> DistributedOptimizer:
        """A file saved by irdma before its files named the wrapped optimizer (``irdma>DistributedOptimizer``)."""
        config = dict(config)
        inner = keras.optimizers.deserialize(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)

    # ------------------------------------------------------------ the job
    def build(self, variables: list[Any]) -> None:
        if self.built:
            return
        super().build(variables)
        self._job.vars = list(variables)
        self._job.sizes = [int(np.prod(v.shape)) for v in self._job.vars]
        if self.overlap != "none":
            from .overlap import Rounds

            self._job.rounds = Rounds(self.overlap, self.slice_elems, self.drop, self._job.vars, self._job.sizes)

    def attach(self, model: Any) -> None:
        """Per-layer rounds (``overlap="p3"``/``"fifo"``): each layer of ``model`` that owns
        trainable variables waits, in its forward pass, for its own pull only (called by
        :class:`BroadcastInitialWeights` before the first step; later it changes nothing)."""
        if self._job.rounds is not None:
            self._job.rounds.attach(model, self._await_group)

    def flush(self) -> None:
        """Apply the pulls still in flight to the variables (per-layer rounds: they are
        otherwise applied by each layer's next forward pass); a no-op otherwise. Eager."""
        if self._job.rounds is not None:
            self._job.rounds.flush()

    def _await_group(self, g: int) -> int:
        rounds = self._job.rounds
        if g in rounds.pending:
            rounds.waited_in_forward += 1
        return int(rounds.apply_pull(g))
    def join(self) -> None:
        """Join the job (see the module docstring); eager. Called by
        :class:`BroadcastInitialWeights`, else by the first step.

        Raises:
            InvalidArgument: the job holds parameters of another model (another layout).
            irdma.IrdmaError (e.g. SyncTimeout): a worker did not arrive in time.
        """
        if self._job.joined:
            return
        if not self.built:
            raise InvalidArgument("the optimizer is not built yet", "call join() from a callback of model.fit")
        client, job, me, n = _need("client"), _need("job"), _need("rank"), _need("size")
        params = f"{job}/{PARAMS}"
        layout = [{"name": v.path, "shape": list(v.shape), "offset": 4 * sum(self._job.sizes[:i]), "dtype": "<f4"}
                  for i, v in enumerate(self._job.vars)]
        total = 4 * sum(self._job.sizes)
        job_ino = _member()
        try:
            staleness = coord.parse_consistency(client.client.store.getxattr(job_ino, coord.XATTR_CONSISTENCY)).staleness
        except NoAttribute:
            staleness = None  # ASP
        if self._job.rounds is not None:  # ASP: no clock wait between a layer's push and its pull
            self._job.rounds.asp = staleness is None
        if staleness == 0 and self.sync_every == 1:
            # a round sums every member's push of each range (a layer drop= skips pushes zero; an
            # elastic job's rounds are closed after each clock)
            self._job.series = series_of(job_ino)
            if self.backward_passes_per_step == 1 and not self.hierarchy:  # hvd.Embedding's rows join the round
                _world["in_round"] = self._in_round
        if self.hierarchy and self._job.group is None:
            if _world.get("elastic") is not None:
                raise InvalidArgument("hierarchy=True cannot follow an elastic job's membership (a host group has"
                                      " a fixed size)", "drop hierarchy=True or --elastic")
            self._job.group = _host_group(4 * sum(self._job.sizes), self.sync_timeout)
        if self.sync_every > 1 and _world.get("elastic") is not None:
            raise InvalidArgument(f"sync_every={self.sync_every} averages over a fixed number of workers, and this job"
                                  " is elastic", "drop sync_every or --elastic")
        if me == 0:
            client.client.store.setxattr(job_ino, XATTR_SYNC_TIMEOUT, repr(self.sync_timeout).encode())
            if self._job.rounds is not None:  # what an operator reads of the job (getfattr -d JOB)
                from .comm import XATTR_DROP, XATTR_SLICE

                client.client.store.setxattr(job_ino, XATTR_SLICE, str(self.slice_elems).encode())
                client.client.store.setxattr(job_ino, XATTR_DROP, repr(self.drop).encode())
            try:
                have = json.loads(bytes(client.read(f"{job}/{LAYOUT}")))
            except NotFound:  # a new job (any other error: raised, never taken for one)
                have = None
            if have is not None and [t["shape"] for t in have] != [t["shape"] for t in layout]:
                # (by shapes: names differ between processes, e.g. dense_1 for a model built twice)
                raise InvalidArgument(f"job {job} holds the parameters of another model (its {LAYOUT} differs)",
                                      "pass a new job name (irdma run --job NAME), or remove the job's directory")
            if have is None:
                shards = max(1, len(client.shard_stats()))
                client.create(params, chunk_size=chunk_size_for(total, shards))
                client.write(params, _flat([np.asarray(v.numpy()) for v in self._job.vars]), op="assign")
                client.set_update_op(params, _spec(self.update))
                client.write(f"{job}/{LAYOUT}", json.dumps(layout, indent=1).encode(), op="assign",
                             chunk_size=MIN_CHUNK)  # a small file: a small chunk (shards hold whole chunks)
            if self._job.restore is not None and not _world["rejoin"]:
                self._write_checkpoint()
        if _world["rejoin"]:
            self._job.restore = None  # the job's weights and state are newer than any checkpoint
        if _world["rejoin"]:  # the others passed the start long ago: wait for the weights only
            _wait_for(lambda: client.stat(params).update_op, f"the job's parameters {params}")
        elif _world["elastic"] is not None:  # an elastic job starts with every worker launched, else its minimum
            low = _world["elastic"][0]
            _wait_for(lambda: client.stat(params).update_op, f"the job's parameters {params}")

            def live() -> int:
                return sum(m.live for m in client.run(client.client.meta.members, job_ino))

            try:
                _wait_for(lambda: live() >= n, f"{n} live workers", self.sync_timeout, coord.SyncTimeout)
            except coord.SyncTimeout:
                _wait_for(lambda: live() >= low, f"{low} live workers (the elastic minimum)", self.sync_timeout,
                          coord.SyncTimeout)
                log.warning("rank %d starts with %d of %d workers (the elastic minimum is %d)", me, live(), n, low)
        else:
            client.run(client.client.barrier, barrier_name("start"), n, self.sync_timeout)

        async def locate(cl: Any) -> tuple[Any, Any]:
            from ..client.native import layout_of

            inode = await cl.meta.resolve(params)
            return layout_of(inode), await cl.meta.chunk_map(inode.ino)

        self._job.layout, self._job.chunks = client.run(locate, client.client)
        self._job.clock = int(_world["clock"])
        self._job.joined = True
        step = _world["clock"] * self.sync_every  # a clock tick is a round: K steps under sync_every
        if _world["rejoin"] and step > int(self._iterations.numpy()):
            # the job's step (its clock counts every worker's rounds): a schedule goes on where the job is
            self._iterations.assign(step)
        for v, w in zip(self._job.vars, self._pull(), strict=True):
            v.assign(w)
        self._job.anchor = None  # sync_every > 1: the next step starts from these weights

    def pull_weights(self) -> None:
        """Set the variables to the shards' current weights (eager): after training, every
        worker's steps (call :func:`barrier` first to wait for the others)."""
        self.join()
        self.flush()
        for v, w in zip(self._job.vars, self._pull(), strict=True):
            v.assign(w)
        self._job.anchor = None  # sync_every > 1: local steps go on from these weights

    # ------------------------------------------------------------ checkpoints
    def _write_checkpoint(self) -> None:
        """Rank 0: make the job's weights the variables' values and its optimizer state the
        image a checkpoint restored (:meth:`irdma.Client.write_state`: the weights go with op
        ``assign``, then the state, before the next gradient)."""
        client, job = _need("client"), _need("job")
        image, self._job.restore = self._job.restore, None
        self._job.anchor = None  # sync_every > 1: local steps start again from the checkpoint's weights
        if _need("rank") != 0:
            return
        params = f"{job}/{PARAMS}"
        client.write(params, _flat([np.asarray(v.numpy()) for v in self._job.vars]), op="assign")
        if image is not None:  # as an image under the file's chunks (the join calls this before it reads the layout)
            image = self._image_at(image, client.stat(params).chunk_size)
        if image:
            client.run(client.client.write_state, params, image)

    def _restore_now(self) -> None:
        """A checkpoint restored after the job was joined: written to the job, unless this
        worker rejoined a running job (whose weights and state are newer: dropped)."""
        if _world.get("rejoin"):
            self._job.restore = None
            log.warning("a checkpoint restored into a worker that rejoined a running job is ignored: the job's"
                        " weights and optimizer state are newer")
            return
        self._write_checkpoint()

    def _state_image(self) -> bytes:
        """The job's state image: the shards' (read now), or a restored one not written yet (before the join: any chunks)."""
        restore = self._job.restore
        if restore is not None:
            return restore if isinstance(restore, bytes) else self._image_at(
                restore, self._job.layout.chunk_size if self._job.joined else MIN_CHUNK)
        if not self._job.joined:
            return b""
        self.flush()  # the model's weights are saved too: the pulls in flight first
        return bytes(_need("client").run(_need("client").client.read_state, f"{_need('job')}/{PARAMS}"))

    def _serialize_to_tensors(self) -> dict[str, Any]:
        """``tf.train.Checkpoint``, ``tf.saved_model.save``: the shards' optimizer state image, read
        at save time (the optimizer's variables are its children). Traced (a SavedModel's save and
        restore functions, which run without irdma), empty."""
        return {"irdma_state": tf.constant(self._state_image() if tf.executing_eagerly() else b"", dtype=tf.string)}

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        if tf.executing_eagerly():
            self._job.restore = bytes(restored_tensors["irdma_state"].numpy())
        return tf.no_op()

    # ------------------------------------------------------------ the step
    def _pull(self) -> list[np.ndarray]:
        return self._split(self._pull_flat())

    def _pull_flat(self) -> np.ndarray:
        flat = np.empty(sum(self._job.sizes), dtype="<f4")
        client = _need("client")

        async def pull(cl: Any) -> None:
            await cl.read_into(self._job.layout, 0, memoryview(flat).cast("B"), self._job.chunks)  # type: ignore[arg-type]

        client.submit(pull, timeout=self.sync_timeout).result()
        return flat

    def _split(self, flat: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for v, n in zip(self._job.vars, self._job.sizes, strict=True):
            out.append(flat[start : start + n].reshape(v.shape))
            start += n
        return out

    def _in_round(self, update: Update | UpdateOp) -> Update | UpdateOp:
        """``update`` as this worker's contribution to the job's round (BSP: the shards apply
        the mean, or with ``op="sum"`` the sum, of every worker's push once; :mod:`irdma.server.rounds`),
        else as it is (SSP, ASP: each push is a step)."""
        series = self._job.series
        if series is None:
            return update
        u = update if isinstance(update, Update) else Update(UpdateOp(update))
        me = _need("rank")
        flags = ROUND_SUM if self.reduce_op == Sum else 0
        if self.hierarchy:  # a host's local rank 0 pushes for the host: the round's members are the hosts
            return dataclasses.replace(u, round=Round(series, self._job.clock, cross_rank(), cross_size(), flags))
        if _world.get("elastic") is not None:  # members may die mid-round: closed by _close_round
            return dataclasses.replace(u, round=Round(series, self._job.clock, me, max(_need("size"), me + 1),
                                                      flags | ROUND_ELASTIC))
        return dataclasses.replace(u, round=Round(series, self._job.clock, me, _need("size"), flags))

    def _close_round(self, done: int) -> None:
        """An elastic BSP job, once the job's clock passed round ``done``: the shards apply every
        round up to it with the contributions they have (a member that died mid-round pushed
        none), before this worker pulls (:meth:`irdma.Client.close_round`)."""
        if self._job.series is None or _world.get("elastic") is None:
            return
        client = _need("client")
        short = client.run(client.client.close_round, Round(self._job.series, done, _need("rank"), 1, ROUND_ELASTIC))
        if short:
            log.warning("BSP job %s: round %d completed with the workers that pushed (%d ranges had a member"
                        " missing: it died mid-round), its step on their mean", _need("job"), done, short)

    def _step(self, lr: Any, *tensors: Any) -> list[np.ndarray]:
        """Eager (inside ``tf.py_function``): push the decay (if any) and the gradients, end the
        round, pull the weights."""
        self.join()
        if self._job.restore is not None:  # a checkpoint restored since the job was joined
            self._restore_now()
        k = len(self._job.vars)
        decays, grads = tensors[:-k], tensors[-k:]
        if self.sync_every > 1:
            return self._local_step(float(lr.numpy()), decays, grads)
        if self.backward_passes_per_step > 1:  # Horovod's local gradient aggregation
            job = self._job
            now = [np.asarray(g.numpy(), dtype=np.float32) for g in grads]
            job.accumulated = now if job.accumulated is None else [a + g for a, g in zip(job.accumulated, now, strict=True)]
            job.passes += 1
            if job.passes < self.backward_passes_per_step:
                return [np.asarray(v.numpy()) for v in job.vars]  # no push: the weights stay
            scale = np.float32(1.0 / job.passes) if self.average_aggregated_gradients else np.float32(1.0)
            grads = tuple(_Eager(a * scale) for a in job.accumulated)
            job.accumulated, job.passes = None, 0
        update = self._in_round(_with_learning_rate(self.update, float(lr.numpy())))
        data = _flat([g.numpy() for g in grads])
        client, job, me = _need("client"), _need("job"), _need("rank")
        group = self._job.group
        if group is not None:  # the host's sum goes in one push, by its local rank 0
            total = group.reduce_to_leader(data)
            if total is None:
                client.run(client.client.clock, job, me)
                self.rounds += 1
                return self._split(group.broadcast(None))
            data = np.ascontiguousarray(total, dtype="<f4")
            if self._job.series is not None and self.reduce_op != Sum:
                # a BSP round averages over the hosts: each host's sum times hosts / workers makes
                # that mean the workers' (Horovod's average, whatever the hosts' sizes)
                data *= np.float32(cross_size() / _need("size"))
        codec = self._job.codec
        if codec is not None:  # error feedback: what earlier pushes left out goes now
            if self._job.residual is None:
                self._job.residual = np.zeros(len(data), dtype=np.float32)
            data += self._job.residual
        decay = None
        if decays:
            decay = _flat([-d.numpy() for d in decays])
            if group is not None and self._job.series is None:  # every worker of the host would have pushed its own
                decay *= np.float32(group.size)
        layout, chunks = self._job.layout, self._job.chunks

        async def step(cl: Any) -> None:
            created: list[Any] = []
            if decay is not None:
                created += await cl.write_from(layout, 0, decay, self._in_round(UpdateOp.ADD), chunks)
            created += await cl.write_from(layout, 0, data, update, chunks, compress=codec,
                                           feedback=self._job.residual if codec is not None else None)
            if created:  # chunks the file had not stored (a replica back from a failure): record them
                await cl.meta.extend(layout.file_id, 4 * sum(self._job.sizes), time.time_ns(), tuple(created))
                for index, shard, incarnation in created:
                    chunks.setdefault(index, {})[shard] = incarnation

        client.submit(step, timeout=self.sync_timeout).result()  # the pushes: each request has its deadline too
        from .overlap import payload_bytes

        self.pushed_bytes += payload_bytes(data.size, codec) + (decay.nbytes if decay is not None else 0)
        done = self._job.clock
        self._job.clock = client.run(client.client.clock, job, me)  # the round's end: the job's sync timeout bounds its wait
        self._close_round(done)
        self.rounds += 1
        self.pushes += 1
        if group is not None:
            return self._split(group.broadcast(self._pull_flat()))
        return self._pull()

    def _local_step(self, lr: float, decays: Any, grads: Any) -> list[np.ndarray]:
        """``sync_every`` > 1 (DASO, see the class docstring): a local SGD step; every K-th, the
        global step. Eager, inside the step's ``tf.py_function``."""
        job_state, group = self._job, self._job.group
        weights = _flat([np.asarray(v.numpy()) for v in job_state.vars])
        if job_state.anchor is None:  # the weights of the last pull (join, a restored checkpoint)
            job_state.anchor = weights.copy()
        grad = _flat([g.numpy() for g in grads])
        if group is not None:  # the host's mean gradient (every worker of the host takes the same step)
            grad = group.allreduce(grad) / np.float32(group.size)
        weights -= np.float32(lr) * grad
        if decays:
            weights -= _flat([d.numpy() for d in decays])
        job_state.since_sync += 1
        if job_state.since_sync < self.sync_every:
            return self._split(weights)
        return self._split(self._global_step(weights))

    def synchronize(self) -> None:
        """``sync_every`` > 1: a global step now if local steps were taken since the last one, and
        the variables set to its result (:class:`BroadcastInitialWeights` calls it at each
        epoch's end and at the end of training, so every epoch ends with the workers' average;
        every worker must call it at the same point). A no-op otherwise. Eager."""
        if self.sync_every > 1 and self._job.joined and self._job.since_sync:
            flat = self._global_step(_flat([np.asarray(v.numpy()) for v in self._job.vars]))
            for v, w in zip(self._job.vars, self._split(flat), strict=True):
                v.assign(w)

    def _global_step(self, weights: np.ndarray) -> np.ndarray:
        """DASO's global step from this worker's ``weights`` (float32, flat): its change since
        the last one, times its host's workers over the job's workers, added on the shards (so
        each worker's change counts 1/n under BSP, whatever the hosts' sizes), the clock ticked,
        the result pulled (and handed to the host's workers)."""
        job_state, group = self._job, self._job.group
        assert job_state.anchor is not None
        job_state.since_sync = 0
        client, job, me, n = _need("client"), _need("job"), _need("rank"), _need("size")
        if group is None or group.is_leader:
            share = np.float32((group.size if group is not None else 1) / n)
            delta = np.ascontiguousarray((weights - job_state.anchor) * share, dtype="<f4")
            layout, chunks = job_state.layout, job_state.chunks

            async def push(cl: Any) -> None:
                created = await cl.write_from(layout, 0, delta, Update(UpdateOp.ADD), chunks)
                if created:  # chunks the file had not stored (a replica back from a failure): record them
                    await cl.meta.extend(layout.file_id, 4 * sum(job_state.sizes), time.time_ns(), tuple(created))
                    for index, shard, incarnation in created:
                        chunks.setdefault(index, {})[shard] = incarnation

            client.submit(push, timeout=self.sync_timeout).result()
            self.pushed_bytes += delta.nbytes
        client.run(client.client.clock, job, me)  # BSP/SSP: every pusher's change is in before the pull
        self.rounds += 1
        self.pushes += 1 if group is None or group.is_leader else 0
        if group is not None:
            pulled = group.broadcast(self._pull_flat() if group.is_leader else None)
        else:
            pulled = self._pull_flat()
        job_state.anchor = np.array(pulled, dtype=np.float32)
        return np.asarray(pulled, dtype=np.float32)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> Any:
        variables = list(trainable_variables) if trainable_variables is not None else self._job.vars
        if not self.built:
            self.build(variables)
        if _in_xla():
            raise InvalidArgument("DistributedOptimizer's step cannot be XLA-compiled (it calls the shards from"
                                  " Python)", "compile the model with jit_compile=False (Keras turns XLA on by"
                                  " default where there is a GPU)")
        if [id(v) for v in variables] != [id(v) for v in self._job.vars]:
            raise InvalidArgument("the model's trainable variables changed since the optimizer joined the job"
                                  " (a layer frozen or unfrozen?)", "make a new DistributedOptimizer (and a new"
                                  " job) for the new set of variables")
        if any(getattr(v, "constraint", None) is not None for v in variables):
            raise InvalidArgument("a variable has a constraint, which the shards cannot apply",
                                  "drop kernel_constraint/bias_constraint, or use a penalty in the loss")
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g, dtype=tf.float32)
                 for g, v in zip(grads, variables, strict=True)]
        grads = self._clip_gradients(grads)
        lr = tf.cast(self.learning_rate, tf.float32)
        decays = []
        if self.weight_decay:
            wd = tf.cast(self.weight_decay, tf.float32)
            decays = [v * wd * lr if self._use_weight_decay(v) else tf.zeros_like(v) for v in self._job.vars]
        rounds = self._job.rounds
        if rounds is not None:  # per layer, last first: each push starts when its gradients exist
            rounds.group_by_path()
            tokens = []
            for g in reversed(range(len(rounds.groups))):
                idx = rounds.groups[g]
                tokens.append(tf.py_function(functools.partial(self._push_group, g),
                                             [lr, *([decays[i] for i in idx] if decays else []), *[grads[i] for i in idx]],
                                             Tout=tf.int64))
            with tf.control_dependencies([tf.py_function(self._end_round, tokens, Tout=tf.int64)]):
                self._iterations.assign_add(1)
            return self._iterations
        new = tf.py_function(self._step, [lr, *decays, *grads], Tout=[tf.float32] * len(grads))
        for v, w in zip(variables, new, strict=True):
            v.assign(tf.reshape(w, v.shape))
        self._iterations.assign_add(1)
        return self._iterations

    def _push_group(self, g: int, lr: Any, *tensors: Any) -> int:
        """Eager (a ``tf.py_function`` of the step): start layer group ``g``'s push."""
        rounds = self._job.rounds
        if not rounds.started:  # the round's first push
            self.join()
            if self._job.restore is not None:
                rounds.pending.clear()  # pulls of the weights before the checkpoint: not applied
                self._restore_now()
            rounds.started = True
        k = len(rounds.groups[g])
        decays, grads = tensors[:-k], tensors[-k:]
        rate = float(lr.numpy())
        decay = rounds.flat(g, [-d.numpy() for d in decays]) if decays else None
        rounds.push(_need("client"), g, self._job.layout, self._job.chunks, sum(self._job.sizes),
                    self._in_round(_with_learning_rate(self.update, rate)), rounds.flat(g, [t.numpy() for t in grads]),
                    decay, self._job.codec, rate, self.sync_timeout, self._in_round(UpdateOp.ADD))
        return 0

    def _end_round(self, *tokens: Any) -> int:
        """Eager: every push acknowledged, the worker's clock ticked (BSP/SSP wait here), every
        layer's pull started (an ASP job's started with its push); the pulls of layers without
        a forward hook are applied now."""
        rounds = self._job.rounds
        client = _need("client")
        rounds.started = False
        rounds.wait_pushes()
        done = self._job.clock
        self._job.clock = client.run(client.client.clock, _need("job"), _need("rank"))
        self._close_round(done)
        self.rounds += 1
        rounds.start_pulls(client, self._job.layout, self._job.chunks, self.sync_timeout)
        for g in range(len(rounds.groups)):
            if g not in rounds.hooked:
                rounds.apply_pull(g)
        return 0


def _codec(compress: str | None) -> Any:
    """The parsed ``compress`` option (None for none).

    Raises:
        InvalidArgument: a value :func:`irdma.wire.compress.parse_compress` refuses.
    """
    if not compress:
        return None
    from ..wire.compress import parse_compress

    try:
        codec = parse_compress(compress)
    except ValueError as exc:
        raise InvalidArgument(f"compress={compress!r}: {exc}", "e.g. compress='topk:0.01' or 'sign'") from None
    return codec or None


def _in_xla() -> bool:
    """Whether the graph being built is XLA-compiled (TensorFlow's own test; private API, so
    False when it moved)."""
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # noqa: BLE001 - a TensorFlow without it: XLA then fails with its own error
        return False


class _Eager:
    """A NumPy array where the step expects an eager tensor (``.numpy()``)."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def numpy(self) -> np.ndarray:
        return self.value


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    """Every tensor in layout order as one little-endian float32 buffer (one copy)."""
    return np.concatenate([np.asarray(a, dtype="<f4").ravel() for a in arrays])
