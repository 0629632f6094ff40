"""A mount's life, through real mounts on real shard processes: it refuses to mount over a
non-empty directory unless told (``--nonempty``); when its session was reaped (it missed its
heartbeats) it registers again, and a file removed meanwhile answers ESTALE while the others
read on; SIGTERM to ``examples/demo.py`` (shards, a mount, two training workers) leaves no
process and no mount behind.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import REPO, Cluster, irdma_cli, mounted, wait_until
from irdma.fs.mount import find_mount, spawn_mount

import irdma
from irdma._errors import IrdmaError
from irdma.meta import open_meta

pytestmark = pytest.mark.fuse

#: Warnings and errors the mounts here log on purpose.
ALLOW = ("was reaped", "was removed while this mount's session was reaped")


def _db(cluster: Cluster) -> str:
    return os.path.join(cluster.dir, "meta.db")


# ---------------------------------------------------------------- registered again after a reap
def _mount_sessions(cluster: Cluster, mountpoint: str) -> list[int]:
    meta = open_meta(_db(cluster))
    try:
        return [s.sid for s in meta.sessions() if s.name.startswith(f"mount {mountpoint}")
                or s.name.startswith(f"irdma-mount {mountpoint}")]
    finally:
        meta.close()


def test_a_file_removed_while_the_session_was_reaped_answers_estale(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    mp = str(tmp_path_factory.mktemp("reaped") / "m")
    with mounted(cluster.meta_url, mp, allow_log=ALLOW) as m:
        keep, gone = os.path.join(m, "keep"), os.path.join(m, "gone")
        data = os.urandom(100_000)
        for p in (keep, gone):
            with open(p, "wb") as f:
                f.write(data)
        fk = os.open(keep, os.O_RDONLY)
        fg = os.open(gone, os.O_RDWR)
        try:
            ino = os.fstat(fg).st_ino
            assert os.pread(fg, 10, 0) == data[:10]
            os.unlink(gone)  # held open by this mount's session: kept
            mp_abs = os.path.realpath(m)
            sessions = _mount_sessions(cluster, mp_abs)
            assert sessions, "the mount's session is not in the metadata"
            # the session missed its heartbeats and was reaped; the file, held by nobody now, freed
            # (retried in case the mount registered again in between and recorded it anew)
            with irdma.connect(cluster.meta_url, transport="tcp") as c:
                def reap_and_free() -> bool:
                    meta = open_meta(_db(cluster))
                    try:
                        for sid in _mount_sessions(cluster, mp_abs):
                            meta.reap_session(sid)
                    finally:
                        meta.close()
                    return bool(c.submit(lambda cl: cl.destroy_if_unused(ino, grace=False)).result(timeout=60))

                wait_until(reap_and_free, 30, "the removed file to be freed")

            def noticed() -> bool:  # at its next heartbeat: registered again, the file found gone
                with open(m + ".log") as f:
                    return f"file {ino}, open here, was removed" in f.read()

            wait_until(noticed, 30, "the mount to find the file gone", interval=0.1)
            for io in (lambda: os.pwrite(fg, b"more", 0), lambda: os.pread(fg, 10, 0)):
                with pytest.raises(OSError) as exc:
                    io()
                assert exc.value.errno == errno.ESTALE
            # the file that still has a name was recorded in the new session and reads on
            assert os.pread(fk, 100_000, 0) == data
            assert _mount_sessions(cluster, mp_abs), "the mount did not register again"
        finally:
            os.close(fk)
            with contextlib.suppress(OSError):
                os.close(fg)


# ---------------------------------------------------------------- non-empty mountpoints
def test_mount_refuses_a_non_empty_directory_unless_told(cluster: Cluster, tmp_path: object) -> None:
    mp = os.path.join(str(tmp_path), "busy")
    os.makedirs(mp)
    with open(os.path.join(mp, "precious"), "w") as f:
        f.write("mine")
    with pytest.raises(IrdmaError) as exc:
        spawn_mount(cluster.meta_url, mp, transport="tcp", log_file=mp + ".log")
    assert "not empty" in str(exc.value) and "precious" in str(exc.value) and "--nonempty" in exc.value.hint
    res = irdma_cli("mount", cluster.meta_url, mp, "--transport", "tcp", check=False)
    assert res.returncode != 0
    assert "not empty" in res.stdout + res.stderr and "--nonempty" in res.stdout + res.stderr
    assert find_mount(mp) is None and os.listdir(mp) == ["precious"]
    irdma_cli("mount", cluster.meta_url, mp, "--transport", "tcp", "--nonempty", "--log-file", mp + ".log")
    try:
        assert find_mount(mp) is not None
        assert "precious" not in os.listdir(mp)  # hidden while mounted, as asked
    finally:
        irdma_cli("umount", mp)
    assert os.listdir(mp) == ["precious"]


# ---------------------------------------------------------------- SIGTERM to the demo
def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, start time in clock ticks, command line) of every process now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        out[int(name)] = (int(fields[1]), fields[19], cmd)
    return out


def _started_by(root: int, marker: str) -> dict[int, tuple[str, str]]:
    """Processes descending from ``root`` or naming ``marker`` (the demo's work directory: its
    shards and mount run detached, in sessions of their own): pid -> (start time, command)."""
    table = _proc_table()
    found = {pid for pid, (_, _, cmd) in table.items() if marker in cmd}
    frontier = {root}
    while frontier:
        kids = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier}
        frontier = kids - found
        found |= kids
    return {pid: (table[pid][1], table[pid][2]) for pid in found if pid in table and pid != root}


@pytest.mark.long  # 25 s: make test-long (CI's time)
@pytest.mark.tf
def test_sigterm_to_the_demo_leaves_no_process_and_no_mount(tmp_path: object) -> None:
    tmp = str(tmp_path)
    env = dict(os.environ, TMPDIR=tmp)  # the demo's work directory goes here
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "demo.py"), "--steps", "100000"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_mtime: dict[str, int] = {}
    try:
        def training() -> bool:  # the mount is up and the training's two workers push through it
            assert proc.poll() is None, "the demo ended before it was signalled"
            with open("/proc/mounts") as f:
                if not any(line.split()[1].startswith(tmp) for line in f):
                    return False
            workers = [cmd for _, cmd in _started_by(proc.pid, tmp).values() if "--role worker" in cmd]
            params = glob.glob(os.path.join(tmp, "irdma-demo-*", "mnt", "digits", "params", "00-*"))
            if len(workers) < 2 or not params:
                return False
            mtime = os.stat(params[0]).st_mtime_ns  # the initial weights' until a worker pushes
            return first_mtime.setdefault(params[0], mtime) != mtime

        wait_until(training, 300, "the demo's two workers to train through its mount", interval=0.2)
        seen = _started_by(proc.pid, tmp)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = {pid: cmd for pid, (start, cmd) in seen.items() if _proc_table().get(pid, (0, "", ""))[1] == start}
    assert not left, f"left running after the demo exited: {left}\n{out[-3000:]}"
    with open("/proc/mounts") as f:
        assert tmp not in f.read(), out[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM: stopping what the demo started" in out
    work = re.search(r"starting a local cluster of \d+ shards in (\S+)/cluster", out)
    assert work is not None and not os.path.exists(work.group(1)), out[-2000:]
