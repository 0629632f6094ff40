"""The CLI's errors: one line, what to do next, a non-zero exit, never a traceback.

Every case runs the real ``irdma`` in a subprocess. The dead-mountpoint test SIGKILLs a real
mount process and recovers the mountpoint with ``irdma umount``.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import Cluster, assert_clean_log, irdma_cli, wait_until
from irdma.fs.mount import find_mount, spawn_mount, unmount

from irdma.meta import open_meta
from irdma.ops._proc import pid_alive
from irdma.ops.cli import cluster_health

# (arguments, exit code, what the line must tell the user to do). Placeholders: {meta} the running
# cluster's URL, {cdir} its directory, {busy} a running shard's address, {silent} a TCP port that
# accepts connections and never answers, {tmp} an empty directory, {junk} a file of random bytes.
BAD_INPUTS = [
    *[
        (cmd, 1, hint)
        for url, hint in (
            ("http://x", "sqlite:///PATH/meta.db"),
            ("foo://x", "sqlite:///PATH/meta.db"),
            ("sqlite://", "sqlite:///PATH/meta.db"),
            ("", "sqlite:///PATH/meta.db"),
            ("{tmp}", "sqlite:///PATH/meta.db"),
            ("{junk}", "sqlite:///PATH/meta.db"),
            ("sqlite://{tmp}/nothing.db", "irdma up"),
            ("{tmp}/nothing.db", "irdma up"),
        )
        for cmd in (["status", "--meta", url], ["mount", "--transport", "tcp", url, "{tmp}/mnt"])
    ],
    (["status", "--meta", "{cdir}"], 1, "meta.db"),
    (["shard", "add", "garbage", "--meta", "{meta}"], 2, "HOST:PORT"),
    (["shard", "add", ":99999", "--meta", "{meta}"], 2, "HOST:PORT"),
    (["shard", "add", "127.0.0.1:0", "--meta", "{meta}"], 2, "the port the shard listens on"),
    (["shard", "add", "127.0.0.1:1", "--meta", "{meta}"], 1, "--force"),
    (["shard", "add", "{silent}", "--timeout", "0.5", "--meta", "{meta}"], 1, "--force"),
    (["shard", "add", "{busy}", "--meta", "{meta}"], 1, "irdma shard list"),
    (["shard", "add", "127.0.0.1:1", "--meta", "http://x"], 1, "sqlite:///PATH/meta.db"),
    (["server", "--listen", "{busy}", "--capacity", "8MiB", "--transport", "tcp", "--no-auth"], 1, "pick another port"),
    (["server", "--listen", "192.0.2.1:7700", "--capacity", "8MiB", "--transport", "tcp", "--no-auth"], 1, "address of this machine"),
    (["server", "--listen", "nonsense", "--transport", "tcp"], 2, "HOST:PORT"),
    (["server", "--listen", "127.0.0.1:0", "--capacity", "1000TiB", "--transport", "tcp", "--no-auth"], 1, "smaller --capacity"),
    (["up", "--dir", "/proc/x", "--transport", "tcp"], 1, "pass --dir"),
    (["up", "--dir", "{junk}/x", "--transport", "tcp"], 1, "pass --dir"),
    (["up", "--dir", "{tmp}/c", "--capacity", "0", "--transport", "tcp"], 1, "--capacity 64MiB or more"),
    (["up", "--dir", "{tmp}/c", "--capacity", "lots", "--transport", "tcp"], 2, "2GiB"),
    (["up", "--dir", "{tmp}/c", "--shards", "0", "--transport", "tcp"], 1, "--shards 1 or more"),
    (["up", "--dir", "{tmp}/c", "--host", "192.0.2.1", "--transport", "tcp"], 1, "--host"),
    (["up", "--dir", "{tmp}/c", "--host", "", "--transport", "tcp"], 1, "--host"),
    (["down", "--dir", "{tmp}/c"], 1, "--dir"),
    (["mount", "{meta}", "{tmp}/missing"], 1, "mkdir -p"),
    (["umount", "{tmp}"], 1, "nothing to do"),
    (["umount", "/proc"], 1, "irdma leaves it alone"),
    (["nosuchcommand"], 2, "irdma --help"),
]


@pytest.fixture(scope="module")
def silent_address() -> Iterator[str]:
    """A TCP port whose connections the kernel accepts (the backlog) and no one ever answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"not one line:\n{out}"
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(("args", "code", "hint"), BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_input_is_one_line_that_says_what_to_do(
    args: list[str], code: int, hint: str, cluster: Cluster, silent_address: str, tmp_path: object
) -> None:
    junk = os.path.join(str(tmp_path), "junk.db")
    with open(junk, "wb") as f:
        f.write(os.urandom(4096))
    os.mkdir(os.path.join(str(tmp_path), "mnt"))
    fill = {"meta": cluster.meta_url, "cdir": cluster.dir, "busy": cluster.shards[0].address,
            "silent": silent_address, "tmp": str(tmp_path), "junk": junk}
    epoch = _epoch(cluster)
    res = irdma_cli(*(a.format(**fill) for a in args), check=False)
    line = _one_error_line(res)
    assert res.returncode == code, line
    assert hint in line, line
    assert re.search(r"\(.+\)$", line), f"no (what to do) at the end: {line}"
    # and nothing changed
    assert not os.path.exists(os.path.join(str(tmp_path), "c"))
    assert _epoch(cluster) == epoch
    with open(junk, "rb") as f:
        assert len(f.read()) == 4096


def _epoch(cluster: Cluster) -> int:
    meta = open_meta(cluster.meta_url)
    try:
        return meta.epoch()
    finally:
        meta.close()


def test_a_bug_is_one_line_without_v_and_a_traceback_with_it() -> None:
    code = "import irdma.ops.cli as c; c._cluster.down = lambda *a, **k: 1 / 0; c.main(sys.argv[1:])"
    run = [sys.executable, "-c", f"import sys; {code}"]
    res = subprocess.run([*run, "down", "--dir", "x"], capture_output=True, text=True, timeout=60)
    line = _one_error_line(res)
    assert res.returncode == 1 and "ZeroDivisionError" in line and "rerun with -v" in line
    res = subprocess.run([*run, "-v", "down", "--dir", "x"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "Traceback" in res.stderr and "see the traceback above" in res.stderr


def test_status_exits_0_when_healthy_and_1_when_a_shard_is_down(cluster: Cluster, tmp_path: object) -> None:
    res = irdma_cli("status", "--meta", cluster.meta_url, check=False)
    assert res.returncode == 0 and "healthy" in res.stdout, res.stdout + res.stderr
    url = f"sqlite://{tmp_path}/meta.db"
    open_meta(url, create=True).close()
    res = irdma_cli("status", "--meta", url, check=False)
    assert res.returncode == 1 and "degraded" in res.stdout and "irdma shard add" in res.stderr
    # a shard that does not answer is refused, and registered only when forced
    res = irdma_cli("shard", "add", "127.0.0.1:1", "--meta", url, check=False)
    assert res.returncode == 1 and "--force" in res.stderr
    irdma_cli("shard", "add", "127.0.0.1:1", "--force", "--meta", url)
    res = irdma_cli("status", "--meta", url, check=False)
    assert res.returncode == 1 and "degraded" in res.stdout and "0 of 1" in res.stdout, res.stdout
    assert "Traceback" not in res.stdout + res.stderr


def test_cluster_health_decides_the_exit_code_of_status() -> None:
    from irdma.meta import ShardRecord

    up, down = object(), None
    ok, syncing = ShardRecord(1, "a:1", "up", 0, health="up"), ShardRecord(2, "a:2", "up", 0, health="syncing")
    assert cluster_health([]).exit_code == 1
    assert cluster_health([(ok, up, ""), (ok, down, "refused")]).exit_code == 1
    assert cluster_health([(ok, up, ""), (ok, up, "")]).exit_code == 0
    # a shard catching up, or chunks short of replicas: degraded until the resync is done
    assert cluster_health([(ok, up, ""), (syncing, up, "")]).exit_code == 1
    assert cluster_health([(ok, up, ""), (ok, up, "")], [], under_replicated=3).exit_code == 1


def test_find_mount_reads_the_mount_table_with_its_escapes(tmp_path: object) -> None:
    table = os.path.join(str(tmp_path), "mountinfo")
    with open(table, "w") as f:
        f.write("22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
                "90 22 0:55 / /tmp/a\\040b rw,nosuid shared:7 - fuse.irdma irdma rw,user_id=0\n")
    entry = find_mount("/tmp/a b", mountinfo=table)
    assert entry is not None and entry.is_irdma and entry.device == "0:55" and entry.source == "irdma"
    proc = find_mount("/proc", mountinfo=table)
    assert proc is not None and not proc.is_fuse
    assert find_mount("/tmp/a", mountinfo=table) is None


@pytest.mark.fuse
def test_a_dead_mountpoint_is_refused_then_cleaned_then_mounted_again(cluster: Cluster, tmp_path: object) -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    mnt = os.path.join(str(tmp_path), "m")
    os.mkdir(mnt)
    log1, log2 = (os.path.join(str(tmp_path), f"mount-{i}.log") for i in (1, 2))
    pid = spawn_mount(cluster.meta_url, mnt, transport="tcp", log_file=log1)
    try:
        data = os.urandom(100_000)
        with open(os.path.join(mnt, "before"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, "the mount process to die")
        with pytest.raises(OSError) as dead:
            os.stat(mnt)
        assert dead.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), dead.value

        res = irdma_cli("mount", cluster.meta_url, mnt, "--transport", "tcp", "--log-file", log2, check=False)
        line = _one_error_line(res)
        assert res.returncode == 1 and "dead irdma mount" in line and f"irdma umount {mnt}" in line, line

        res = irdma_cli("umount", mnt)
        assert "cleaned the dead mount" in res.stderr, res.stderr
        assert find_mount(mnt) is None and os.path.isdir(mnt)

        irdma_cli("mount", cluster.meta_url, mnt, "--transport", "tcp", "--log-file", log2)
        with open(os.path.join(mnt, "before"), "rb") as f:
            assert f.read() == data
        with open(os.path.join(mnt, "after"), "wb") as f:
            f.write(b"served again")
        with open(os.path.join(mnt, "after"), "rb") as f:
            assert f.read() == b"served again"
        res = irdma_cli("umount", mnt)
        assert "unmounted" in res.stderr and find_mount(mnt) is None
        assert_clean_log(log2)
    finally:
        if find_mount(mnt) is not None:
            unmount(mnt)
