"""irdma.keras.SnapshotCallback and restore_snapshot (issue 23), real shards and real
TensorFlow: a one-worker job trains 4 epochs taking a snapshot at each epoch's end (keeping 3);
a fresh process restores the epoch-2 snapshot and trains epochs 3-4; its weights (trainable and
not), and the shards' optimizer state, equal the uninterrupted run's bit for bit."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from helpers import running_cluster

from irdma.client.sync import connect

pytestmark = [pytest.mark.tf,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")]

#: One worker: digits, an MLP with BatchNormalization and Dropout (non-trainable variables and a
#: seed generator on the worker), Adam under a learning-rate schedule (the step count matters).
#: argv: MODE (whole|resume), OUT.npz, SNAPSHOT (resume). Saves every epoch's weights.
TRAIN = """
import logging, sys
import numpy as np, keras, tensorflow as tf
from sklearn.datasets import load_digits
import irdma.keras as hvd

mode, out = sys.argv[1], sys.argv[2]
log = logging.getLogger("irdma.keras")  # its INFO lines (one per snapshot) on stderr
log.addHandler(logging.StreamHandler())
log.setLevel(logging.INFO)
log.propagate = False
if mode == "resume":  # started beside the first run (TensorFlow loads meanwhile): go once it ended
    assert sys.stdin.readline().strip() == "go"
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)
x, y = load_digits(return_X_y=True)
x, y = (x[:768] / 16.0).astype("float32"), y[:768]
hvd.init()
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(24, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.2),
                          keras.layers.Dense(10, activation="softmax")])
lr = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=12, decay_rate=0.5)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr)), loss="sparse_categorical_crossentropy")
from irdma import InvalidArgument, NotFound
for bad in ({"every_n_epochs": 0}, {"keep": 0}, {"name": "a/{epoch}"}, {"name": "{step}"}):
    try:
        hvd.SnapshotCallback(**bad)
        raise SystemExit(f"SnapshotCallback({bad}) was accepted")
    except InvalidArgument as exc:
        print("refused:", exc, file=sys.stderr)
first = 0
if mode == "resume":
    try:
        hvd.restore_snapshot("epoch-9", model=model)
        raise SystemExit("a snapshot that is not there was restored")
    except NotFound as exc:
        print("refused:", exc, file=sys.stderr)
    first = hvd.restore_snapshot(sys.argv[3], model=model)
seen = {}

def flat(ws):
    return np.concatenate([np.asarray(w, dtype="<f4").ravel() for w in ws])

class Record(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        seen[f"begin{epoch}"] = flat(model.get_weights())
    def on_epoch_end(self, epoch, logs=None):
        seen[f"trainable{epoch + 1}"] = flat(model.trainable_weights)
        seen[f"all{epoch + 1}"] = flat(model.get_weights())

model.fit(x, y, batch_size=64, epochs=4, initial_epoch=first, shuffle=False, verbose=0,
          callbacks=[hvd.BroadcastInitialWeights(0), hvd.SnapshotCallback(keep=3), Record()])
np.savez(out, **seen)
hvd.shutdown()
"""


def _start(meta: str, job: str, mode: str, out: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, IRDMA_META=meta, IRDMA_JOB=job, TF_CPP_MIN_LOG_LEVEL="3", PYTHONHASHSEED="0")
    return subprocess.Popen([sys.executable, "-c", TRAIN, mode, out, *args], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], stdin: str | None = None) -> str:
    try:
        _, err = proc.communicate(stdin, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    return err


@pytest.mark.long  # 16 s: make test-long (CI's time)
def test_a_fresh_process_resumes_from_an_epoch_snapshot_bit_identically(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    job = "/jobs/digits"
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=2) as c:
        # the fresh process starts now but touches the job only once the first run has ended
        fresh = _start(c.meta_url, job, "resume", os.path.join(tmp, "resumed.npz"), "epoch-2")
        try:
            err = _finish(_start(c.meta_url, job, "whole", os.path.join(tmp, "whole.npz")))
        except BaseException:
            fresh.kill()
            fresh.wait()
            raise
        for epoch in range(1, 5):  # one line per snapshot
            assert re.search(rf"snapshot {job}/.snapshots/epoch-{epoch} of {job} after epoch {epoch}: 3 files,"
                             r" \d+ bytes, \d+ ms", err), err[-3000:]
        whole = np.load(os.path.join(tmp, "whole.npz"))
        with connect(c.meta_url) as cl:
            assert [s.name for s in cl.snapshots(job)] == ["epoch-2", "epoch-3", "epoch-4"]  # keep=3
            at_2 = np.frombuffer(bytes(cl.read(f"{job}/.snapshots/epoch-2/params")), dtype="<f4")
            np.testing.assert_array_equal(at_2, whole["trainable2"])
            state_whole = cl._run(cl.client.optimizer_state, f"{job}/params")
            assert set(state_whole) == {"m", "v", "step"} and state_whole["step"].max() == 4 * 12

        assert err.count("refused: ") == 4 and "refused: name='a/{epoch}' cannot name a snapshot" in err, err[-3000:]
        err = _finish(fresh, "go\n")
        assert f"refused: {job} has no snapshot named 'epoch-9'" in err, err[-3000:]
        assert f"restored {job} from snapshot {job}/.snapshots/epoch-2 (epoch 2)" in err, err[-3000:]
        assert "snapshot epoch-3 of /jobs/digits exists (an earlier run's): replacing it" in err, err[-3000:]
        resumed = np.load(os.path.join(tmp, "resumed.npz"))
        assert sorted(resumed.files) == ["all3", "all4", "begin2", "begin3", "trainable3", "trainable4"]
        np.testing.assert_array_equal(resumed["begin2"], whole["all2"])  # BatchNormalization's statistics too
        for name in ("trainable3", "all3", "trainable4", "all4"):
            assert np.array_equal(resumed[name], whole[name]), name
        with connect(c.meta_url) as cl:
            state = cl._run(cl.client.optimizer_state, f"{job}/params")
            for slot, values in state_whole.items():
                assert np.array_equal(state[slot], values), slot
            assert [s.name for s in cl.snapshots(job)] == ["epoch-2", "epoch-3", "epoch-4"]
            np.testing.assert_array_equal(np.frombuffer(bytes(cl.read(f"{job}/.snapshots/epoch-4/params")), "<f4"),
                                          whole["trainable4"])
