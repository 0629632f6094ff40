"""Consistency models (ASP/BSP/SSP worker clocks on a job directory) and the sync functions
(``.irdma/barrier``, ``.irdma/lock``, ``.irdma/counter``) across two real mounts of one
cluster, with worker and lock-holder processes that are killed on purpose."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.fuse


def tick(job: str, worker: int) -> int:
    with open(os.path.join(job, f".irdma-clock@{worker}")) as f:
        return int(f.read())


def _job(m: str, name: str, consistency: str, workers: int, timeout: float = 30) -> str:
    d = os.path.join(m, name)
    os.makedirs(d)
    os.setxattr(d, "user.irdma.consistency", consistency.encode())
    os.setxattr(d, "user.irdma.workers", str(workers).encode())
    os.setxattr(d, "user.irdma.sync_timeout", str(timeout).encode())
    return d


class Ticker:
    """Ticks a worker's clock in a thread; ``done`` is set when a tick returns."""

    def __init__(self, path: str, worker: int) -> None:
        self.path, self.worker = path, worker
        self.done = threading.Event()
        self.error: OSError | None = None

    def tick(self) -> Ticker:
        self.done.clear()

        def run() -> None:
            try:
                tick(self.path, self.worker)
            except OSError as exc:
                self.error = exc
            self.done.set()

        threading.Thread(target=run, daemon=True).start()
        return self


def _blocked(t: Ticker, for_s: float = 0.8) -> bool:
    """The tick is still waiting after ``for_s`` seconds (a bounded negative check)."""
    return not t.done.wait(for_s)


@pytest.mark.parametrize("consistency,staleness", [("ssp:2", 2), ("bsp", 0)])
def test_a_fast_worker_waits_exactly_when_it_is_s_plus_one_clocks_ahead(mnt: str, mnt2: str, consistency: str,
                                                                       staleness: int) -> None:
    d = _job(mnt, f"job-{consistency.replace(':', '')}", consistency, 2)
    slow = os.path.join(mnt2, os.path.basename(d))  # worker 1, on the other mount
    fast = Ticker(d, 0)
    for clock in range(1, staleness + 1):  # up to S ahead: never waits
        assert fast.tick().done.wait(10), f"tick to {clock} waited"
    assert _blocked(fast.tick())  # S+1 ahead: waits for the slow worker
    assert tick(slow, 1) == 1
    assert fast.done.wait(10) and fast.error is None  # it ticked: the fast one goes on
    assert os.getxattr(d, "user.irdma.clocks") == f"0:{staleness + 1} 1:1".encode()


def test_asp_never_waits_and_bad_settings_are_refused(mnt: str) -> None:
    d = _job(mnt, "job-asp", "asp", 2)
    for k in range(20):
        assert tick(d, 0) == k + 1
    assert os.getxattr(d, "user.irdma.clocks") == b"0:20"
    for name, value in [("user.irdma.consistency", b"ssp:-1"), ("user.irdma.consistency", b"eventual"),
                        ("user.irdma.workers", b"0"), ("user.irdma.sync_timeout", b"never")]:
        with pytest.raises(OSError) as exc:
            os.setxattr(d, name, value)
        assert exc.value.errno == errno.EINVAL
    assert os.getxattr(d, "user.irdma.consistency") == b"asp"
    with pytest.raises(OSError) as exc:
        tick(d, 2)  # worker ids are 0 .. workers-1
    assert exc.value.errno == errno.EINVAL


def test_a_dead_worker_blocks_the_others_only_until_the_deadline(mnt: str) -> None:
    d = _job(mnt, "job-dead", "bsp", 2, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(OSError) as exc:
        tick(d, 0)  # worker 1 never ticks (it died)
    assert exc.value.errno == errno.ETIMEDOUT
    assert 1.5 < time.monotonic() - t0 < 10
    os.setxattr(d, "user.irdma.workers", b"1")  # the job goes on without it
    assert tick(d, 0) == 2


LOCKER = """
import os, sys, time
with open(sys.argv[1]) as f:  # NAME@2: acquire with a 2 s lease
    f.read()
print("held", flush=True)
time.sleep(60)                # killed while holding it
"""


def test_barrier_lock_and_counter_across_two_mounts_with_a_holder_killed(mnt: str, mnt2: str) -> None:
    # barrier of 3: two shell processes, one on each mount, and this one
    readers = [subprocess.Popen(["sh", "-c", f"cat {m}/.irdma/barrier/b1@3 && echo passed"], stdout=subprocess.PIPE)
               for m in (mnt, mnt2)]
    with open(os.path.join(mnt2, ".irdma", "barrier", "b1@3")) as f:
        assert f.read() == "1\n"  # the first generation is through
    assert [p.communicate(timeout=30)[0].split() for p in readers] == [[b"1", b"passed"]] * 2

    # a lock whose holder is SIGKILLed: the other mount gets it once the lease runs out
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, os.path.join(mnt, ".irdma", "lock", "l1@2")],
                              stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    with open(os.path.join(mnt2, ".irdma", "lock", "l1")) as f:
        assert f.read().split()[0].endswith(f"/{holder.pid}")  # who holds it, seen from the other mount
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    holder.stdout.close()
    t0 = time.monotonic()
    with open(os.path.join(mnt2, ".irdma", "lock", "l1@30")) as f:
        assert int(f.read()) > time.time_ns()  # waited for the dead holder's 2 s lease, then got it
    assert time.monotonic() - t0 < 10
    with open(os.path.join(mnt, ".irdma", "lock", "l1")) as f:
        assert f.read().split()[0].endswith(f"/{os.getpid()}")
    with pytest.raises(OSError) as exc, open(os.path.join(mnt, ".irdma", "lock", "l1"), "w") as f:
        f.write("1")  # only 0 (release) is written to a lock
    assert exc.value.errno == errno.EINVAL
    with open(os.path.join(mnt2, ".irdma", "lock", "l1"), "w") as f:
        f.write("0")  # released
    with open(os.path.join(mnt, ".irdma", "lock", "l1")) as f:
        assert f.read() == "free\n"

    # a counter: 2 processes x 40 adds on two mounts; every fetched value distinct
    script = ("import os,sys\nvals=[]\nfor _ in range(40):\n fd=os.open(sys.argv[1],os.O_RDWR)\n"
              " os.write(fd,b'1'); vals.append(int(os.pread(fd,64,0))); os.close(fd)\nprint(' '.join(map(str,vals)))")
    procs = [subprocess.Popen([sys.executable, "-c", script, os.path.join(m, ".irdma", "counter", "c1")],
                              stdout=subprocess.PIPE) for m in (mnt, mnt2)]
    fetched = [int(v) for p in procs for v in p.communicate(timeout=60)[0].split()]
    assert sorted(fetched) == list(range(80))
    with open(os.path.join(mnt, ".irdma", "counter", "c1")) as f:
        assert f.read() == "80\n"
    assert sorted(os.listdir(os.path.join(mnt, ".irdma"))) == ["barrier", "counter", "lock"]
