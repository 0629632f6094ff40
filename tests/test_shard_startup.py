"""A shard (or a mount) stopped at any moment after it says it is ready shuts down cleanly (issue 36,
point 18).

The port file is the shard's word that it is ready (``irdma up`` waits for its handshake, scripts
and tests for the file). A CI run once SIGTERMed a shard the moment its port file appeared, before
the shard had its signal handling in place, and the shard died by the signal (exit -15). Here the
signal is sent as soon as the kernel reports the file (inotify, not a poll interval), many times.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import struct
import subprocess
import sys
import time

import pytest
from helpers import assert_clean_log, running_cluster

from irdma.wire import auth

_IN_MOVED_TO, _IN_CLOEXEC, _EVENT = 0x80, 0o2000000, struct.Struct("iIII")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _Watch:
    """An inotify watch for files renamed into one directory (how the port file is written)."""

    def __init__(self, directory: str) -> None:
        self.fd = _libc.inotify_init1(_IN_CLOEXEC)
        if self.fd < 0 or _libc.inotify_add_watch(self.fd, directory.encode(), _IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify")

    def wait_for(self, name: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
        """Return as soon as ``name`` is renamed into the directory; fail at ``timeout`` or if ``proc`` exits."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise AssertionError(f"no port file in {timeout} s (shard exit code {proc.poll()})")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))  # 0.5: notice an exited shard
            if not ready:
                continue
            buf = os.read(self.fd, 4096)
            at = 0
            while at < len(buf):
                _, _, _, size = _EVENT.unpack_from(buf, at)
                if buf[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0").decode() == name:
                    return
                at += _EVENT.size + size

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.parametrize("data_dir", [False, True], ids=["memory", "data-dir"])
def test_a_shard_signalled_the_moment_its_port_file_appears_exits_cleanly(tmp_path: object, data_dir: bool) -> None:
    """20 starts, each stopped by SIGTERM (or SIGINT, every other one) at the moment the port file
    appears: every one exits 0, logs that it stops, and logs no error."""
    tmp = str(tmp_path)
    key = os.path.join(tmp, "key")
    auth.create_key_file(key)
    watch = _Watch(tmp)
    try:
        for i in range(10):
            port_file, log = os.path.join(tmp, f"port-{i}"), os.path.join(tmp, f"shard-{i}.log")
            args = [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity", "8MiB",
                    "--transport", "tcp", "--key-file", key, "--port-file", port_file]
            if data_dir:
                args += ["--data-dir", os.path.join(tmp, "d")]  # the same directory: reopened each time
            signum = signal.SIGTERM if i % 2 == 0 else signal.SIGINT
            with open(log, "wb") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
            try:
                watch.wait_for(os.path.basename(port_file), 60, proc)
                proc.send_signal(signum)
                rc = proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            with open(log, errors="replace") as f:
                text = f.read()
            assert rc == 0, f"start {i}: the shard exited {rc} on {signum.name}; its log:\n{text}"
            assert f"stopping on signal {int(signum)}" in text, text
            assert_clean_log(log)
    finally:
        watch.close()


def _mounted_at(mountpoint: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mountpoint for line in f)


def test_a_mount_signalled_the_moment_it_is_mounted_unmounts_cleanly(tmp_path: object) -> None:
    """A mount process SIGTERMed (or SIGINTed) the moment the kernel lists its mount (poll(2) on
    /proc/self/mounts wakes on every change of the mount table) unmounts and exits 0, 6 times:
    its signal receiver is open before the mount exists (it was opened by a task that first ran
    inside pyfuse3.main, so a signal in between killed the process and left a dead mount)."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1, capacity=16 << 20) as c:
        for i in range(6):
            mnt, log = os.path.join(tmp, f"m{i}"), os.path.join(tmp, f"m{i}.log")
            os.makedirs(mnt)
            signum = signal.SIGTERM if i % 2 == 0 else signal.SIGINT
            table = select.poll()
            with open("/proc/self/mounts") as mounts:
                table.register(mounts, select.POLLPRI | select.POLLERR)
                with open(log, "wb") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "irdma.fs", c.meta_url, mnt, "--transport", "tcp"],
                                            stdout=out, stderr=subprocess.STDOUT)
                try:
                    deadline = time.monotonic() + 60
                    while not _mounted_at(mnt):
                        assert proc.poll() is None and time.monotonic() < deadline, f"start {i}: no mount"
                        table.poll(500)  # a mount-table change, or a look at the process
                        mounts.seek(0)
                        mounts.read()  # the change is seen: the next poll waits for the next one
                    proc.send_signal(signum)
                    rc = proc.wait(60)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(30)
                    if _mounted_at(mnt):
                        subprocess.run(["fusermount3", "-uz", mnt], check=False)
            with open(log, errors="replace") as f:
                text = f.read()
            assert rc == 0, f"start {i}: the mount exited {rc} on {signum.name}; its log:\n{text}"
            assert not _mounted_at(mnt), f"start {i}: {mnt} is still mounted after the mount process exited"
            assert_clean_log(log)
