"""Files any Keras loads: a model compiled with ``DistributedOptimizer(Adam)`` and saved by a
worker (``model.save`` to ``.keras`` and ``.h5``, ``tf.saved_model.save``, ``model.export``) loads
in a process where irdma cannot be imported, as a stock Adam with its config and its moments
(the shards' state): it predicts as the saved model and its next step is the job's next step.
``irdma.keras.load_model`` (Horovod's ``hvd.load_model``) wraps the optimizer again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import running_cluster

pytestmark = [pytest.mark.tf]

keras = pytest.importorskip("keras")
hvd = pytest.importorskip("irdma.keras")

#: Loads every file with irdma unimportable and reports what a user sees (JSON on stdout).
LOADER = r"""
import importlib.abc, json, sys
import numpy as np

class NoIrdma(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "irdma" or name.startswith("irdma."):
            raise ImportError(f"{name} is blocked: this process has no irdma")

sys.meta_path.insert(0, NoIrdma())
import h5py, keras, tensorflow as tf

d = sys.argv[1]
x, y = np.load(d + "/x.npy"), np.load(d + "/y.npy")
out = {}
for name in ("m.keras", "m.h5"):
    try:
        m = keras.models.load_model(f"{d}/{name}")
        got = {"class": type(m.optimizer).__name__, "config": m.optimizer.get_config(),
               "iterations": int(m.optimizer.iterations), "predict": m.predict(x, verbose=0).tolist()}
        if name == "m.keras":  # (Keras 3 loads no optimizer slots from an .h5 file, its own or ours)
            m.train_on_batch(x[:16], y[:16])
            got["next"] = [w.tolist() for w in m.get_weights()]
        out[name] = got
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
with h5py.File(d + "/m.h5") as f:
    out["h5_optimizer_weights"] = [str(n.decode() if isinstance(n, bytes) else n)
                                   for n in f["optimizer_weights"].attrs["weight_names"]]
for name in ("saved_model", "export"):
    try:
        fn = tf.saved_model.load(f"{d}/{name}").signatures["serving_default"]
        (arg,) = fn.structured_input_signature[1]
        out[name] = {"predict": list(fn(**{arg: tf.constant(x)}).values())[0].numpy().tolist()}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: Any) -> Iterator[str]:
    with running_cluster(str(tmp_path_factory.mktemp("files") / "c"), shards=2, replicas=1) as c:
        yield c.meta_url


def _join(cluster: str) -> None:
    hvd.shutdown()
    hvd.init(meta=cluster, job=f"/jobs/f-{uuid.uuid4().hex[:8]}", rank=0, size=1)


def _model() -> Any:
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def test_a_workers_files_load_in_stock_keras_as_adam_with_the_shards_state(cluster: str, tmp_path: Any) -> None:
    import tensorflow as tf

    d = str(tmp_path)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    np.save(f"{d}/x.npy", x)
    np.save(f"{d}/y.npy", y)
    _join(cluster)
    try:
        keras.utils.set_random_seed(7)
        model = _model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, beta_1=0.8)),
                      loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 4 steps on the shards
        model.save(f"{d}/m.keras")
        model.save(f"{d}/m.h5")
        tf.saved_model.save(model, f"{d}/saved_model")
        model.export(f"{d}/export", verbose=False)
        predicted = model.predict(x, verbose=0)
        saved = [np.array(w) for w in model.get_weights()]
        model.train_on_batch(x[:16], y[:16])  # the job's next step
        want = [np.array(w) for w in model.get_weights()]

        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        env.pop("PYTHONPATH", None)
        run = subprocess.run([sys.executable, "-c", LOADER, d], capture_output=True, text=True, env=env, cwd=d,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        for name in ("m.keras", "m.h5"):
            assert "error" not in got[name], (name, got[name])
            assert got[name]["class"] == "Adam", name
            assert got[name]["config"]["learning_rate"] == pytest.approx(0.01)
            assert got[name]["config"]["beta_1"] == pytest.approx(0.8)
            assert got[name]["iterations"] == 4
            np.testing.assert_allclose(got[name]["predict"], predicted, rtol=1e-6, atol=1e-7, err_msg=name)
        for a, b in zip(got["m.keras"]["next"], want, strict=True):  # its moments are the shards'
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        names = got["h5_optimizer_weights"]  # the .h5 file holds Adam's slots as Keras writes them
        assert len(names) == 10 and sum(n.endswith("_momentum") for n in names) == 4 == \
            sum(n.endswith("_velocity") for n in names), names
        for name in ("saved_model", "export"):
            assert "error" not in got[name], (name, got[name])
            np.testing.assert_allclose(got[name]["predict"], predicted, rtol=1e-6, atol=1e-7, err_msg=name)

        # irdma.keras.load_model wraps the optimizer again; a new job resumes at the saved step
        _join(cluster)
        loaded = hvd.load_model(f"{d}/m.keras")
        assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
        assert isinstance(loaded.optimizer.inner, keras.optimizers.Adam) and loaded.optimizer.inner.beta_1 == 0.8
        for a, b in zip(loaded.get_weights(), saved, strict=True):
            np.testing.assert_array_equal(a, b)
        loaded.train_on_batch(x[:16], y[:16])
        for a, b in zip(loaded.get_weights(), want, strict=True):  # bit-identical: the same step on the shards
            np.testing.assert_array_equal(a, b)
    finally:
        hvd.shutdown()
