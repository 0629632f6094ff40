"""`irdma run`: the launcher of training jobs, as a user runs it (a real CLI process, real worker
processes, a real local cluster or a running one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import irdma_cli, running_cluster, wait_until

from irdma.meta import open_meta
from irdma.train.coord import XATTR_CONSISTENCY, XATTR_WORKERS

#: A worker that reports what the launcher gave it.
ENV_WORKER = """
import os, sys
e = os.environ
print("rank", e["IRDMA_RANK"], "size", e["IRDMA_SIZE"], "job", e["IRDMA_JOB"], "meta", e["IRDMA_META"])
print("to stderr", e["IRDMA_RANK"], file=sys.stderr)
"""

#: Rank 1 fails once the others are ready; they wait (a deadline, not forever) and note a SIGTERM.
FAILING_WORKER = """
import os, signal, sys, time
rank, out = int(os.environ["IRDMA_RANK"]), sys.argv[1]
def term(signum, frame):
    open(os.path.join(out, f"term-{rank}"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
deadline = time.monotonic() + 60
if rank == 1:
    others = {f"ready-{k}" for k in (0, 2)}
    while not others <= set(os.listdir(out)) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(3)
open(os.path.join(out, f"ready-{rank}"), "w").close()
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0)
"""

#: Each worker says it is ready, then notes the signal it gets and exits 0.
SIGNALLED_WORKER = """
import os, signal, sys, time
rank, out = int(os.environ["IRDMA_RANK"]), sys.argv[1]
def got(signum, frame):
    open(os.path.join(out, f"got-{rank}-{signal.Signals(signum).name}"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, got)
signal.signal(signal.SIGINT, got)
open(os.path.join(out, f"ready-{rank}"), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(5)
"""


def test_each_worker_gets_its_rank_the_size_and_the_job_and_its_lines_come_prefixed(tmp_path: object) -> None:
    res = irdma_cli("run", "-n", "3", "--job", "digits", "--", sys.executable, "-c", ENV_WORKER)
    lines = res.stdout.splitlines()
    for rank in range(3):
        mine = [ln for ln in lines if ln.startswith(f"[{rank}] rank {rank} size 3 job /jobs/digits meta sqlite:///")]
        assert len(mine) == 1, res.stdout
        assert f"[{rank}] to stderr {rank}" in res.stderr.splitlines()
    # the local cluster started for the job is gone again
    url = mine[0].split(" meta ", 1)[1]
    assert not os.path.exists(url.removeprefix("sqlite://"))


def test_a_running_namespace_gets_the_job_directory_with_its_settings(tmp_path: object) -> None:
    with running_cluster(os.path.join(str(tmp_path), "c")) as c:
        res = irdma_cli("run", "-n", "2", "--meta", c.meta_url, "--job", "j1", "--consistency", "ssp:2", "--",
                        sys.executable, "-c", ENV_WORKER)
        assert res.stdout.count(f"job /jobs/j1 meta {c.meta_url}") == 2, res.stdout
        meta = open_meta(c.meta_url)
        try:
            ino = meta.resolve("/jobs/j1").ino
            assert meta.getxattr(ino, XATTR_WORKERS) == b"2"
            assert meta.getxattr(ino, XATTR_CONSISTENCY) in (b"ssp:2", b"SSP:2", b"ssp 2")
        finally:
            meta.close()


def test_a_failed_worker_stops_the_others_and_the_launcher_exits_with_its_status_naming_its_rank(tmp_path: object) -> None:
    out = str(tmp_path)
    res = irdma_cli("run", "-n", "3", "--grace", "20", "--", sys.executable, "-c", FAILING_WORKER, out, check=False)
    assert res.returncode == 3, res.stderr
    assert "rank 1 exited with status 3" in res.stderr
    assert sorted(os.listdir(out)) == ["ready-0", "ready-2", "term-0", "term-2"]  # told to stop, not killed outright


def test_sigterm_and_sigint_to_the_launcher_reach_every_worker(tmp_path: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        out = os.path.join(str(tmp_path), sig.name)
        os.makedirs(out)
        launcher = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--", sys.executable,
                                     "-c", SIGNALLED_WORKER, out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda out=out: {"ready-0", "ready-1"} <= set(os.listdir(out)), 60, "both workers to start")
            launcher.send_signal(sig)
            _, err = launcher.communicate(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        assert launcher.returncode == 128 + sig, err.decode()  # stopped by a signal: not a success
        assert {f"got-0-{sig.name}", f"got-1-{sig.name}"} <= set(os.listdir(out))


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: object) -> None:
    for args, says in ((["-n", "0"], "at least one worker"), (["-n", "2", "--consistency", "often"], "use asp, bsp or ssp:S"),
                       (["-n", "1", "--job", "a/b"], "one path component")):
        res = irdma_cli("run", *args, "--meta", "sqlite:///nonexistent/meta.db", "--", "true", check=False)
        assert res.returncode == 1 and says in res.stderr, res.stderr
    res = irdma_cli("run", "-n", "1", "--", os.path.join(str(tmp_path), "no-such-program"), check=False)
    assert res.returncode == 1 and "cannot start" in res.stderr and "no-such-program" in res.stderr, res.stderr


#: Rank 0 ignores SIGTERM (it must be killed); rank 1 fails once rank 0 is ready.
STUBBORN_WORKER = """
import os, signal, sys, time
rank, out = int(os.environ["IRDMA_RANK"]), sys.argv[1]
deadline = time.monotonic() + 60
if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(out, "pid-0"), "w") as f:
        f.write(str(os.getpid()))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0)
while not os.path.exists(os.path.join(out, "pid-0")) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(4)
"""


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: object) -> None:
    out = str(tmp_path)
    res = irdma_cli("run", "-n", "2", "--grace", "1", "--", sys.executable, "-c", STUBBORN_WORKER, out, check=False)
    assert res.returncode == 4 and "rank 1 exited with status 4" in res.stderr, res.stderr
    with open(os.path.join(out, "pid-0")) as f:
        pid = int(f.read())
    assert not _running(pid), "rank 0 outlived the grace period"


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launcher_whose_output_is_gone_still_drains_its_workers_and_ends(tmp_path: object) -> None:
    """`irdma run ... | head -1`: the reader of the launcher's stdout goes away; the workers'
    lines are dropped, never left to fill their pipes (which would block them for ever)."""
    chatty = "import sys\nfor i in range(200000):\n    print('line', i)\n"
    launcher = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--", sys.executable, "-c",
                                 chatty], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert launcher.stdout is not None
        launcher.stdout.readline()
        launcher.stdout.close()  # as `head -1` does
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err.decode()[-2000:]


AVERAGING_WORKER = """
import os
import irdma.keras as hvd
hvd.init()
cb = hvd.MetricAverageCallback(timeout=60)
for epoch in range(2):
    logs = {"loss": float(hvd.rank() + 10 * epoch), "accuracy": 0.5 * hvd.rank(), "note": "text"}
    cb.on_epoch_end(epoch, logs)
    print("epoch", epoch, "loss", logs["loss"], "accuracy", logs["accuracy"], logs["note"])
"""


@pytest.mark.long  # 15 s: make test-long (CI's time)
def test_metric_average_callback_gives_every_rank_the_mean_of_each_number(tmp_path: object) -> None:
    res = irdma_cli("run", "-n", "3", "--", sys.executable, "-c", AVERAGING_WORKER)
    for rank in range(3):
        assert f"[{rank}] epoch 0 loss 1.0 accuracy 0.5 text" in res.stdout, res.stdout
        assert f"[{rank}] epoch 1 loss 11.0 accuracy 0.5 text" in res.stdout, res.stdout
