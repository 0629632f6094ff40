"""Real TensorFlow on the mount: checkpoints, and the training example end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = [pytest.mark.tf, pytest.mark.fuse]

SAVE = """
import os, sys, json, hashlib
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
directory = sys.argv[1]
rng = np.random.default_rng(7)
vars_ = {f"v{i}": tf.Variable(rng.standard_normal(shape).astype(np.float32))
         for i, shape in enumerate([(300, 200), (200,), (1000, 700), (7,)])}   # ~3 MB
ckpt = tf.train.Checkpoint(**vars_)
mgr = tf.train.CheckpointManager(ckpt, directory, max_to_keep=2)
for step in range(3):                      # three saves: the manager rotates and renames
    for v in vars_.values():
        v.assign_add(tf.ones_like(v))
    mgr.save()
print(json.dumps({k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in vars_.items()}))
"""

RESTORE = """
import os, sys, json, hashlib
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
directory = sys.argv[1]
vars_ = {f"v{i}": tf.Variable(tf.zeros(shape)) for i, shape in enumerate([(300, 200), (200,), (1000, 700), (7,)])}
ckpt = tf.train.Checkpoint(**vars_)
mgr = tf.train.CheckpointManager(ckpt, directory, max_to_keep=2)
ckpt.restore(mgr.latest_checkpoint).assert_consumed()
print(json.dumps({k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in vars_.items()}))
"""


def _run(code: str, *args: str) -> dict[str, str]:
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_checkpoint_saved_to_the_mount_restores_bit_identical_in_a_fresh_process(mnt: str) -> None:
    directory = os.path.join(mnt, "tf-ckpt")
    saved = _run(SAVE, directory)
    names = sorted(os.listdir(directory))
    assert "checkpoint" in names and not any(n.startswith("ckpt-1.") for n in names)  # rotated
    assert any(n.startswith("ckpt-3.") for n in names)
    restored = _run(RESTORE, directory)
    assert restored == saved


@pytest.mark.long  # 43 s; test_bsp and test_train_keras train in make test: make test-long (CI's time)
def test_training_example_reaches_the_accuracy_bound(mnt: str) -> None:
    res = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train_digits.py"), "--mount", mnt, "--steps", "250",
         "--min-accuracy", "0.93"],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(res.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["accuracy"] >= 0.93
    assert result["bit_identical"] and result["restored_accuracy"] == result["accuracy"]


def test_demo_runs_end_to_end_and_leaves_nothing_behind() -> None:
    """`make demo`'s script: cluster up, mount, train, checkpoint, restore, unmount, down."""
    res = subprocess.run([sys.executable, os.path.join(REPO, "examples", "demo.py"), "--steps", "250"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "bit-identical" in res.stdout and "demo passed" in res.stdout
    result = json.loads(res.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["accuracy"] >= 0.93 and result["bit_identical"]
    # its own work directory only: a machine may hold other runs' mounts
    work = re.search(r"starting a local cluster of \d+ shards in (\S+)/cluster", res.stdout)
    assert work is not None, res.stdout[-2000:]
    with open("/proc/mounts") as f:
        assert work.group(1) not in f.read()
    assert not os.path.exists(work.group(1))
