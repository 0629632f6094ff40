"""Training throughput of the recommendation model (``examples/recommend.py``) with its
embedding table on parameter servers: irdma against TensorFlow's ParameterServerStrategy.

The same model (one table of ``--rows`` x ``--dim`` float32, ``[u, v, u * v]`` -> Dense 64 ->
Dense 1), the same synthetic clicks, the same batch size per worker, Adagrad, 2 workers and 2
parameter servers on this machine:

* **irdma**: ``irdma run -n 2 --shards 2 --capacity 1GiB -- python examples/recommend.py``
  (``irdma.keras.Embedding``: the table on the shards, the batch's rows pulled and their
  gradients pushed, Adagrad applied on the shards; dense weights through
  ``DistributedOptimizer``), ``--steps`` batches per worker.
* **TF PS**: 2 ps and 2 workers, each a ``tf.distribute.Server`` in one process, over loopback
  gRPC (as ``benchmarks/peer_tf_ps.py``); the table a ``keras.layers.Embedding`` made under
  ``strategy.scope()`` with ``MinSizePartitioner(max_shards=2)`` (a ``ShardedVariable``, one
  half per ps), a ``ClusterCoordinator`` scheduling 2 x ``--steps`` train steps over per-worker
  datasets. Keras 3's optimizers cannot update a ``ShardedVariable`` (no ``handle``), so the
  step applies Adagrad with TensorFlow's own kernels on the ps (``ResourceSparseApplyAdagradV2``
  to the batch's distinct rows, their gradients summed, as the irdma shards do). The table's
  lookup is ``tf.nn.embedding_lookup`` of the variable (``RowEmbedding`` in the example: a
  gather on each ps); ``--stock`` also times Keras 3's own ``Embedding.call`` (``ops.take`` of
  the whole table: every shard sent to the worker at every step) for a few steps.

Both figures exclude the first ``--warmup`` batches per worker (tracing, the table's creation)::

    python benchmarks/embedding.py [--rows 1000000] [--steps 300] [--quick]   -> prints JSON

``rows_per_s`` is training examples per second of the whole job (2 workers).

Measured (the defaults: 1,000,000 x 64, 300 timed steps of 512 per worker; one 2-core machine,
35 s in all, 2026-12-04): irdma 43,000-53,000 rows/s, TF PS 59,000-77,000 rows/s, ratio
0.67-0.75 over six runs (docs/keras.md says what bounds it); TF PS with Keras 3's own
``Embedding.call`` (``--stock``) 362 rows/s when last measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLE = os.path.join(REPO, "examples", "recommend.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def example_args(args: argparse.Namespace) -> list[str]:
    return ["--rows", str(args.rows), "--dim", str(args.dim), "--train", str(args.train), "--test", "1000",
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--steps", str(args.warmup + args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed)]


def run_irdma(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """``irdma run -n 2`` of the example (train only); the job's rows/s over the span in which
    both workers' timed batches ran."""
    out = os.path.join(work, "irdma.json")
    cmd = [sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--shards", "2", "--capacity", args.capacity,
           "--", sys.executable, EXAMPLE, *example_args(args), "--no-eval", "--json", out]
    started = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "3"})
    took = time.monotonic() - started
    if res.returncode != 0:
        raise SystemExit(f"error: irdma run failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    ranks = []
    for r in range(2):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
    rows = sum(r["rows_timed"] for r in ranks)
    span = max(r["t1"] for r in ranks) - min(r["t0"] for r in ranks)
    return {"rows_per_s": rows / span, "rows_timed": rows, "timed_s": span,
            "per_worker_rows_per_s": [r["rows_per_s"] for r in ranks],
            "first_batches_s": [r["t0"] - r["t_start"] for r in ranks], "command_s": took}


class _Ps:
    """The in-process TF cluster and its coordinator."""

    def __init__(self) -> None:
        import tensorflow as tf

        spec = {"worker": [f"127.0.0.1:{_port()}" for _ in range(2)],
                "ps": [f"127.0.0.1:{_port()}" for _ in range(2)]}
        cluster = tf.train.ClusterSpec(spec)
        # as TensorFlow's own in-process cluster does: enough inter-op threads on a small machine,
        # or the workers deadlock
        config = tf.compat.v1.ConfigProto()
        config.inter_op_parallelism_threads = max(3, os.cpu_count() or 1)
        self.servers = [tf.distribute.Server(cluster, job_name=job, task_index=i, protocol="grpc", config=config,
                                             start=True) for job in ("worker", "ps") for i in range(len(spec[job]))]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10,
                                                                                 max_shards=2)
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)


