"""Live shard operations: add, drain and remove shards while training pushes go on.

Real shard processes (one started by hand and added), real mounts, adders in other processes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import trio
from helpers import irdma_cli, mounted, running_cluster, wait_until
from test_replication import ADDER, _chains, _chunk_on, _progress

import irdma
from irdma.ops import cluster as _cluster
from irdma.ops.cluster import key_file_of
from irdma.wire.auth import read_key_file

MB = 1 << 20


def _start_shard(tmp: str, key_file: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = os.path.join(tmp, "port-new")
    with open(os.path.join(tmp, "shard-new.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity",
                                 "128MiB", "--port-file", port_file, "--transport", "tcp", "--key-file", key_file,
                                 "--data-dir", os.path.join(tmp, "shard-new")],
                                stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: os.path.exists(port_file) or proc.poll() is not None, 30, "the new shard to listen")
    assert proc.poll() is None, "the new shard exited"
    with open(port_file) as f:
        return proc, f.read().strip()


@pytest.mark.fuse
def _used(meta_url: str, states: tuple[str, ...] = ("up",)) -> dict[int, int]:
    """Bytes each shard in these states holds, as its STAT says."""
    with irdma.connect(meta_url) as client:
        stats = client._run(client.client.shard_stats)
    return {rec.shard_id: st.used for rec, st, _ in stats if rec.state in states and st is not None}


@pytest.mark.long  # 24 s: make test-long (CI's time)
def test_add_rebalance_drain_and_remove_shards_under_load(tmp_path: object) -> None:
    """4 shards, 2 replicas; 4 processes on 2 mounts add a known vector 200 times to one file
    while a fifth shard is added, the cluster rebalanced (every shard then holds the mean
    within 40%, the new one included), a shard holding the file drained and removed and its
    process stopped: no process sees an error, the sum is exact on every replica, a 16 MiB
    file written before reads bit-exact throughout, the drained shard holds nothing, and
    `irdma status` is healthy after each step."""
    tmp = str(tmp_path)
    count, n = 200, 256 * 1024  # 1 MiB of float32 per add, over two 512 KiB chunks
    new: subprocess.Popen[bytes] | None = None
    try:
        with running_cluster(os.path.join(tmp, "c"), shards=4, replicas=2, capacity=128 * MB) as c, \
                mounted(c.meta_url, os.path.join(tmp, "m1"), timeout=4.0) as m1, \
                mounted(c.meta_url, os.path.join(tmp, "m2"), timeout=4.0) as m2:
            big = np.random.default_rng(5).integers(0, 255, 16 * MB, dtype=np.uint8).tobytes()
            os.setxattr(m1, "user.irdma.chunk_size", b"262144")  # 128 chunk replicas: enough to even out
            with open(os.path.join(m1, "big"), "wb") as f:
                f.write(big)
            digest = hashlib.sha256(big).hexdigest()
            os.makedirs(os.path.join(m1, "g"))
            os.setxattr(os.path.join(m1, "g"), "user.irdma.chunk_size", b"524288")
            path = os.path.join(m1, "g", "sum")
            with open(path, "wb") as f:
                f.write(bytes(4 * n))
            os.setxattr(path, "user.irdma.update", b"add")
            progress = [os.path.join(tmp, f"progress-{k}") for k in range(4)]
            gate = os.path.join(tmp, "gate")  # the adders wait there at 3/4 until the shard is removed
            adders = [subprocess.Popen([sys.executable, "-c", ADDER, os.path.join(m, "g", "sum"), str(k + 1), str(count),
                                        progress[k], str(n), gate], stderr=subprocess.PIPE)
                      for k, m in enumerate([m1, m1, m2, m2])]
            reads: list[bool] = []
            stop = threading.Event()

            def reader() -> None:  # pulls from the shards (no page cache) until the end
                with irdma.connect(c.meta_url) as client:
                    while not stop.is_set():
                        reads.append(hashlib.sha256(client.read("/big")).hexdigest() == digest)

            t = threading.Thread(target=reader)
            t.start()
            try:
                new, address = _start_shard(tmp, key_file_of(c.dir))
                wait_until(lambda: _progress(progress) >= 20, 120, "the adders to get going")
                irdma_cli("shard", "add", address, "--meta", c.meta_url)
                assert _used(c.meta_url)[5] == 0
                irdma_cli("rebalance", "--meta", c.meta_url)
                used = _used(c.meta_url)
                mean = sum(used.values()) / len(used)
                assert len(used) == 5 and all(0.6 * mean <= u <= 1.4 * mean for u in used.values()), used
                assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 0
                _, chains, _ = _chains(c.meta_url, "/g/sum", 2)
                victim = chains[0][0]  # the head of the first chunk's chain
                drained = irdma_cli("shard", "drain", str(victim), "--meta", c.meta_url)
                assert f"shard {victim} is drained" in drained.stdout + drained.stderr
                assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 0
                assert _used(c.meta_url, ("drained",)) == {victim: 0}  # it holds nothing
                irdma_cli("shard", "remove", str(victim), "--meta", c.meta_url)
                proc = next(s for s in c.shards if s.shard_id == victim)
                os.kill(proc.pid, signal.SIGTERM)  # its machine goes away: nothing may need it now
                open(gate, "w").close()
                for a in adders:
                    _, err = a.communicate(timeout=240)
                    assert a.returncode == 0, err.decode()[-2000:]
            finally:
                stop.set()
                t.join()
                for a in adders:
                    if a.poll() is None:
                        a.kill()
                        a.wait(10)
            assert reads and all(reads), f"{reads.count(False)} of {len(reads)} reads of the big file differed"
            expected = np.full(n, float(sum(range(1, 5)) * count), dtype="<f4")
            with open(os.path.join(m2, "g", "sum"), "rb") as f:
                np.testing.assert_array_equal(np.frombuffer(f.read(), dtype="<f4"), expected)
            ino, chains, addresses = _chains(c.meta_url, "/g/sum", 2)
            key = read_key_file(key_file_of(c.dir))
            half = n // 2
            for idx, chain in enumerate(chains):
                assert victim not in chain and len(chain) == 2, f"chunk {idx} on {chain}"
                copies = [trio.run(_chunk_on, addresses[s], ino, idx, half, key) for s in chain]
                for _, buf in copies:
                    np.testing.assert_array_equal(buf, expected[:half])
                assert len({v for v, _ in copies}) == 1, f"chunk {idx}: replica versions {[v for v, _ in copies]}"
            with open(os.path.join(m1, "big"), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == digest
            listing = irdma_cli("shard", "list", "--meta", c.meta_url).stdout
            assert "removed" in listing
            st = irdma_cli("status", "--meta", c.meta_url, check=False)
            assert st.returncode == 0, st.stdout + st.stderr
    finally:
        if new is not None:
            new.terminate()
            new.wait(10)


def test_remove_refuses_a_shard_that_was_not_drained_and_force_declares_its_chunks_lost(tmp_path: object) -> None:
    """One replica: removing a shard that holds chunks is refused and changes nothing; with
    --force the chunks only it held read as EIO (never zeros) and `irdma status` exits 2."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1) as c:
        data = os.urandom(3 * MB)
        with irdma.connect(c.meta_url) as client:
            client.write("/f", data, chunk_size=1 * MB)
        _, chains, _ = _chains(c.meta_url, "/f", 3)
        victim = chains[0][0]
        res = irdma_cli("shard", "remove", str(victim), "--meta", c.meta_url, check=False)
        assert res.returncode != 0 and "drain it first" in res.stderr + res.stdout
        with irdma.connect(c.meta_url) as client:
            assert bytes(client.read("/f")) == data  # nothing changed
        res = irdma_cli("shard", "remove", str(victim), "--force", "--meta", c.meta_url)
        assert "2 chunks it alone held are lost" in res.stdout + res.stderr
        with irdma.connect(c.meta_url) as client:
            with pytest.raises(irdma.DataLost):
                client.read("/f")
            for i, chain in enumerate(chains):
                if victim not in chain:
                    mb = 1 * MB
                    assert bytes(client.read("/f", i * mb, mb)) == data[i * mb:(i + 1) * mb]
        assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 2
        # the cluster stops and starts again without the removed shard
        _cluster.down(c.dir)
        _cluster.up(c.dir, 2, 64 * MB)
        c.shards = _cluster.read_state(c.dir)
        assert [s.shard_id for s in c.shards] == [s for s in (1, 2) if s != victim]
        with irdma.connect(c.meta_url) as client:
            with pytest.raises(irdma.DataLost):
                client.read("/f")


