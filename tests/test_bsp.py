"""BSP is synchronous SGD as Horovod means it (issue 38): under ``irdma run -n N --consistency bsp``
each step's pushes of the N workers are summed on the shards and the wrapped optimizer takes one
step on their mean, so N workers with batch B each train exactly as one process with batch N B
(same rows, initial weights and optimizer), to float32 summation order. Real TensorFlow, real
shards, real worker processes under ``irdma run``, plain ``model.fit``; the weights read back with
``keras.models.load_model`` from the file rank 0 saved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import numpy as np
import pytest
from helpers import REPO

pytestmark = [pytest.mark.tf]

keras = pytest.importorskip("keras")
sys.path.insert(0, os.path.join(REPO, "tests"))
import bsp_worker  # noqa: E402  (the workers' script: its model, data and optimizers)

KINDS = ["sgd", "momentum", "nesterov", "adam", "adagrad", "rmsprop", "adamw", "adam-bpps2", "adam-p3",
         "adam-p3-drop", "embedding-sgd", "embedding-adagrad", "adam-p3-drops", "momentum-hier"]
#: Kinds whose steps are not one process's: layers dropped for a while (their gradients wait on
#: the worker) push zero contributions meanwhile; the rounds go on, none waits for a push.
NOT_ONE_PROCESS = {"adam-p3-drops"}


def one_process(kind: str, workers: int) -> list[np.ndarray]:
    """The model after the same steps in one process with batch ``workers * BATCH`` (times the
    kind's backward passes per step); an embedding kind's with ``keras.layers.Embedding``."""
    x, y = bsp_worker.data(workers, kind)
    table = keras.layers.Embedding(bsp_worker.ROWS, bsp_worker.DIM, embeddings_initializer="zeros")
    m = bsp_worker.model(kind, table)
    m.compile(optimizer=bsp_worker.OPTIMIZERS[kind](), loss="sparse_categorical_crossentropy")
    batch = workers * bsp_worker.BATCH * bsp_worker.PASSES.get(kind, 1)
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return [np.array(w) for w in m.get_weights()]


def trained(out: Any, kind: str) -> list[np.ndarray]:
    """What rank 0 saved of a kind: the weights of its ``.keras`` file (an embedding kind's
    table, which lives on the shards, from the file beside it in place of the layer's hook)."""
    got = [np.array(w) for w in keras.models.load_model(out / f"{kind}.keras", compile=False).get_weights()]
    if kind.startswith("embedding"):
        got[0] = np.load(out / f"{kind}-table.npy")
    return got


def max_relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest ``max |got - want| / max |want|`` over the tensors."""
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.long)])  # N=3: make test-long (34 s)
def test_n_workers_with_batch_b_train_as_one_process_with_batch_n_b(tmp_path: Any, workers: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", str(workers), "--consistency", "bsp",
                          "--job", f"bsp-{uuid.uuid4().hex[:8]}", "--", sys.executable,
                          os.path.join(REPO, "tests", "bsp_worker.py"), str(out), *KINDS],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    done = {d["kind"]: d for d in (json.loads(line.split("] ", 1)[1]) for line in res.stdout.splitlines()
                                   if line.startswith("[0] {"))}
    assert sorted(done) == sorted(KINDS), done
    assert all(d["rounds"] == bsp_worker.STEPS // bsp_worker.PASSES.get(k, 1) for k, d in done.items()), done
    assert done["adam-p3-drops"]["skipped"] > 0 and done["adam-p3-drop"]["skipped"] == 0, done
    errors = {}
    for kind in KINDS:
        if kind in NOT_ONE_PROCESS:
            continue
        got = trained(out, kind)
        want = one_process(kind, workers)
        start = [np.array(w) for w in bsp_worker.model(kind, keras.layers.Embedding(
            bsp_worker.ROWS, bsp_worker.DIM, embeddings_initializer="zeros")).get_weights()]
        assert max_relative_error(start, want) > 1e-2, "the steps moved the weights"
        errors[kind] = max_relative_error(got, want)
    assert all(e <= 1e-4 for e in errors.values()), errors
