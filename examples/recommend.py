"""A recommendation model whose embedding table lives on the parameter servers.

Click data from a known generative model (numpy, seeded; no download): users and items with
hidden factors, Zipf-skewed popularity (popular ids repeat, most rows are rare), and a click
with probability ``sigmoid(<user factors, item factors> + item bias)``. Users and items are
hashed into ONE table of ``--rows`` rows of ``--dim`` floats (1,000,000 x 64 by default); the
model looks up a (user, item) pair in one call of the table and puts a small tower on top
(``[u, v, u * v]`` -> Dense 64 relu -> Dense 1 sigmoid). Adagrad (learning rate 0.2) for the
table and the dense weights alike, applied lazily to the batch's rows of the table (duplicate
ids summed first) in both modes: on the shards by ``irdma.keras.Embedding``; locally by
:class:`LazyAdagrad` over a ``keras.layers.Embedding`` that gathers its rows
(:class:`RowEmbedding`), since Keras 3's own pair does whole-table work at every step (1.3 s
a step against about 10 ms for 1M x 64 on this machine; ``--local --stock-keras`` runs it).

Two ways to run the same model on the same data::

    # the baseline: one process, keras.layers.Embedding (the table in this process's memory)
    python examples/recommend.py --local

    # two workers: the table on the shards (irdma.keras.Embedding), the dense weights through
    # irdma.keras.DistributedOptimizer, each worker on its half of the training data
    irdma run -n 2 -- python examples/recommend.py

Both print the held-out AUC (``auc: 0.xxxx``; under ``irdma run`` rank 0 does, after every
worker finished) beside the AUC of the ground truth's own probabilities, the best any model
can do. ``--json PATH`` writes the figures (and each rank's training times, which
``benchmarks/embedding.py`` reads).

Measured with the defaults (1,000,000 x 64 table, 1,000,000 training clicks, 2 epochs,
batch 512 per worker; 2-core machine): local AUC 0.6849 (42 s of training); 2 workers AUC
0.6872 (152 s of training, 166 s for all of ``irdma run``); the ground truth 0.7711.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

#: Hidden factors of the ground truth.
FACTORS = 8


def mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finalizer) of ``x`` with ``salt``: how an id
    becomes a row of the shared table (the hashing trick)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def make_data(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Training and held-out clicks from the seeded generative model: ``x`` is ``(n, 2)``
    int64 table rows (user, item), ``y`` float32 clicks, ``p`` the true click probability."""
    rng = np.random.default_rng(args.seed)
    users, items = args.users, args.items
    user_f = rng.standard_normal((users, FACTORS)) / np.sqrt(FACTORS) * 1.5
    item_f = rng.standard_normal((items, FACTORS)) / np.sqrt(FACTORS) * 1.5
    item_b = rng.normal(-1.0, 1.0, items)

    def zipf(n: int, s: float) -> np.ndarray:  # popularity: p(rank r) ~ 1 / r^s, ranks shuffled over the ids
        p = 1.0 / np.arange(1, n + 1) ** s
        return rng.permutation(p / p.sum())

    pu, pi = zipf(users, args.zipf), zipf(items, args.zipf)
    out: dict[str, np.ndarray] = {}
    for part, n in (("train", args.train), ("test", args.test)):
        u = rng.choice(users, n, p=pu)
        i = rng.choice(items, n, p=pi)
        p = 1.0 / (1.0 + np.exp(-(np.einsum("nk,nk->n", user_f[u], item_f[i]) + item_b[i])))
        y = (rng.random(n) < p).astype("float32")
        rows = np.stack([mix(u, 1), mix(i, 2)], axis=1) % np.uint64(args.rows)
        out[f"x_{part}"], out[f"y_{part}"], out[f"p_{part}"] = rows.astype(np.int64), y, p.astype("float32")
    return out


