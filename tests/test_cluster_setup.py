"""A cluster set up by hand, command by command, as on hosts of one's own: `irdma format URL`
makes the namespace and its key file (and refuses an existing one), `irdma server --meta` starts
a shard that registers itself and keeps its id across restarts (and refuses what it cannot
register), and a mount comes from an fstab line (type ``fuse.irdma``).

Real shard processes and a real FUSE mount; the metadata is SQLite here and PostgreSQL in
tests/test_hosts.py (the same commands across hosts).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import irdma_cli, wait_until

from irdma.meta import open_meta
from irdma.ops.cli import fstab_args
from irdma.ops.cluster import _free_port as free_port


def _free_port() -> int:
    return free_port("127.0.0.1")


class Shard:
    def __init__(self, url: str, key: str, data_dir: str, port: int, log: str) -> None:
        self.cmd = [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", f"127.0.0.1:{port}", "--meta", url,
                    "--data-dir", data_dir, "--capacity", "32MiB", "--transport", "tcp", "--key-file", key]
        self.address, self.log = f"127.0.0.1:{port}", log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)


@pytest.fixture
def namespace(tmp_path: object) -> Iterator[tuple[str, str, str]]:
    tmp = str(tmp_path)
    url, key = f"sqlite://{tmp}/meta.db", f"{tmp}/k/cluster.key"
    os.makedirs(f"{tmp}/k", mode=0o700)
    res = irdma_cli("format", url, "--key-file", key, "--replicas", "1")
    out = res.stdout + res.stderr
    assert "namespace sqlite://" in out and os.stat(key).st_mode & 0o777 == 0o600
    yield url, key, tmp


def _registered(url: str) -> list[tuple[int, str]]:
    meta = open_meta(url)
    try:
        return [(r.shard_id, r.address) for r in meta.shards() if r.state != "removed"]
    finally:
        meta.close()


def _answers(url: str, key: str, address: str) -> bool:
    res = irdma_cli("shard", "list", "--meta", url, "--key-file", key, check=False)
    return any(address in line and " down " not in line for line in res.stdout.splitlines())


def test_format_refuses_an_existing_namespace_and_a_postgres_url_without_a_key_file(namespace: tuple[str, str, str]) -> None:
    url, key, tmp = namespace
    res = irdma_cli("format", url, "--key-file", key, check=False)
    assert res.returncode == 1 and "already exists" in res.stderr
    env = {k: v for k, v in os.environ.items() if k != "IRDMA_KEY_FILE"}
    res = irdma_cli("format", "postgresql://irdma@127.0.0.1:1/none", check=False, env=env)
    assert res.returncode == 1 and "--key-file" in res.stderr and "Traceback" not in res.stderr


def test_a_shard_registers_itself_and_keeps_its_id_across_restarts(namespace: tuple[str, str, str]) -> None:
    url, key, tmp = namespace
    a = Shard(url, key, f"{tmp}/a", _free_port(), f"{tmp}/a.log")
    b = Shard(url, key, f"{tmp}/b", _free_port(), f"{tmp}/b.log")
    try:
        a.start()
        wait_until(lambda: _answers(url, key, a.address), 30, "shard a to register and answer", interval=0.2)
        b.start()
        wait_until(lambda: _answers(url, key, b.address), 30, "shard b to register and answer", interval=0.2)
        # polled from the moment they started: a shard listens before it registers, so no early
        # look at the shard map found it refusing (and marked it down, then catching up)
        rows = irdma_cli("shard", "list", "--meta", url, "--key-file", key).stdout.splitlines()
        for addr in (a.address, b.address):
            assert any(addr in r and " up " in r for r in rows), rows
        before = sorted(_registered(url))
        assert len(before) == 2 and {addr for _, addr in before} == {a.address, b.address}
        # a write, then SIGKILL and the same command again: same id, same bytes, no new shard
        mnt = f"{tmp}/m"
        os.makedirs(mnt)
        irdma_cli("mount", url, mnt, "--transport", "tcp", "--key-file", key)
        try:
            data = os.urandom(3 << 20)
            with open(f"{mnt}/w", "wb") as f:
                f.write(data)
            a.stop(signal.SIGKILL)
            a.start()
            wait_until(lambda: _answers(url, key, a.address), 30, "shard a to come back", interval=0.2)
            assert sorted(_registered(url)) == before
            with open(f"{mnt}/w", "rb") as f:
                assert f.read() == data
        finally:
            irdma_cli("umount", mnt)
        # a restart on a new, empty directory keeps the id registered at its address
        a.stop()
        shutil.rmtree(f"{tmp}/a")
        a.start()
        wait_until(lambda: _answers(url, key, a.address), 30, "shard a on an empty directory", interval=0.2)
        assert sorted(_registered(url)) == before
        status = irdma_cli("status", "--meta", url, "--key-file", key, check=False)
        assert status.returncode == 2, status.stdout  # its chunk is gone, and says so: never zeros
    finally:
        a.stop()
        b.stop()


def test_server_meta_refuses_what_it_cannot_register_and_changes_nothing(namespace: tuple[str, str, str]) -> None:
    url, key, tmp = namespace
    before = _registered(url)
    base = [sys.executable, "-m", "irdma.ops.cli", "server", "--meta", url, "--capacity", "32MiB", "--transport", "tcp",
            "--key-file", key]
    for listen, hint in (("127.0.0.1:0", "--advertise"), ("0.0.0.0:7799", "--advertise")):
        res = subprocess.run([*base, "--listen", listen], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and hint in res.stderr, res.stderr
    # a data directory of another namespace
    other = f"{tmp}/other"
    os.makedirs(other)
    other_url = f"sqlite://{other}/meta.db"
    irdma_cli("format", other_url, "--key-file", key, "--replicas", "1")
    s = Shard(other_url, key, f"{tmp}/d", _free_port(), f"{tmp}/d.log")
    s.start()
    try:
        wait_until(lambda: _answers(other_url, key, s.address), 30, "a shard of the other namespace", interval=0.2)
    finally:
        s.stop()
    res = subprocess.run([*base, "--listen", s.address, "--data-dir", f"{tmp}/d"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "does not have" in res.stderr and "--meta" in res.stderr, res.stderr
    assert _registered(url) == before


def test_fstab_options_become_mount_arguments() -> None:
    assert fstab_args(["postgresql://u@h:5432/db", "/mnt/ps", "-o",
                       "rw,_netdev,key_file=/etc/irdma/k,allow_other,timeout=3,transport=tcp"]) == [
        "mount", "postgresql://u@h:5432/db", "/mnt/ps", "--key-file", "/etc/irdma/k", "--allow-other",
        "--timeout", "3", "--transport", "tcp"]
    assert fstab_args(["status", "--meta", "x"]) is None
    assert fstab_args(["--help"]) is None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount.fuse3") is None, reason="mount(8) of fuse.irdma needs root")
def test_an_fstab_style_mount_through_mount_fuse3(namespace: tuple[str, str, str]) -> None:
    """`mount -t fuse.irdma URL MNT -o ...`, as an fstab line does: mount.fuse3 runs `irdma`."""
    url, key, tmp = namespace
    s = Shard(url, key, f"{tmp}/s", _free_port(), f"{tmp}/s.log")
    link = "/usr/local/bin/irdma"
    made = not os.path.lexists(link)
    if made:
        os.symlink(os.path.join(os.path.dirname(sys.executable), "irdma"), link)
    s.start()
    mnt = f"{tmp}/fstab"
    os.makedirs(mnt)
    try:
        wait_until(lambda: _answers(url, key, s.address), 30, "the shard", interval=0.2)
        res = subprocess.run(["mount", "-t", "fuse.irdma", url, mnt, "-o", f"_netdev,transport=tcp,key_file={key}"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        with open(f"{mnt}/f", "wb") as f:
            f.write(b"through fstab")
        with open(f"{mnt}/f", "rb") as f:
            assert f.read() == b"through fstab"
    finally:
        if os.path.ismount(mnt):
            irdma_cli("umount", mnt)
        s.stop()
        if made:
            os.unlink(link)
