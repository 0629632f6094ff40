"""Test helpers: real clusters, real mounts, waiting on conditions with deadlines."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from irdma.fs.mount import spawn_mount, unmount

from irdma import cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll ``cond`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def irdma_cli(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "irdma.cli", *args], capture_output=True, text=True, env=env,
                         timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"irdma {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


_BAD_LOG = re.compile(r"Traceback|\bERROR\b|CRITICAL|Exception")


def assert_clean_log(path: str, allow: tuple[str, ...] = ()) -> None:
    """Fail if a process log shows a traceback or an error (pyfuse3's pytest_checklogs idea)."""
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        bad = [line for line in f if _BAD_LOG.search(line) and not any(a in line for a in allow)]
    assert not bad, f"{path} logged errors:\n" + "".join(bad[:20])


class Cluster:
    def __init__(self, directory: str, shards: int, capacity: int) -> None:
        self.dir = directory
        self.meta_url = cluster.up(directory, shards, capacity, fresh=True)
        self.shards = cluster.read_state(directory)

    def logs(self) -> list[str]:
        return [s.log for s in self.shards]

    def stop(self) -> None:
        for log in self.logs():
            assert_clean_log(log)
        cluster.down(self.dir)


@contextlib.contextmanager
def running_cluster(directory: str, shards: int = 2, capacity: int = 64 << 20) -> Iterator[Cluster]:
    c = Cluster(directory, shards, capacity)
    try:
        yield c
    finally:
        c.stop()


@contextlib.contextmanager
def mounted(meta_url: str, mountpoint: str, allow_log: tuple[str, ...] = (), *, allow_other: bool = False) -> Iterator[str]:
    """A real FUSE mount in a child process; unmounted (and its log checked) on exit."""
    os.makedirs(mountpoint, exist_ok=True)
    log = mountpoint.rstrip("/") + ".log"
    spawn_mount(meta_url, mountpoint, transport="tcp", log_file=log, allow_other=allow_other)
    try:
        yield mountpoint
    finally:
        if os.path.ismount(mountpoint):
            unmount(mountpoint)
        assert_clean_log(log, allow_log)
