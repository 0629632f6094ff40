"""A Horovod Keras script ports by its import line (issue 38): ``hvd.callbacks.*`` under Horovod's
names, ``hvd.DistributedOptimizer`` with Horovod's keyword arguments, ``hvd.allreduce`` /
``allgather`` / ``broadcast`` of small values through the shards, ``hvd.Average``/``hvd.Sum``,
``hvd.Compression``, ``local_size``. A Horovod-style script (Keras, Adam with the learning rate
scaled by ``hvd.size()``, the metric-averaging and warm-up callbacks) under ``irdma run -n 2
--consistency bsp``, and the refusals a user meets in one process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.tf]

keras = pytest.importorskip("keras")
hvd = pytest.importorskip("irdma.keras")

SCRIPT = r"""
import json, keras, numpy as np, tensorflow as tf
import horovod_shim as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
out = {"rank": r, "size": n, "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
       "initialized": hvd.is_initialized()}
out["mean"] = hvd.allreduce(np.array([r + 1.0, 10.0 * r]), name="m").tolist()
out["sum"] = hvd.allreduce(np.array([r + 1], dtype=np.int64), op=hvd.Sum).tolist()
out["gathered"] = hvd.allgather(np.array([[r, r]])).tolist()
out["root"] = hvd.broadcast(np.array([42.0 if r == 0 else -1.0]), root_rank=0).tolist()
t = hvd.allreduce(tf.constant([2.0 * r]))
out["tensor"] = [type(t).__name__.endswith("Tensor") or hasattr(t, "numpy"), float(t.numpy()[0])]
rng = np.random.default_rng(1)
x = rng.standard_normal((256, 6)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
opt = keras.optimizers.Adam(0.001 * hvd.size())
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True,
                               compression=hvd.Compression.none, op=hvd.Average)
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
             hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * hvd.size(), warmup_epochs=2, verbose=0)]
xs, ys = hvd.shard_dataset((x, y))
hist = model.fit(xs, ys, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
out["lr"] = [float(v) for v in hist.history["lr"]]
out["loss"] = [float(v) for v in hist.history["loss"]]
out["accuracy"] = [float(v) for v in hist.history["accuracy"]]
weights = np.concatenate([w.ravel() for w in model.get_weights()])
out["checksum"] = float(weights.sum())
print(json.dumps(out), flush=True)
hvd.shutdown()
"""


def test_a_horovod_keras_script_runs_with_only_its_import_changed(tmp_path: object) -> None:
    import os

    shim = os.path.join(str(tmp_path), "horovod_shim.py")  # `import horovod.tensorflow.keras as hvd`, ported
    with open(shim, "w") as f:
        f.write("from irdma.keras import *  # noqa: F403\nfrom irdma.keras import callbacks  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--consistency", "bsp", "--",
                          sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = {d["rank"]: d for d in (json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()
                                  if line.startswith(("[0] {", "[1] {")))}
    assert sorted(got) == [0, 1], res.stdout[-2000:]
    for d in got.values():
        assert (d["size"], d["local_size"], d["cross_size"], d["initialized"]) == (2, 2, 1, True)
        assert d["mean"] == [1.5, 5.0] and d["sum"] == [3]
        assert d["gathered"] == [[0, 0], [1, 1]] and d["root"] == [42.0]
        assert d["tensor"] == [True, 1.0]
        # the warm-up: from 0.002 / 2 at the first batch to 0.002 over two epochs, then kept
        assert d["lr"][0] < d["lr"][1] <= d["lr"][2] == pytest.approx(0.002, rel=0.05), d["lr"]
        assert d["loss"][-1] < d["loss"][0]
    assert got[0]["checksum"] == got[1]["checksum"], "the ranks ended with different weights"
    # MetricAverageCallback: each epoch's metrics are the ranks' mean, the same on both (each
    # rank trains on its own half of the data, so its own numbers differ)
    assert (got[0]["loss"], got[0]["accuracy"]) == (got[1]["loss"], got[1]["accuracy"])


def test_what_cannot_be_ported_is_refused_with_the_alternative() -> None:
    from irdma import InvalidArgument

    with pytest.raises(InvalidArgument, match="topk"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    with pytest.raises(InvalidArgument, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0)
    with pytest.raises(InvalidArgument, match="overlap='none'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2, overlap="p3")
    with pytest.raises(InvalidArgument, match="hvd.Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op="adasum")
    assert {"BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
            "LearningRateScheduleCallback"} <= set(dir(hvd.callbacks))
