"""examples/train_keras.py at 2 workers for each consistency model, through a real mount:
``model.fit`` on two worker processes with Adam on the shards, then the same training in one
process; the final line is the documented one and the accuracies are close (short runs here;
the full table with 20 epochs is docs/training.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = [pytest.mark.tf, pytest.mark.fuse, pytest.mark.slow]
LINE = re.compile(r"^accuracy: single-process (\d\.\d{4}), irdma (\d\.\d{4}) \(2 workers, (asp|bsp|ssp:2), adam\)$")


@pytest.mark.parametrize("consistency", ["asp", "bsp", "ssp:2"])
def test_train_keras_two_workers(mnt: str, consistency: str) -> None:
    res = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_keras.py"), "--mount", mnt,
                          "--workers", "2", "--consistency", consistency, "--optimizer", "adam", "--epochs", "6"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m and m.group(3) == consistency, last
    single, shared = float(m.group(1)), float(m.group(2))
    assert single > 0.9 and shared > single - 0.04, last  # 6 epochs: within 4 points
    assert "worker 1: epoch 6/6" in res.stdout