def build_model(table: Any, dim: int) -> keras.Model:
    """The model on top of ``table`` (any layer mapping ``(batch, 2)`` ids to
    ``(batch, 2, dim)``): one lookup of the (user, item) pair, then a small tower."""
    inp = keras.Input((2,), dtype="int64")
    pair = table(inp)
    u, v = pair[:, 0, :], pair[:, 1, :]
    x = keras.layers.Concatenate()([u, v, keras.layers.Multiply()([u, v])])
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))


class RowEmbedding(keras.layers.Embedding):  # type: ignore[misc]  # Keras ships no types
    """``keras.layers.Embedding`` reading only the rows of the batch (``tf.nn.embedding_lookup``
    of the variable: a sparse gather). Keras 3's own ``call`` takes ``ops.take`` of the whole
    table as a tensor, and an in-place sparse update of a variable whose whole value was read in
    the step makes TensorFlow copy it: 290 ms a step for 1M x 64 floats against 6 ms (2 cores).
    Under ParameterServerStrategy the gather goes to each shard of the variable (as the
    ``ShardedVariable`` dispatches it) instead of concatenating every shard on the worker."""

    def call(self, inputs: Any) -> Any:
        import tensorflow as tf

        table = self.embeddings.value if isinstance(self.embeddings, keras.Variable) else self.embeddings
        return tf.nn.embedding_lookup(table, tf.cast(inputs, tf.int64))


