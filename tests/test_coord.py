"""Consistency models (ASP/BSP/SSP worker clocks on a job directory) and the sync functions
(``.irdma/barrier``, ``.irdma/lock``, ``.irdma/counter``) across two real mounts of one
cluster, with worker and lock-holder processes that are killed on purpose."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio
from helpers import Cluster, irdma_cli, meta_calls, mounted, wait_until

from irdma.train import coord

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
    deadline = 2  # seconds, the job's user.irdma.sync_timeout
    d = _job(mnt, "job-dead", "bsp", 2, timeout=deadline)
    t0 = time.monotonic()
    fast = Ticker(d, 0).tick()  # worker 1 never ticks (it died)
    # What is checked is that the wait ends, at the job's deadline and not at the default one
    # (DEFAULT_SYNC_TIMEOUT, 60 s) nor never: so the bound is the deadline x 5 + 10 s, which a
    # loaded machine stays under and a wait for the 60 s default (or for ever) does not.
    assert fast.done.wait(deadline * 5 + 10), "the tick still waits for the dead worker"
    assert fast.error is not None and fast.error.errno == errno.ETIMEDOUT
    assert time.monotonic() - t0 > deadline - 0.5  # it waited for its deadline first
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
        who, expires = f.read().split()
    assert who.endswith(f"/{holder.pid}")  # who holds it, seen from the other mount
    assert int(expires) <= time.time_ns() + 2 * 10**9  # for the 2 s lease it asked for
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    holder.stdout.close()
    # waited for the dead holder's 2 s lease, then got it: had the lease not ended the holder's
    # claim, the read would fail at mnt2's sync deadline (ETIMEDOUT), not return a lease
    with open(os.path.join(mnt2, ".irdma", "lock", "l1@30")) as f:
        assert int(f.read()) > time.time_ns()
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


# ---------------------------------------------------------------- sync objects: owners, leases, interrupts
# A mount every user may use (allow_other), on a mountpoint other users can reach, with a short
# sync deadline; commands run as root, as nobody and as a third uid (daemon, 1) in real processes.
NOBODY, OTHER = 65534, 1
SYNC_TIMEOUT = 3.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other users: needs root")


@pytest.fixture(scope="module")
def shared(cluster: Cluster) -> Iterator[str]:
    top = tempfile.mkdtemp(prefix="irdma-shared-")
    os.chmod(top, 0o755)  # pytest's own temporary directories are 0700: nobody could not reach the mount
    try:
        with mounted(cluster.meta_url, os.path.join(top, "m"), allow_other=True, sync_timeout=SYNC_TIMEOUT) as m:
            yield m
    finally:
        shutil.rmtree(top, ignore_errors=True)


def sh(uid: int, cmd: str, umask: int = 0o022, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with sh as ``uid`` (its own group, no others) with ``umask``."""
    return subprocess.run(["sh", "-c", cmd], user=uid, group=uid, extra_groups=[], umask=umask, cwd="/",
                          capture_output=True, text=True, timeout=timeout)


