"""irdma across hosts: PostgreSQL metadata on host 0, shards on hosts 1-3, a mount on each of
hosts 4 and 5 (the test bed of :mod:`irdma.ops.testbed`: network namespaces on a bridge, links
shaped to 1 Gbit/s). Every process runs on its host with ``nsenter --net``; the test reads and
writes through both mounts, as two workers on two machines would.

POSIX semantics seen from two hosts (close-to-open, atomic rename, O_EXCL, links, xattrs,
permissions, RENAME_EXCHANGE), and faults of one host (a SIGKILLed shard process restarted by
the same command, a host cut off the network) during pushes from both worker hosts.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from helpers import assert_clean_log, wait_until
from test_replication import ADDER, _progress

from irdma.ops.testbed import PostgresServer, TestBed

MB = 1 << 20
IRDMA = [sys.executable, "-m", "irdma.ops.cli"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the multi-host test bed needs root (network namespaces)")


@dataclass
class Hosts:
    bed: TestBed
    pg: PostgresServer
    url: str
    key: str
    work: str
    mounts: list[str]
    shard_cmds: dict[int, list[str]] = field(default_factory=dict)  # host index -> its `irdma server` command
    shard_procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def cli(self, host: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = self.bed.run(host, [*IRDMA, *args], capture_output=True, text=True, timeout=120)
        if check and res.returncode != 0:
            raise AssertionError(f"irdma {' '.join(args)} on host {host} failed ({res.returncode}):\n"
                                 f"{res.stdout}\n{res.stderr}")
        return res

    def start_shard(self, host: int) -> None:
        with open(os.path.join(self.work, f"shard-{host}.log"), "a") as log:
            self.shard_procs[host] = self.bed.popen(host, self.shard_cmds[host], stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        return self.cli(4, "status", "--meta", self.url, check=False).returncode == 0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    work = str(tmp_path_factory.mktemp("hosts"))
    os.chmod(work, 0o755)
    with TestBed(6, rate="1gbit") as bed, \
            PostgresServer(listen=bed.hosts[0].address, port=5432, prefix=bed.hosts[0].nsenter) as pg:
        old_env = {k: os.environ.get(k) for k in ("PGPASSFILE", "IRDMA_KEY_FILE")}
        key = os.path.join(work, "cluster.key")
        os.environ["PGPASSFILE"], os.environ["IRDMA_KEY_FILE"] = pg.passfile, key
        try:
            h = Hosts(bed, pg, pg.url, key, work, [])
            h.cli(1, "format", pg.url, "--replicas", "2")
            for i in (1, 2, 3):
                addr = bed.hosts[i].address
                h.shard_cmds[i] = [*IRDMA, "server", "--listen", f"{addr}:7700", "--meta", pg.url, "--transport",
                                   "tcp", "--data-dir", os.path.join(work, f"shard-{i}"), "--capacity", "128MiB",
                                   "--key-file", key]
                h.start_shard(i)
            wait_until(lambda: sum(" up " in r for r in h.cli(4, "shard", "list", "--meta", pg.url,
                                                              check=False).stdout.splitlines()) == 3,
                       60, "three shards to register and answer", interval=0.3)
            for i in (4, 5):
                mnt = os.path.join(work, f"mnt-{i}")
                os.makedirs(mnt)
                bed.track_mount(mnt)
                h.cli(i, "mount", pg.url, mnt, "--transport", "tcp", "--timeout", "3", "--log-file",
                      mnt + ".log")
                h.mounts.append(mnt)
            yield h
            for i, mnt in zip((4, 5), h.mounts, strict=True):
                h.cli(i, "umount", mnt)
                assert_clean_log(mnt + ".log", allow=("shard", "EIO", "unavailable", "connection"))
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- POSIX across hosts
def test_shard_list_shows_the_three_shard_hosts(hosts: Hosts) -> None:
    out = hosts.cli(5, "shard", "list", "--meta", hosts.url).stdout
    for i in (1, 2, 3):
        assert f"{hosts.bed.hosts[i].address}:7700" in out


def test_close_to_open_across_hosts(hosts: Hosts) -> None:
    a, b = hosts.mounts
    data = np.random.default_rng(1).integers(0, 255, 9 * MB + 123, dtype=np.uint8).tobytes()
    _write(os.path.join(a, "c2o"), data)
    assert hashlib.sha256(_read(os.path.join(b, "c2o"))).digest() == hashlib.sha256(data).digest()
    _write(os.path.join(b, "c2o"), data[::-1])
    assert _read(os.path.join(a, "c2o")) == data[::-1]  # direct I/O size check below covers the attr cache
    assert os.stat(os.path.join(a, "c2o")).st_size == len(data)


def test_a_rename_over_is_atomic_for_a_reader_on_the_other_host(hosts: Hosts) -> None:
    a, b = hosts.mounts
    versions = [bytes([v]) * (256 * 1024) for v in range(1, 31)]
    _write(os.path.join(a, "model"), versions[0])
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = _read(os.path.join(b, "model"))
            except OSError as exc:
                bad.append(f"{exc.errno} {exc}")
                continue
            if len(got) != len(versions[0]) or len(set(got)) != 1:
                bad.append(f"mixed or short read: {len(got)} bytes, {len(set(got))} distinct values")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for v in versions[1:]:
            _write(os.path.join(a, "model.tmp"), v)
            os.rename(os.path.join(a, "model.tmp"), os.path.join(a, "model"))
    finally:
        stop.set()
        t.join()
    assert not bad, bad[:5]
    wait_until(lambda: _read(os.path.join(b, "model")) == versions[-1], 10, "the last version on host 5")


def test_o_excl_from_both_hosts_lets_exactly_one_win(hosts: Hosts) -> None:
    """50 rounds of two processes, one per host, racing O_CREAT|O_EXCL on one name."""
    a, b = hosts.mounts
    os.makedirs(os.path.join(a, "excl"))
    script = ("import os,sys\nwins=0\nfor i in range(50):\n"
              "  p=os.path.join(sys.argv[1],f'n{i}')\n"
              "  try:\n    os.close(os.open(p,os.O_CREAT|os.O_EXCL|os.O_WRONLY))\n    wins+=1\n"
              "  except FileExistsError: pass\nprint(wins)")
    procs = [hosts.bed.popen(i, [sys.executable, "-c", script, os.path.join(m, "excl")], stdout=subprocess.PIPE)
             for i, m in zip((4, 5), (a, b), strict=True)]
    wins = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert sum(wins) == 50, wins
    assert len(os.listdir(os.path.join(b, "excl"))) == 50


def test_links_xattrs_modes_and_exchange_are_seen_from_the_other_host(hosts: Hosts) -> None:
    a, b = hosts.mounts
    d_a, d_b = os.path.join(a, "meta"), os.path.join(b, "meta")
    os.makedirs(d_a)
    _write(os.path.join(d_a, "f"), b"first")
    _write(os.path.join(d_a, "g"), b"second")
    os.link(os.path.join(d_a, "f"), os.path.join(d_a, "f2"))
    os.symlink("f", os.path.join(d_a, "sym"))
    os.chmod(os.path.join(d_a, "g"), 0o600)
    os.setxattr(os.path.join(d_a, "f"), "user.note", b"hello")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(-100, os.path.join(d_a, "f").encode(), -100, os.path.join(d_a, "g").encode(), 2)
    assert rc == 0, os.strerror(ctypes.get_errno())  # RENAME_EXCHANGE

    def seen() -> bool:
        st_f2 = os.stat(os.path.join(d_b, "f2"))
        return (st_f2.st_nlink == 2 and _read(os.path.join(d_b, "g")) == b"first"
                and _read(os.path.join(d_b, "f")) == b"second" and os.stat(os.path.join(d_b, "f")).st_mode & 0o777 == 0o600
                and os.readlink(os.path.join(d_b, "sym")) == "f" and os.getxattr(os.path.join(d_b, "g"), "user.note") == b"hello")
    wait_until(seen, 10, "host 5 to see host 4's changes (attributes are cached for 1 s)", interval=0.2)
    os.unlink(os.path.join(d_b, "f2"))
    with pytest.raises(OSError) as exc:
        os.rmdir(d_a)
    assert exc.value.errno == errno.ENOTEMPTY


def test_an_open_file_removed_on_the_other_host_keeps_its_bytes(hosts: Hosts) -> None:
    a, b = hosts.mounts
    data = os.urandom(3 * MB)
    _write(os.path.join(a, "held"), data)
    with open(os.path.join(b, "held"), "rb") as f:
        os.unlink(os.path.join(a, "held"))
        assert f.read() == data
    wait_until(lambda: not os.path.exists(os.path.join(b, "held")), 10, "the name to go on host 5")


# ---------------------------------------------------------------- faults of one host
def _start_adders(hosts: Hosts, path_rel: str, count: int, n: int, progress: list[str]) -> list[subprocess.Popen[bytes]]:
    return [hosts.bed.popen(i, [sys.executable, "-c", ADDER, os.path.join(m, path_rel), str(k + 1), str(count),
                                progress[k], str(n)], stderr=subprocess.PIPE)
            for k, (i, m) in enumerate([(4, hosts.mounts[0]), (5, hosts.mounts[1])])]


def _add_file(hosts: Hosts, name: str, n: int) -> str:
    a = hosts.mounts[0]
    os.makedirs(os.path.join(a, name))
    os.setxattr(os.path.join(a, name), "user.irdma.chunk_size", b"262144")
    path = os.path.join(a, name, "sum")
    _write(path, bytes(4 * n))
    os.setxattr(path, "user.irdma.update", b"add")
    return os.path.join(name, "sum")


def _finish(adders: list[subprocess.Popen[bytes]]) -> None:
    try:
        for p in adders:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in adders:
            if p.poll() is None:
                p.kill()


def test_adds_from_two_hosts_stay_exact_through_a_killed_and_restarted_shard_host(hosts: Hosts) -> None:
    count, n = 120, 128 * 1024  # 512 KiB per add over two chunks
    rel = _add_file(hosts, "kill", n)
    progress = [os.path.join(hosts.work, f"kill-progress-{k}") for k in range(2)]
    adders = _start_adders(hosts, rel, count, n, progress)
    try:
        wait_until(lambda: _progress(progress) >= 30, 120, "the adders on both hosts to get going")
        victim = hosts.shard_procs[2]
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        wait_until(lambda: _progress(progress) >= 70, 120, "the adders to go on without shard host 2")
        hosts.start_shard(2)  # the same command: it keeps its id and data, and catches up
    finally:
        _finish(adders)
    expected = np.full(n, float(1 + 2) * count, dtype="<f4")
    for m in hosts.mounts:
        np.testing.assert_array_equal(np.frombuffer(_read(os.path.join(m, rel)), dtype="<f4"), expected)
    wait_until(hosts.healthy, 90, "irdma status healthy after the restarted shard caught up", interval=1.0)


def test_a_shard_host_cut_off_the_network_costs_no_error_and_catches_up(hosts: Hosts) -> None:
    count, n = 100, 128 * 1024
    rel = _add_file(hosts, "cut", n)
    big = os.urandom(16 * MB)
    _write(os.path.join(hosts.mounts[0], "cut", "big"), big)
    progress = [os.path.join(hosts.work, f"cut-progress-{k}") for k in range(2)]
    ns = hosts.bed.hosts[3].netns
    adders = _start_adders(hosts, rel, count, n, progress)
    try:
        wait_until(lambda: _progress(progress) >= 20, 120, "the adders to get going")
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
        t0 = time.monotonic()
        assert _read(os.path.join(hosts.mounts[1], "cut", "big")) == big  # served by the other replicas
        assert time.monotonic() - t0 < 30
        wait_until(lambda: _progress(progress) >= 60, 120, "the adders to go on without shard host 3")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        _finish(adders)
    expected = np.full(n, 3.0 * count, dtype="<f4")
    np.testing.assert_array_equal(np.frombuffer(_read(os.path.join(hosts.mounts[1], rel)), dtype="<f4"), expected)
    wait_until(hosts.healthy, 120, "irdma status healthy once shard host 3 is back and resynced", interval=1.0)


# ---------------------------------------------------------------- training across hosts
HOST_WORKER = """
import subprocess, keras, numpy as np
import irdma.keras as hvd
hvd.init()
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout.split()[3]
print(f"rank {hvd.rank()} of {hvd.size()}, local rank {hvd.local_rank()}, on {addr}", flush=True)
keras.utils.set_random_seed(hvd.rank())
rng = np.random.default_rng(1)
x = rng.standard_normal((512, 6)).astype("float32")
y = (x[:, 0] + x[:, 3] > 0).astype("int64")
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), overlap="p3"),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
xs, ys = hvd.shard_dataset((x, y))
model.fit(xs, ys, batch_size=32, epochs=4, verbose=0, callbacks=[hvd.BroadcastInitialWeights(0)])
hvd.barrier("trained")
model.optimizer.pull_weights()
print(f"accuracy {model.evaluate(x, y, verbose=0)[1]:.3f}", flush=True)
hvd.shutdown()
"""


def test_irdma_run_starts_workers_on_other_hosts_through_the_same_launcher(hosts: Hosts) -> None:
    """``irdma run --hosts`` from host 4: rank 0 on host 4, rank 1 on host 5 (``--rsh netns``:
    the code path ``ssh`` takes, with nsenter as the remote shell), one BSP job on the
    PostgreSQL namespace; both train and agree."""
    ns4, ns5 = hosts.bed.hosts[4].netns, hosts.bed.hosts[5].netns
    res = hosts.bed.run(4, [*IRDMA, "run", "--meta", hosts.url, "--hosts", f"{ns4}:1,{ns5}:1", "--rsh", "netns",
                            "-n", "2", "--consistency", "bsp", "--job", "across", "--", sys.executable, "-c",
                            HOST_WORKER], capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for rank, host in ((0, 4), (1, 5)):
        assert f"[{rank}] rank {rank} of 2, local rank 0, on {hosts.bed.hosts[host].address}/" in out, out[-3000:]
    accuracy = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("[0] accuracy")]
    assert accuracy and accuracy[0] > 0.9, out[-3000:]
    bad = subprocess.run([*IRDMA, "run", "-n", "2", "--hosts", "nowhere:2", "--", "true"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--meta postgresql://" in bad.stderr, bad.stderr