def test_drain_refuses_the_last_shard_in_service_and_changes_nothing(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1) as c:
        irdma_cli("shard", "drain", "1", "--meta", c.meta_url)
        res = irdma_cli("shard", "drain", "2", "--meta", c.meta_url, check=False)
        assert res.returncode != 0 and "nowhere to go" in res.stderr + res.stdout
        res = irdma_cli("shard", "drain", "9", "--meta", c.meta_url, check=False)
        assert res.returncode != 0 and "not in the shard map" in res.stderr + res.stdout
        with irdma.connect(c.meta_url) as client:
            client.write("/after", b"x" * 5000)  # new files go to the shard in service only
            assert bytes(client.read("/after")) == b"x" * 5000
            assert client.stat("/after").stripe == (2,)


def test_a_drain_that_cannot_finish_is_cancelled_and_changes_nothing(tmp_path: object) -> None:
    """2 shards, 2 replicas: every chunk is on both, so a drain has nowhere to move them; it
    says so, the shard is back in service and the cluster healthy, the file intact."""
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=2) as c:
        data = os.urandom(2 * MB)
        with irdma.connect(c.meta_url) as client:
            client.write("/f", data, chunk_size=MB)
        res = irdma_cli("shard", "drain", "1", "--meta", c.meta_url, check=False)
        assert res.returncode != 0 and "drain was cancelled" in res.stdout + res.stderr
        assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 0
        assert "draining" not in irdma_cli("shard", "list", "--meta", c.meta_url).stdout
        with irdma.connect(c.meta_url) as client:
            assert bytes(client.read("/f")) == data
            client.write("/f", data[::-1])
            assert bytes(client.read("/f")) == data[::-1]


