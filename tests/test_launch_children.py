"""`irdma run` and the children of a worker that died (issue 36, point 15): the launcher stops
what is left of the dead worker's process group (its ``sleep``, its data loaders) at once, with
and without ``--elastic``, and reports the death once that group is gone, not after waiting on
pipes its children still hold. A real CLI process, real workers, a real local cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import wait_until

#: A child of rank 1 that holds the worker's stdout and stderr; on SIGTERM it says so (through
#: those pipes) and leaves a file, then exits.
CHILD = """
import os, signal, sys, time
out = sys.argv[1]
def term(signum, frame):
    print("child got SIGTERM", file=sys.stderr, flush=True)
    open(os.path.join(out, "child-term"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
with open(os.path.join(out, "child-pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, "child-pid.tmp"), os.path.join(out, "child-pid"))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
"""

#: Rank 1 starts CHILD, waits until it runs, prints its last words and exits 3. Rank 0 goes on
#: until the child was stopped (a deadline, not forever), then exits 0.
WORKER = """
import os, subprocess, sys, time
rank, out, child = int(os.environ["IRDMA_RANK"]), sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
if rank == 1:
    subprocess.Popen([sys.executable, "-c", child, out])
    while not os.path.exists(os.path.join(out, "child-pid")) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("rank 1 last words", file=sys.stderr, flush=True)
    sys.exit(3)
while not os.path.exists(os.path.join(out, "child-term")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture()
def out(tmp_path: os.PathLike[str]) -> Iterator[str]:
    """The workers' directory; a child left running by a failed test is killed by its recorded pid."""
    where = str(tmp_path)
    yield where
    try:
        with open(os.path.join(where, "child-pid")) as f:
            pid = int(f.read())
    except FileNotFoundError:
        return
    if _running(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("elastic", [[], ["--elastic", "1:2", "--max-restarts", "0"]], ids=["plain", "elastic"])
def test_a_dead_workers_children_are_stopped_before_its_death_is_reported(out: str, elastic: list[str]) -> None:
    launcher = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--grace", "30", *elastic,
                               "--", sys.executable, "-c", WORKER, out, CHILD], capture_output=True, text=True,
                              timeout=300)
    err = launcher.stderr
    assert launcher.returncode == 3, err
    with open(os.path.join(out, "child-pid")) as f:
        child = int(f.read())
    wait_until(lambda: not _running(child), 30, f"the dead worker's child {child} to be gone")
    lines = err.splitlines()
    verdict = next(i for i, ln in enumerate(lines) if "rank 1 exited with status 3" in ln)
    # the group was stopped first (the child heard it, through the pipes the launcher still read),
    # and the dead worker's last lines come before the verdict
    assert "[1] child got SIGTERM" in lines[:verdict], err
    assert "[1] rank 1 last words" in lines[:verdict], err


#: The only worker starts a child that ignores SIGTERM (its pid in ``child-pid``) and exits 4.
STUBBORN = """
import os, subprocess, sys, time
out = sys.argv[1]
child = ("import os, signal, sys, time\\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "open(sys.argv[1] + '/child-pid.tmp', 'w').write(str(os.getpid()))\\n"
         "os.rename(sys.argv[1] + '/child-pid.tmp', sys.argv[1] + '/child-pid')\\n"
         "deadline = time.monotonic() + 60\\n"
         "while time.monotonic() < deadline:\\n"
         "    time.sleep(0.05)\\n")
subprocess.Popen([sys.executable, "-c", child, out])
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "child-pid")) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(4)
"""


def test_a_dead_workers_child_that_ignores_sigterm_is_killed_after_the_grace_period(out: str) -> None:
    res = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "1", "--grace", "1", "--",
                          sys.executable, "-c", STUBBORN, out], capture_output=True, text=True, timeout=300)
    assert res.returncode == 4 and "rank 0 exited with status 4" in res.stderr, res.stderr
    with open(os.path.join(out, "child-pid")) as f:
        child = int(f.read())
    wait_until(lambda: not _running(child), 30, f"the dead worker's child {child} to be gone")