def spawn(uid: int, cmd: str, umask: int = 0o022) -> subprocess.Popen[str]:
    return subprocess.Popen(["sh", "-c", f"exec {cmd}"], user=uid, group=uid, extra_groups=[], umask=umask, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def owner(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_uid, stat.S_IMODE(st.st_mode)


def barrier_state(path: str) -> tuple[int, int, int]:
    """``(generation, arrivals waiting, count)`` of the barrier of ``.irdma/barrier/NAME``."""
    with open(path) as f:
        gen, arrived, n = map(int, f.read().split())
    return gen, arrived, n


def lock_holder(path: str) -> str | None:
    with open(path) as f:
        text = f.read().split()
    return None if text == ["free"] else text[0]


_READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def in_read(pid: int) -> bool:
    """``pid`` is blocked in read(2) (where a wait through the mount sits)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == str(_READ_SYSCALL)
    except (OSError, IndexError):
        return False


@needs_root
def test_sync_objects_are_created_with_the_callers_uid_and_umask_and_checked_like_files(shared: str) -> None:
    c = os.path.join(shared, ".irdma", "counter")
    assert sh(0, f"echo 5 > {c}/rootc").returncode == 0
    assert owner(f"{c}/rootc") == (0, 0o644)
    denied = sh(NOBODY, f"echo 1 > {c}/rootc")  # root's counter: nobody may read it, not move it
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert sh(NOBODY, f"cat {c}/rootc").stdout == "5\n"

    # nobody's own, made under umask 077: the name shows it before it exists, as it will be made
    assert sh(NOBODY, f"stat -c '%u %a' {c}/nobc", umask=0o077).stdout == "65534 600\n"
    assert sh(NOBODY, f"echo 1 > {c}/nobc", umask=0o077).returncode == 0
    assert owner(f"{c}/nobc") == (NOBODY, 0o600)
    assert "Permission denied" in sh(OTHER, f"cat {c}/nobc").stderr
    assert sh(0, f"echo 1 > {c}/nobc").returncode == 0  # root may do everything, as on files
    assert sh(OTHER, f"chmod 666 {c}/nobc").returncode != 0  # only its owner (or root) changes its mode
    assert sh(NOBODY, f"chmod 666 {c}/nobc").returncode == 0
    assert sh(OTHER, f"echo 1 > {c}/nobc && cat {c}/nobc").stdout == "3\n"
    assert owner(f"{c}/nobc") == (NOBODY, 0o666)


@needs_root
def test_nobody_cannot_take_or_release_roots_lock(shared: str) -> None:
    lk = os.path.join(shared, ".irdma", "lock")
    assert sh(0, f"cat {lk}/rootjob@60").returncode == 0  # root holds it (a read-only handle: beyond the cat)
    assert (lock_holder(f"{lk}/rootjob") or "").startswith("0@")
    took = sh(NOBODY, f"cat {lk}/rootjob@60")
    assert took.returncode != 0 and "Permission denied" in took.stderr
    # refused at once, not after a wait: a lock wait sits in read(2), and the refusal comes at
    # open(2), before any read (a shell that only opens the lock is refused the same way)
    opened = sh(NOBODY, f"exec 3< {lk}/rootjob@60")
    assert opened.returncode != 0 and "Permission denied" in opened.stderr, opened
    assert "Permission denied" in sh(NOBODY, f"echo 0 > {lk}/rootjob").stderr
    assert (lock_holder(f"{lk}/rootjob") or "").startswith("0@")
    assert sh(0, f"echo 0 > {lk}/rootjob").returncode == 0  # another process of root's releases it
    assert lock_holder(f"{lk}/rootjob") is None


@needs_root
def test_a_jobs_objects_live_in_its_directory_and_follow_its_permissions(shared: str) -> None:
    job = os.path.join(shared, "job700")
    os.mkdir(job, 0o700)
    assert sh(0, f"cat {job}/.irdma/barrier/b@1").stdout == "1\n"
    assert sh(0, f"echo 7 > {job}/.irdma/counter/c && cat {job}/.irdma/counter/c").stdout == "7\n"
    assert sh(0, f"cat {shared}/.irdma/counter/c").stdout == "0\n"  # the root's c is another counter
    for cmd in (f"cat {job}/.irdma/barrier/b@1", f"cat {job}/.irdma/counter/c", f"cat {job}/.irdma/lock/l@5"):
        res = sh(NOBODY, cmd)
        assert res.returncode != 0 and "Permission denied" in res.stderr, cmd
    assert os.stat(os.path.join(job, ".irdma")).st_mode & 0o7777 == 0o700

    pub = os.path.join(shared, "pub755")  # nobody may use root's objects here as their modes say, make none
    os.mkdir(pub, 0o755)
    assert sh(0, f"echo 2 > {pub}/.irdma/counter/seen").returncode == 0
    assert sh(NOBODY, f"cat {pub}/.irdma/counter/seen").stdout == "2\n"
    assert "Permission denied" in sh(NOBODY, f"echo 1 > {pub}/.irdma/counter/new").stderr
    assert "Permission denied" in sh(NOBODY, f"cat {pub}/.irdma/barrier/new@1").stderr

    mine = os.path.join(shared, "nobodys")  # nobody's job directory: nobody's objects, root may use them
    os.mkdir(mine, 0o700)
    os.chown(mine, NOBODY, NOBODY)
    assert sh(NOBODY, f"echo 3 > {mine}/.irdma/counter/n", umask=0o077).returncode == 0
    assert owner(os.path.join(mine, ".irdma", "counter", "n")) == (NOBODY, 0o600)
    assert sh(0, f"cat {mine}/.irdma/counter/n").stdout == "3\n"


@needs_root
def test_a_lock_is_released_by_echo_0_from_any_process_of_the_holders_uid(shared: str) -> None:
    lk = os.path.join(shared, ".irdma", "lock")
    assert sh(NOBODY, f"cat {lk}/nl@30", umask=0).returncode == 0  # 0666: uid 1 may write to it
    assert (lock_holder(f"{lk}/nl") or "").startswith(f"{NOBODY}@")
    res = sh(OTHER, f"/bin/echo 0 > {lk}/nl")  # another uid: not its lock (dash's echo says only "I/O error")
    assert res.returncode != 0 and "Operation not permitted" in res.stderr
    assert lock_holder(f"{lk}/nl") is not None
    assert sh(NOBODY, f"echo 0 > {lk}/nl").returncode == 0  # a later shell of the same uid
    assert lock_holder(f"{lk}/nl") is None
    assert sh(NOBODY, f"echo 0 > {lk}/nl").returncode == 0  # a free lock: nothing to do
    # free for the next one: had it still been held (a 30 s lease), the cat would fail at the
    # mount's sync deadline (SYNC_TIMEOUT) instead
    assert sh(OTHER, f"cat {lk}/nl@30").returncode == 0
    assert (lock_holder(f"{lk}/nl") or "").startswith(f"{OTHER}@")
    assert sh(OTHER, f"echo 0 > {lk}/nl").returncode == 0


HANDLE_HOLDER = """
import sys
f = open(sys.argv[1], "r+")  # read-write: the handle holds the lock
print(f.read().strip(), flush=True)
sys.stdin.readline()
f.close()
print("closed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("end", ["close", "SIGKILL"])
def test_a_lock_taken_through_a_read_write_handle_is_released_with_the_handle(shared: str, end: str) -> None:
    lk = os.path.join(shared, ".irdma", "lock")
    p = subprocess.Popen([sys.executable, "-c", HANDLE_HOLDER, f"{lk}/rw-{end}@600"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    assert int(p.stdout.readline()) > time.time_ns()
    assert (lock_holder(f"{lk}/rw-{end}") or "").endswith(f"/{p.pid}")
    if end == "close":
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "closed\n"
    else:
        p.kill()
    wait_until(lambda: lock_holder(f"{lk}/rw-{end}") is None, 5, "the lock released with its handle")
    p.kill()
    p.communicate(timeout=10)


def test_a_lease_is_capped_by_max_lease(shared: str) -> None:
    job = os.path.join(shared, "leases")
    os.mkdir(job)
    for bad in (b"0", b"never", b"86401"):
        with pytest.raises(OSError) as exc:
            os.setxattr(job, "user.irdma.max_lease", bad)
        assert exc.value.errno == errno.EINVAL
    os.setxattr(job, "user.irdma.max_lease", b"1")
    t0 = time.time_ns()
    with open(os.path.join(job, ".irdma", "lock", "l@3600")) as f:
        expires = int(f.read())
    assert t0 < expires <= time.time_ns() + 1_100_000_000  # 1 s, not an hour
    # another process gets it once that second is up (within the mount's sync deadline: had the
    # lease been the hour asked for, the cat would fail with ETIMEDOUT)
    subprocess.run(["cat", os.path.join(job, ".irdma", "lock", "l@5")], check=True, capture_output=True, timeout=30)

    t0 = time.time_ns()  # the root's .irdma: the default cap, 600 s
    with open(os.path.join(shared, ".irdma", "lock", "day@86400")) as f:
        expires = int(f.read())
    assert t0 + 590 * 10**9 < expires <= time.time_ns() + 600 * 10**9
    with open(os.path.join(shared, ".irdma", "lock", "day"), "w") as f:
        f.write("0")


def _waiter(shared: str, kind: str) -> tuple[list[str], Callable[[int], bool]]:
    """A command that waits on a ``kind`` sync object that will not come, and when it waits."""
    if kind == "barrier":
        path = os.path.join(shared, ".irdma", "barrier", "never@2")
        return ["cat", path], lambda pid: barrier_state(path[: -len("@2")])[1] == 1 and in_read(pid)
    if kind == "lock":
        with open(os.path.join(shared, ".irdma", "lock", "taken@600")) as f:  # held by this process
            f.read()
        return ["cat", os.path.join(shared, ".irdma", "lock", "taken@30")], in_read
    job = os.path.join(shared, "bsp-job")
    if not os.path.isdir(job):
        _job(shared, "bsp-job", "bsp", 2)
    before = os.getxattr(job, "user.irdma.clocks")
    # worker 1 never ticks; worker 0's tick is in, so the mount has the read (a lock wait shows
    # nothing: there the kill may land before the mount reads the request, which ends it anyway)
    return ["cat", os.path.join(job, ".irdma-clock@0")], lambda pid: (
        os.getxattr(job, "user.irdma.clocks") != before and in_read(pid))


@pytest.mark.parametrize("kind", ["barrier", "lock", "clock"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_signalled_waiter_is_gone_within_1_s(shared: str, kind: str, sig: signal.Signals) -> None:
    cmd, waiting = _waiter(shared, kind)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: waiting(p.pid), 5, f"cat waiting on the {kind}")
        t0 = time.monotonic()
        p.send_signal(sig)
        p.wait(timeout=1)  # reaped within 1 s (it sat in D state until the sync deadline before)
        assert time.monotonic() - t0 < 1
        assert p.returncode == -sig
    finally:
        p.kill()
        p.communicate(timeout=10)
    if kind == "barrier":  # its arrival is withdrawn: the next pair starts from nothing
        assert barrier_state(os.path.join(shared, ".irdma", "barrier", "never"))[1] == 0
    if kind == "lock":
        with open(os.path.join(shared, ".irdma", "lock", "taken"), "w") as f:
            f.write("0")


PY_WAITER = """
import sys
try:
    open(sys.argv[1]).read()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_interrupts_a_python_waiter(shared: str) -> None:
    path = os.path.join(shared, ".irdma", "barrier", "ctrlc@2")
    p = subprocess.Popen([sys.executable, "-c", PY_WAITER, path], stdout=subprocess.PIPE, text=True)
    wait_until(lambda: barrier_state(path[: -len("@2")])[1] == 1 and in_read(p.pid), 10, "the waiter at the barrier")
    p.send_signal(signal.SIGINT)  # Python handles it: the read fails with EINTR, then KeyboardInterrupt
    assert p.communicate(timeout=1)[0] == "interrupted\n"
    assert barrier_state(path[: -len("@2")])[1] == 0


def test_a_wait_ends_at_the_mounts_sync_timeout_and_withdraws(shared: str) -> None:
    t0 = time.monotonic()
    res = subprocess.run(["cat", os.path.join(shared, ".irdma", "barrier", "late@2")], capture_output=True,
                         text=True, timeout=SYNC_TIMEOUT * 5 + 10)
    assert res.returncode != 0 and "timed out" in res.stderr
    # it waited for the mount's deadline; the bound that it ended there, and not at the default
    # one (60 s) nor never, is the run's timeout above: the deadline x 5 + 10 s, which a loaded
    # machine stays under
    assert time.monotonic() - t0 > SYNC_TIMEOUT - 0.5
    assert barrier_state(os.path.join(shared, ".irdma", "barrier", "late")) == (0, 0, 2)
    assert "--sync-timeout" in irdma_cli("mount", "--help").stdout


def test_a_cancelled_barrier_wait_withdraws_its_arrival(cluster: Cluster) -> None:
    from irdma.meta import open_meta
    from irdma.meta.aio import AsyncMeta

    meta = AsyncMeta(open_meta(cluster.meta_url))

    async def main() -> None:
        with trio.move_on_after(30):
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def wait() -> None:
                    with scope:
                        await coord.barrier(meta, "cancelled", 2, 60)

                nursery.start_soon(wait)
                while (await meta.barrier_state("cancelled"))[1] != 1:  # noqa: ASYNC110 - the state is in the database: no Event reaches it
                    await trio.sleep(0.01)
                scope.cancel()
        assert await meta.barrier_state("cancelled") == (0, 0, 2)

    try:
        trio.run(main)
    finally:
        meta.store.close()


def test_bsp_workers_pass_many_job_barriers_with_their_clocks_at_the_steps_they_took(cluster: Cluster) -> None:
    """Two workers (a metadata client each, as two processes have) take a few BSP steps and pass
    a job barrier, epoch after epoch, as ``MetricAverageCallback`` does at each epoch's end.
    The worker that passes a barrier first takes its next step before the other has left the
    barrier: leaving it must not move the other's clock up to that step (it would count a step
    it never took, and at the next barrier each waits for the other until the deadline)."""
    from irdma.meta import open_meta
    from irdma.meta.aio import AsyncMeta
    from irdma.meta.base import ROOT_INO

    epochs, steps, deadline = 25, 3, 20.0
    bsp = coord.parse_consistency("bsp")
    metas = [AsyncMeta(open_meta(cluster.meta_url)) for _ in range(2)]
    job = metas[0].store.create(ROOT_INO, b"many-barriers", stat.S_IFDIR | 0o755, os.getuid(), os.getgid()).ino
    after: dict[int, list[int]] = {0: [], 1: []}  # each worker's clock after each barrier

    async def worker(w: int) -> None:
        meta = metas[w]
        for epoch in range(epochs):
            for _ in range(steps):
                await coord.tick(meta, job, w, 2, bsp, deadline)
            await coord.job_barrier(meta, job, f"metrics-{epoch}", w, 2, None, deadline)
            after[w].append((await meta.clocks(job))[w])

    async def main() -> None:
        for w in (0, 1):  # both join before either steps (irdma.keras.init, then the start barrier)
            await coord.join(metas[w], job, w)
        async with trio.open_nursery() as nursery:
            for w in (0, 1):
                nursery.start_soon(worker, w)

    try:
        trio.run(main)
    finally:
        for m in metas:
            m.store.close()
    every = [steps * (e + 1) for e in range(epochs)]
    assert after == {0: every, 1: every}


def test_a_clock_tick_is_one_metadata_call_and_sees_the_jobs_settings_change(cluster: Cluster) -> None:
    """A training step's clock tick (``Client.clock``, what DistributedOptimizer calls every
    step) reads the job's settings at most once a JOB_SETTINGS_S: one metadata call a tick in
    the steady state, against six. Another client's change of the settings is seen within that
    time (a tick by a worker id past the new count is refused), this client's own at once."""
    import irdma
    from irdma.client.coord import JOB_SETTINGS_S

    with irdma.connect(cluster.meta_url, transport="tcp") as a, irdma.connect(cluster.meta_url, transport="tcp") as b:
        ino = a.makedirs("/jobs/settings").ino
        a.client.store.setxattr(ino, b"user.irdma.workers", b"2")
        assert a.run(a.client.clock, "/jobs/settings", 1) == 1
        before, t0 = meta_calls(), time.monotonic()
        for k in range(30):
            assert a.run(a.client.clock, "/jobs/settings", 1) == k + 2
        assert meta_calls() - before <= 30 + 6 * ((time.monotonic() - t0) / JOB_SETTINGS_S + 1) < 6 * 30
        b.run(b.client.meta.setxattr, ino, b"user.irdma.workers", b"1")  # another client: worker 1 is gone
        deadline = time.monotonic() + JOB_SETTINGS_S + 5
        with pytest.raises(irdma.InvalidArgument, match="not one of the job's 1 workers"):
            while time.monotonic() < deadline:
                a.run(a.client.clock, "/jobs/settings", 1)
        a.run(a.client.meta.setxattr, ino, b"user.irdma.workers", b"2")  # this client: seen at once
        assert a.run(a.client.clock, "/jobs/settings", 1) >= 32
