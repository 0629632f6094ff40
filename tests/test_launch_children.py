"""`irdma run` and the children of a worker that died (issue 36, point 15): the launcher stops
what is left of the dead worker's process group (its ``sleep``, its data loaders) at once, with
and without ``--elastic``, and reports the death right after the worker's own last lines, not
after waiting on pipes its children still hold; a signal to the launcher while it stops the job
kills what is left at once. A real CLI process, real workers, a real local cluster."""

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
def test_a_dead_workers_children_are_stopped_and_its_death_reported_after_its_last_words(out: str,
                                                                                          elastic: list[str]) -> None:
    # --grace is far beyond any machine's load: the child is told, never killed, so it leaves its marker
    launcher = subprocess.run([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--grace", "600", *elastic,
                               "--", sys.executable, "-c", WORKER, out, CHILD], capture_output=True, text=True,
                              timeout=900)
    err = launcher.stderr
    assert launcher.returncode == 3, err
    with open(os.path.join(out, "child-pid")) as f:
        child = int(f.read())
    wait_until(lambda: not _running(child), 30, f"the dead worker's child {child} to be gone")
    assert os.path.exists(os.path.join(out, "child-term")), err  # it was told to stop (SIGTERM)
    lines = err.splitlines()
    verdict = next(i for i, ln in enumerate(lines) if "rank 1 exited with status 3" in ln)
    # the worker's own last lines come before the verdict (the launcher copies what its pipes
    # hold once it exited, whoever else holds them); its child's come too, in whatever order
    assert "[1] rank 1 last words" in lines[:verdict], err
    assert "[1] child got SIGTERM" in lines, err


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


#: The only worker starts a child that ignores SIGTERM and holds none of its pipes, notes both
#: pids and exits 0.
LEFT_BEHIND = """
import os, subprocess, sys, time
out = sys.argv[1]
child = ("import os, signal, sys, time\\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "open(sys.argv[1] + '/child-pid.tmp', 'w').write(str(os.getpid()))\\n"
         "os.rename(sys.argv[1] + '/child-pid.tmp', sys.argv[1] + '/child-pid')\\n"
         "deadline = time.monotonic() + 600\\n"
         "while time.monotonic() < deadline:\\n"
         "    time.sleep(0.05)\\n")
subprocess.Popen([sys.executable, "-c", child, out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "child-pid")) and time.monotonic() < deadline:
    time.sleep(0.02)
with open(os.path.join(out, "worker-pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, "worker-pid.tmp"), os.path.join(out, "worker-pid"))
"""


def _pid(out: str, name: str) -> int | None:
    try:
        with open(os.path.join(out, name)) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


def test_a_sigterm_to_the_launcher_while_a_dead_workers_child_lingers_kills_it_and_the_launcher_ends(out: str) -> None:
    """The worker exited 0; its child ignores the SIGTERM it got then, and --grace is an hour.
    A SIGTERM to the launcher (now: while it waits for that child, its signal handlers once
    put back) kills the child and ends the launcher, which exits 128 + 15 (a stopped job)."""
    launcher = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "1", "--grace", "3600", "--",
                                 sys.executable, "-c", LEFT_BEHIND, out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (pid := _pid(out, "worker-pid")) is not None and not os.path.exists(f"/proc/{pid}"), 120,
                   "the worker to exit and be reaped")
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)  # not the hour of --grace
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, err.decode()
    child = _pid(out, "child-pid")
    assert child is not None
    wait_until(lambda: not _running(child), 30, f"the dead worker's child {child} to be gone")


#: Rank 0 notes and ignores SIGTERM and SIGINT (its pid in ``pid-0``); rank 1 exits 3 once rank 0 runs.
DEAF = """
import os, signal, sys, time
rank, out = int(os.environ["IRDMA_RANK"]), sys.argv[1]
deadline = time.monotonic() + 600
if rank == 0:
    def note(signum, frame):
        open(os.path.join(out, f"got-{signal.Signals(signum).name}"), "w").close()
    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    with open(os.path.join(out, "pid-0.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(out, "pid-0.tmp"), os.path.join(out, "pid-0"))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0)
while not os.path.exists(os.path.join(out, "pid-0")) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(3)
"""


def test_a_ctrl_c_while_the_launcher_stops_the_job_kills_what_is_left_at_once(out: str) -> None:
    """Rank 1 failed: the launcher SIGTERMed rank 0, which ignores it, and would wait --grace
    (an hour) before SIGKILL. A Ctrl-C meanwhile kills it now; the status stays rank 1's."""
    launcher = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "run", "-n", "2", "--grace", "3600", "--",
                                 sys.executable, "-c", DEAF, out], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: os.path.exists(os.path.join(out, "got-SIGTERM")), 120, "the launcher to stop rank 0")
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)  # not the hour of --grace
    finally:
        if launcher.poll() is None:
            launcher.kill()  # rank 0 dies with it (PR_SET_PDEATHSIG)
            launcher.wait(timeout=60)
    rank0 = _pid(out, "pid-0")
    assert rank0 is not None
    try:
        assert launcher.returncode == 3 and "rank 1 exited with status 3" in err.decode(), err.decode()
        wait_until(lambda: not _running(rank0), 30, f"rank 0 ({rank0}) to be gone")
    finally:
        if _running(rank0):
            os.kill(rank0, signal.SIGKILL)
