"""``irdma.keras.Embedding``: a Keras embedding layer whose table lives on the shards.

The one workload a parameter server exists for: a table larger than a worker's memory. The
table is one file of the job, ``JOB/embedding-NAME`` (``input_dim`` rows of ``output_dim``
little-endian float32, row-major; its shape recorded with :meth:`irdma.Client.set_shape`), whose
update op is the layer's optimizer, applied on the shards row by row.

* Forward: the batch's distinct ids are pulled (:meth:`irdma.Client.pull_rows`: one sparse
  request per shard) and gathered into the output, shape ``ids.shape + (output_dim,)``.
* Backward: the gradient of each distinct row (duplicates summed, as TensorFlow sums a
  gather's gradient) is pushed (:meth:`irdma.Client.push_rows`) and the shards apply the
  optimizer to those rows only: a *lazy* update, as TensorFlow's sparse ``apply`` and
  LazyAdam do (rows not in the batch keep their weights and optimizer state). Under BSP with
  a :class:`~irdma.train.distributed.DistributedOptimizer` (one push per step) the rows are the
  worker's contribution to the job's round: the shards sum every worker's rows (a row some
  workers did not push counts zero for them) and apply the optimizer once to their mean, on
  the rows any worker pushed (:meth:`irdma.server.rounds.Rounds.contribute_rows`), so N
  workers with batch B train the table as one process with batch N B. With SGD this
  is what ``keras.layers.Embedding`` does; with Adagrad too when a batch holds each id once
  (Keras's sparse Adagrad squares a repeated id's gradients apart, the shards their sum).

The push happens during back-propagation, through a zero "hook" weight of the layer whose
gradient carries it (``tf.custom_gradient``); the model's optimizer sees a zero gradient for
that weight. So, unlike ``keras.layers.Embedding``: every gradient taken through the layer
updates the table (also a ``GradientTape`` outside ``fit``), a layer called twice in one step
takes two steps, a loss scale (mixed precision) reaches the table unscaled by Keras, and there
is no ``mask_zero`` nor SavedModel export. Rank 0 creates and initializes the table at its
first use (Keras's ``uniform`` initializer by default, written in 4 Mi-float slices); the other
ranks wait until it is ready. The table is named by the layer's name: a job run again finds
it (same shape and optimizer) and keeps it; name the layer (``name=``) for that.
"""

from __future__ import annotations

import copy
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .._errors import InvalidArgument, NotFound
from ..wire.optimizers import format_update, parse_update
from . import distributed as D
from . import world as W
from .keras_updates import update_of
from .world import _need, _wait_for

#: Floats per initialization write.
INIT_SLICE = 4 << 20