def test_rebalance_of_a_lightly_filled_cluster_leaves_new_files_even(tmp_path: object) -> None:
    """4 shards, 2 replicas, one 1-chunk file; shard 5 added, `irdma rebalance` moves shares of
    the two shards holding it. Five 10-chunk files created afterwards spread evenly over the five
    shards (20 chunk replicas each, the old file's 2 on top): the moves apply to the chunks that
    existed when they were recorded, never to later files (issue 20, point 6)."""
    tmp = str(tmp_path)
    new: subprocess.Popen[bytes] | None = None
    try:
        with running_cluster(os.path.join(tmp, "c"), shards=4, replicas=2, capacity=64 * MB) as c:
            with irdma.connect(c.meta_url, transport="tcp") as client:
                client.write("/old", os.urandom(MB), chunk_size=MB)
            new, address = _start_shard(tmp, key_file_of(c.dir))
            irdma_cli("shard", "add", address, "--meta", c.meta_url)
            res = irdma_cli("rebalance", "--meta", c.meta_url)
            assert "moved" in res.stdout + res.stderr, res.stdout + res.stderr
            data = {f"/new{k}": os.urandom(10 * MB) for k in range(5)}
            with irdma.connect(c.meta_url, transport="tcp") as client:
                for path, b in data.items():
                    client.write(path, b, chunk_size=MB)
                stats = client._run(client.client.shard_stats)
                counts = {rec.shard_id: st.chunks for rec, st, _ in stats}
                for path, b in data.items():
                    assert bytes(client.read(path)) == b
            assert sorted(counts) == [1, 2, 3, 4, 5] and sum(counts.values()) == 102, counts
            assert all(20 <= n <= 22 for n in counts.values()), counts
            assert irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 0
    finally:
        if new is not None:
            new.terminate()
            new.wait(10)