class LazyAdagrad(keras.optimizers.Adagrad):  # type: ignore[misc]  # Keras ships no types
    """Keras's Adagrad, applied to the rows of a sparse gradient only (TensorFlow's sparse
    ``apply``, and what the shards do with irdma.keras.Embedding's pushes): duplicate rows
    summed, then ``acc += g^2; row -= lr * g / sqrt(acc + epsilon)`` for those rows. Keras 3's
    own Adagrad takes ``sqrt(accumulator + epsilon)`` of the whole table at every step (440 ms a
    step for 1M x 64 floats on 2 cores); dense gradients go to it unchanged."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        import tensorflow as tf

        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        lr = tf.cast(learning_rate, variable.dtype)
        rows, where = tf.unique(gradient.indices)
        grad = tf.math.unsorted_segment_sum(tf.cast(gradient.values, variable.dtype), where, tf.shape(rows)[0])
        acc = self._accumulators[self._get_variable_index(variable)]
        self.assign_add(acc, tf.IndexedSlices(grad * grad, rows))
        step = lr * grad / tf.sqrt(tf.gather(acc.value, rows) + self.epsilon)
        self.assign_sub(variable, tf.IndexedSlices(step, rows))
        return None


class Timer(keras.callbacks.Callback):  # type: ignore[misc]  # Keras ships no types
    """Wall-clock times of the training batches after the first ``warmup`` (tracing, the
    table's first use): ``t0`` at the end of batch ``warmup - 1``, ``t1`` at the last."""

    def __init__(self, warmup: int, batch_size: int) -> None:
        super().__init__()
        self.warmup, self.batch_size = warmup, batch_size
        self.seen, self.t0, self.t1, self.start = 0, None, None, time.time()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen += 1
        if self.seen == self.warmup:
            self.t0 = time.time()
        self.t1 = time.time()

    def figures(self) -> dict[str, Any]:
        timed = self.seen - self.warmup
        ok = self.t0 is not None and timed > 0
        return {"batches": self.seen, "timed_batches": max(0, timed), "t_start": self.start, "t0": self.t0,
                "t1": self.t1, "rows_timed": max(0, timed) * self.batch_size,
                "rows_per_s": timed * self.batch_size / (self.t1 - self.t0) if ok else None}


def auc(y: np.ndarray, score: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, score))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's options (``argv``: the command line's by default)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", action="store_true", help="One process with keras.layers.Embedding (the baseline).")
    ap.add_argument("--stock-keras", action="store_true",
                    help="With --local: Keras's own Embedding.call and Adagrad (whole-table work at every step: slow).")
    ap.add_argument("--rows", type=int, default=1_000_000, help="Rows of the table.")
    ap.add_argument("--dim", type=int, default=64, help="Floats per row.")
    ap.add_argument("--users", type=int, default=200_000)
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--zipf", type=float, default=1.05, help="Popularity skew: p(rank r) ~ 1 / r^zipf.")
    ap.add_argument("--train", type=int, default=1_000_000, help="Training clicks (all workers together).")
    ap.add_argument("--test", type=int, default=100_000, help="Held-out clicks.")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=512, help="Per worker.")
    ap.add_argument("--lr", type=float, default=0.2, help="Adagrad's learning rate (table and dense weights).")
    ap.add_argument("--steps", type=int, default=0,
                    help="Train this many batches per worker, as one epoch (--epochs ignored; 0: every batch, --epochs times).")
    ap.add_argument("--warmup", type=int, default=20, help="Batches not timed (tracing, first use).")
    ap.add_argument("--no-eval", action="store_true", help="Train only (the benchmark's throughput runs).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="Write the figures here (under irdma run: PATH.RANK).")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()

    data = make_data(args)
    keras.utils.set_random_seed(args.seed)  # the same dense initial weights in every mode and rank
    x, y = data["x_train"], data["y_train"]
    if args.local:
        rank, size = 0, 1
        table = (keras.layers.Embedding if args.stock_keras else RowEmbedding)(args.rows, args.dim, name="table")
        model = build_model(table, args.dim)
        opt = keras.optimizers.Adagrad(args.lr) if args.stock_keras else LazyAdagrad(args.lr)
        model.compile(optimizer=opt, loss="binary_crossentropy")
        callbacks: list[Any] = []
    else:
        import irdma.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        table = hvd.Embedding(args.rows, args.dim, optimizer=keras.optimizers.Adagrad(args.lr), name="table")
        model = build_model(table, args.dim)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adagrad(args.lr)), loss="binary_crossentropy")
        callbacks = [hvd.BroadcastInitialWeights(0)]
        x, y = hvd.shard_dataset((x, y))
    steps = min(len(x) // args.batch_size, args.steps) if args.steps else None  # None: every batch
    epochs = 1 if args.steps else args.epochs
    timer = Timer(args.warmup, args.batch_size)
    started = time.monotonic()
    model.fit(x, y, batch_size=args.batch_size, epochs=epochs, steps_per_epoch=steps, shuffle=True,
              callbacks=[*callbacks, timer], verbose=2 if rank == 0 else 0)
    trained_s = time.monotonic() - started
    figures: dict[str, Any] = {"mode": "local" if args.local else f"irdma {size} workers", "rank": rank,
                               "rows": args.rows, "dim": args.dim, "batch_size": args.batch_size,
                               "train_s": trained_s, **timer.figures()}
    rate = figures["rows_per_s"]
    print(f"trained {timer.seen} batches of {args.batch_size} in {trained_s:.1f} s"
          + (f" ({rate:.0f} rows/s after {args.warmup} warm-up batches)" if rate else ""), flush=True)

    if not args.local:
        hvd.barrier("trained")  # every worker's steps are on the shards
    if rank == 0 and not args.no_eval:
        if not args.local:
            model.optimizer.pull_weights()  # the shards' dense weights: every worker's steps
        score = model.predict(data["x_test"], batch_size=8192, verbose=0).ravel()
        figures.update(auc=auc(data["y_test"], score), auc_truth=auc(data["y_test"], data["p_test"]))
        print(f"auc: {figures['auc']:.4f} ({figures['mode']}; the ground truth's own probabilities:"
              f" {figures['auc_truth']:.4f})", flush=True)
    if args.json:
        with open(args.json if args.local else f"{args.json}.{rank}", "w") as f:
            json.dump(figures, f)
    if not args.local:
        hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