@keras.saving.register_keras_serializable(package="irdma")
class Embedding(keras.layers.Layer):  # type: ignore[misc]  # Keras ships no types
    """Turn integer ids into dense vectors of ``output_dim`` float32 from a table of
    ``input_dim`` rows on the shards (see the module docstring).

    Args:
        input_dim: rows of the table (ids are ``0 .. input_dim - 1``).
        output_dim: floats per row.
        optimizer: what the shards apply to the rows pushed: a Keras SGD, Adam, Adagrad,
            RMSprop or Ftrl (its learning rate at step 0; no schedule, weight decay or clipping), or a
            ``user.irdma.update`` string. Default: Adagrad(0.05), the usual choice for sparse
            features.
        embeddings_initializer: a Keras initializer for the new table (rank 0, first step).

    Raises:
        InvalidArgument: a bad size or optimizer (when the layer is made); an id outside the
            table (at the step: the shards refuse the request, nothing is applied).
    """

    def __init__(self, input_dim: int, output_dim: int, optimizer: Any = None,
                 embeddings_initializer: Any = "uniform", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if int(input_dim) < 1 or int(output_dim) < 1:
            raise InvalidArgument(f"an embedding of {input_dim} x {output_dim}", "input_dim and output_dim are >= 1")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.optimizer_spec = _spec_of(optimizer if optimizer is not None else keras.optimizers.Adagrad(0.05))
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._ready = False
        self._update: Any = None  # the table's update op, parsed (BSP rounds)
        self.supports_jit = False  # tf.py_function: a model holding this layer is never XLA-compiled

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim,
                "optimizer": self.optimizer_spec,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer)}

    def build(self, input_shape: Any) -> None:
        self.hook = self.add_weight(name="hook", shape=(1,), initializer="zeros", trainable=True)

    @property
    def path(self) -> str:
        """The table's file in the namespace."""
        return f"{W.job_dir()}/embedding-{self.name}"

    # ------------------------------------------------------------ the table
    def _ensure_table(self) -> None:
        """Rank 0: create and initialize the table unless the job has it (then: the same shape
        and optimizer, or InvalidArgument). Other ranks: wait until rank 0 set the table's
        update op, its last step (no barrier: one rank may use the table alone)."""
        if self._ready:
            return
        client = _need("client")
        row = 4 * self.output_dim
        if W.rank() == 0:
            client.makedirs(W.job_dir())
            try:
                have = client.stat(self.path)
            except NotFound:  # a new table (any other error: raised, never taken for one)
                have = None
            if have is None:
                shards = max(1, len(client.shard_stats()))
                client.create(self.path, chunk_size=D.chunk_size_for(self.input_dim * row, shards))
                client.set_shape(self.path, [self.input_dim, self.output_dim])
                total, done = self.input_dim * self.output_dim, 0
                per = max(self.output_dim, INIT_SLICE - INIT_SLICE % self.output_dim)
                init = self.embeddings_initializer
                if isinstance(getattr(init, "seed", None), int):  # Keras 3 draws an int seed's values again
                    init = copy.copy(init)  # at every call: a generator gives each slice its own
                    init.seed = keras.random.SeedGenerator(init.seed)
                while done < total:
                    n = min(per, total - done)
                    part = init((n // self.output_dim, self.output_dim), dtype="float32")
                    client.write(self.path, np.asarray(part, dtype="<f4"), 4 * done, op="assign")
                    done += n
                client.set_update_op(self.path, self.optimizer_spec)
            elif have.size != self.input_dim * row or (have.update_op or "") != self.optimizer_spec:
                raise InvalidArgument(f"{self.path} holds another table ({have.size // row} rows of {self.output_dim}"
                                      f" floats, update {have.update_op!r}), not {self.input_dim} rows with"
                                      f" {self.optimizer_spec!r}", "name the layer (name=...) as before, pass a"
                                      " new job name, or remove the job's directory")
        else:
            _wait_for(lambda: (client.stat(self.path).update_op or "") == self.optimizer_spec,
                      f"rank 0's table {self.path}")
        self._ready = True

    def write_table(self, table: np.ndarray, first_row: int = 0) -> None:
        """Assign rows ``first_row ..`` of the table (float32, shape ``(n, output_dim)``),
        e.g. a pretrained one (creates the table first if needed)."""
        self._ensure_table()
        _need("client").write(self.path, np.ascontiguousarray(table, dtype="<f4"), 4 * first_row * self.output_dim,
                              op="assign")

    def read_table(self, ids: Any = None) -> np.ndarray:
        """Rows ``ids`` of the table (all of it by default), float32 ``(len(ids), output_dim)``."""
        self._ensure_table()
        ids = np.arange(self.input_dim) if ids is None else np.asarray(ids, dtype=np.int64)
        return np.asarray(_need("client").pull_rows(self.path, ids, row_len=self.output_dim))

    # ------------------------------------------------------------ the step
    def _pull(self, ids: Any) -> np.ndarray:
        self._ensure_table()
        return np.asarray(_need("client").pull_rows(self.path, ids.numpy(), row_len=self.output_dim),
                          dtype=np.float32)

    def _push(self, ids: Any, grad: Any) -> np.ndarray:
        in_round = W._world.get("in_round")  # BSP: this worker's contribution to the job's round
        op = None
        if in_round is not None:
            if self._update is None:
                self._update = parse_update(self.optimizer_spec)
            op = in_round(self._update)
        _need("client").push_rows(self.path, ids.numpy(), grad.numpy(), row_len=self.output_dim, op=op)
        return np.zeros(1, dtype=np.float32)

    def call(self, inputs: Any) -> Any:
        ids = tf.cast(inputs, tf.int64)
        flat = tf.reshape(ids, [-1])
        distinct, where = tf.unique(flat)

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        def lookup(hook: Any) -> Any:
            rows = tf.py_function(self._pull, [distinct], tf.float32)
            rows = tf.reshape(rows, [-1, self.output_dim])

            def grad(dy: Any) -> Any:
                dense = tf.convert_to_tensor(dy)  # a gather's IndexedSlices: duplicates summed
                done = tf.py_function(self._push, [distinct, dense], tf.float32)
                return tf.reshape(done, tf.shape(hook))

            return rows, grad

        out = tf.gather(lookup(self.hook), where)
        return tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (*input_shape, self.output_dim)


def _spec_of(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        try:
            update = parse_update(optimizer)
        except ValueError as exc:
            raise InvalidArgument(f"embedding optimizer {optimizer!r}: {exc}") from None
        if not update.op.is_optimizer:
            raise InvalidArgument(f"embedding optimizer {optimizer!r} is not an optimizer", "e.g. 'adagrad learning_rate=0.05'")
        return format_update(update)
    cfg = optimizer.get_config()
    if cfg.get("weight_decay") or cfg.get("clipnorm") or cfg.get("clipvalue") or cfg.get("global_clipnorm"):
        raise InvalidArgument("an embedding's optimizer cannot decay or clip on the shards",
                              "drop weight_decay and clipping for the table")
    if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or isinstance(
            getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
        raise InvalidArgument("an embedding's optimizer takes a constant learning rate", "pass a number")
    return format_update(update_of(optimizer))