def run_tf_ps(args: argparse.Namespace, ps: _Ps, data: dict[str, Any], stock: bool = False) -> dict[str, Any]:
    """2 x ``steps`` train steps (``warmup`` per worker first, untimed) on the TF PS cluster."""
    import keras
    import recommend
    import tensorflow as tf
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    strategy, coordinator = ps.strategy, ps.coordinator
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        layer = (keras.layers.Embedding if stock else recommend.RowEmbedding)(args.rows, args.dim, name="table")
        model = recommend.build_model(layer, args.dim)
    table = layer.embeddings.value
    sharded = isinstance(table, ShardedVariable)

    def parts(v: Any) -> list[Any]:
        v = getattr(v, "value", v)
        return list(v.variables) if isinstance(v, ShardedVariable) else [v]

    variables = [p for v in model.trainable_variables for p in parts(v)]
    with strategy.scope():
        accumulators = []
        for v in variables:
            with strategy.extended.colocate_vars_with(v):
                accumulators.append(tf.Variable(tf.fill(v.shape, 0.1), trainable=False))  # Keras's initial value
    x, y = data["x_train"], data["y_train"][:, None]
    batch = args.batch_size

    def dataset_fn() -> Any:
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(8192, seed=args.seed).batch(
            batch, drop_remainder=True).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    loss_fn = keras.losses.BinaryCrossentropy()
    lr, eps = tf.constant(args.lr, tf.float32), tf.constant(1e-7, tf.float32)

    @tf.function
    def train_step(it: Any) -> Any:
        def step(xb: Any, yb: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, variables)
            for v, acc, g in zip(variables, accumulators, grads, strict=True):
                if isinstance(g, tf.IndexedSlices):  # the batch's rows: duplicates summed, then Adagrad
                    rows, where = tf.unique(g.indices)
                    summed = tf.math.unsorted_segment_sum(g.values, where, tf.shape(rows)[0])
                    tf.raw_ops.ResourceSparseApplyAdagradV2(var=v.handle, accum=acc.handle, lr=lr, epsilon=eps,
                                                            grad=summed, indices=rows)
                else:
                    tf.raw_ops.ResourceApplyAdagradV2(var=v.handle, accum=acc.handle, lr=lr, epsilon=eps, grad=g)
            return loss

        xb, yb = next(it)
        return strategy.run(step, args=(xb, yb))

    steps = args.stock_steps if stock else args.steps
    warmup = min(args.warmup, 2) if stock else args.warmup
    started = time.monotonic()
    for _ in range(2 * warmup):
        coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()
    first = time.monotonic() - started
    t0 = time.monotonic()
    done, wave = 0, 10
    while done < 2 * steps and time.monotonic() - started < args.time_limit:
        n = min(wave, 2 * steps - done)
        for _ in range(n):
            last = coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        done += n
    secs = time.monotonic() - t0
    return {"rows_per_s": done * batch / secs, "rows_timed": done * batch, "timed_s": secs, "steps": done,
            "first_batches_s": first, "table_sharded": sharded, "table_shards": len(parts(table)),
            "last_loss": float(last.fetch()) if done else None}


def section(quick: bool) -> dict[str, Any]:
    """The ``embedding`` section of ``benchmarks/run.py`` (issue 40): this script in a process of
    its own (TensorFlow stays out of the caller), ``--quick`` if ``quick``; its JSON.

    Raises:
        RuntimeError: the run failed (its stderr's end attached).
    """
    res = subprocess.run([sys.executable, os.path.abspath(__file__), *(["--quick"] if quick else [])],
                         capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": REPO})
    if res.returncode != 0:
        raise RuntimeError(f"benchmarks/embedding.py failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(res.stdout[res.stdout.index("{"):])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--train", type=int, default=400_000, help="Training clicks (the data both systems train on).")
    ap.add_argument("--batch-size", type=int, default=512, help="Per worker and step.")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=300, help="Timed batches per worker.")
    ap.add_argument("--warmup", type=int, default=20, help="Untimed batches per worker first.")
    ap.add_argument("--capacity", default="1GiB", help="Memory of each irdma shard.")
    ap.add_argument("--time-limit", type=float, default=600.0, help="Seconds each system may take.")
    ap.add_argument("--stock", action="store_true",
                    help="Also time Keras 3's own Embedding.call under ParameterServerStrategy (slow: a few steps).")
    ap.add_argument("--stock-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="A small table and few steps (the test's run).")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.train, args.steps, args.warmup, args.stock = 20_000, 40_000, 30, 5, False

    if args.train // 2 // args.batch_size < args.warmup + args.steps:
        raise SystemExit(f"error: --train {args.train} holds fewer than {args.warmup + args.steps} batches per worker")
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="irdma-bench-embedding-") as work:
        irdma = run_irdma(args, work)  # first, alone: one heavy job at a time on a small machine
    import recommend

    data = recommend.make_data(recommend.parse_args(example_args(args)))  # what the irdma workers trained on
    ps = _Ps()
    tf_ps = run_tf_ps(args, ps, data)
    out: dict[str, Any] = {"rows": args.rows, "dim": args.dim, "batch_size": args.batch_size, "workers": 2,
                           "parameter_servers": 2, "steps_per_worker": args.steps, "cpus": os.cpu_count(),
                           "irdma": irdma, "tf_ps": tf_ps, "ratio_irdma_over_tf_ps": irdma["rows_per_s"] / tf_ps["rows_per_s"]}
    if args.stock:
        out["tf_ps_keras_take"] = run_tf_ps(args, ps, data, stock=True)
    out["took_s"] = time.monotonic() - started
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
