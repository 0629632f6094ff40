"""The client against real shard processes: striping, concurrent pushes from several client
processes, ENOSPC, and malformed requests that must not disturb anyone else."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import Cluster, RawShard, irdma_cli, running_cluster, wait_until

import irdma
from irdma.ops.cluster import key_file_of
from irdma.wire import protocol as P
from irdma.wire.auth import read_key_file


def test_a_large_file_is_striped_over_every_shard(cluster: Cluster) -> None:
    with irdma.connect(cluster.meta_url, transport="tcp") as c:
        before = {rec.shard_id: st.chunks for rec, st, _ in c.shard_stats()}
        data = os.urandom(9 * (1 << 20) + 123)
        c.write("/striped.bin", data, chunk_size=1 << 20)
        after = {rec.shard_id: st.chunks for rec, st, _ in c.shard_stats()}
        grown = {k: after[k] - before[k] for k in after}
        assert all(v >= 4 for v in grown.values()), grown  # 10 chunks over 2 shards
        assert c.read("/striped.bin") == data
        assert c.read("/striped.bin", 5_000_000, 10) == data[5_000_000:5_000_010]
        assert c.stat("/striped.bin").size == len(data)
        c.unlink("/striped.bin")
        assert {rec.shard_id: st.chunks for rec, st, _ in c.shard_stats()} == before


ADDER = """
import sys, numpy as np, irdma
url, path, k, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with irdma.connect(url, transport="tcp") as c:
    for _ in range(rounds):
        c.push(path, np.full(300_000, k, dtype="<f4"))
"""


def test_concurrent_add_from_several_client_processes_sums_exactly(cluster: Cluster) -> None:
    n = 300_000  # 1.2 MB: two chunks of 1 MiB, one on each shard
    with irdma.connect(cluster.meta_url, transport="tcp") as c:
        c.write("/sum.f32", np.zeros(n, "<f4"), chunk_size=1 << 20)
        procs = [
            subprocess.Popen([sys.executable, "-c", ADDER, cluster.meta_url, "/sum.f32", str(k), "20"])
            for k in (1, 2, 3, 4)
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
        np.testing.assert_array_equal(c.pull("/sum.f32"), np.full(n, 20 * (1 + 2 + 3 + 4), "<f4"))


def test_enospc_when_full_changes_nothing(tmp_path: object) -> None:
    with running_cluster(str(tmp_path), shards=2, replicas=1, capacity=2 << 20) as small:
        with irdma.connect(small.meta_url, transport="tcp") as c:
            mb = 1 << 20  # files of a whole chunk each: two fill a shard
            c.write("/a", b"a" * mb, chunk_size=mb)
            c.write("/b", b"b" * mb, chunk_size=mb)
            c.write("/c", b"c" * mb, chunk_size=mb)
            c.write("/d", b"d" * mb, chunk_size=mb)
            with pytest.raises(irdma.NoSpace) as full:
                c.write("/e", b"e" * 100, chunk_size=mb)
            assert str(full.value).count(irdma.NoSpace.hint) == 1, str(full.value)  # the advice, once
            assert c.stat("/e").size == 0  # the failed write did not grow the file
            assert c.read("/a") == b"a" * mb and c.read("/d") == b"d" * mb
            c.unlink("/a")
            c.write("/e", b"e" * 100)  # space came back
            assert c.read("/e") == b"e" * 100


def _raw(address: str, key_file: str) -> RawShard:
    """An authenticated raw connection (the cluster's key): tests put their own frames on it."""
    return RawShard(address, read_key_file(key_file))


def test_malformed_requests_get_error_replies_and_disturb_no_one(cluster: Cluster) -> None:
    address = cluster.shards[0].address
    stop = threading.Event()
    errors: list[BaseException] = []
    pushes = [0]

    def steady_client() -> None:  # a well-behaved client pushing all along
        try:
            with irdma.connect(cluster.meta_url, transport="tcp") as c:
                c.write("/steady.f32", np.zeros(1024, "<f4"))
                while not stop.is_set() and pushes[0] < 100_000:
                    c.push("/steady.f32", np.ones(1024, "<f4"))
                    pushes[0] += 1
                np.testing.assert_array_equal(c.pull("/steady.f32"), np.full(1024, pushes[0], "<f4"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=steady_client)
    t.start()
    try:
        wait_until(lambda: pushes[0] > 10 or bool(errors), 30, "the steady client to start pushing")
        s = _raw(address, key_file_of(cluster.dir))
        # unknown opcode: error reply, connection stays usable
        s.send(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, 99, 1, 0, 0, 4) + b"junk")
        r = s.reply()
        assert isinstance(r, P.ErrorReply) and r.status == P.Status.UNKNOWN_OPCODE
        # short body for READ: error reply
        s.send(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Opcode.READ, 2, 0, 0, 3) + b"abc")
        r = s.reply()
        assert isinstance(r, P.ErrorReply) and r.status == P.Status.BAD_REQUEST
        # an add that is not float32-aligned, then a read showing nothing changed
        s.send(b"".join(P.encode_request(P.Write(77, 0, 4096, 1, P.UpdateOp.ADD, b"\x01" * 8), 3)))
        r = s.reply()
        assert isinstance(r, P.ErrorReply) and r.status == P.Status.BAD_REQUEST
        s.send(b"".join(P.encode_request(P.Read(77, 0, 0, 16), 4)))
        r = s.reply()
        assert isinstance(r, P.ReadReply) and r.hole
        s.send(b"".join(P.encode_request(P.Stat(), 5)))
        assert isinstance(s.reply(), P.StatReply)
        s.close()
        # an oversized frame: refused from its header, that connection is closed
        s = _raw(address, key_file_of(cluster.dir))
        s.send(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Opcode.WRITE, 6, 0, 0, 1 << 31))
        r = s.reply()
        assert isinstance(r, P.ErrorReply) and r.status == P.Status.TOO_LARGE
        try:
            assert s.sock.recv(1) == b""  # closed
        except ConnectionResetError:
            pass  # closed with our unread bytes in its buffer: also closed
        s.close()
        # garbage instead of a handshake, and a frame cut in the middle
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"".join(P.encode_request(P.Write(1, 0, 4096, 0, 0, b"x" * 999), 7))[:500]):
            host, port = address.rsplit(":", 1)
            g = socket.create_connection((host, int(port)), timeout=10)
            try:
                g.sendall(junk)
                g.shutdown(socket.SHUT_WR)
                g.recv(65536)
            except OSError:
                pass  # the shard may hang up first: that is the point
            finally:
                g.close()
        before_end = pushes[0]
        wait_until(lambda: pushes[0] > before_end + 10 or bool(errors), 30, "the steady client to go on pushing")
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors
    assert pushes[0] > 0
    # and the shard is still there for everyone
    res = irdma_cli("shard", "list", "--meta", cluster.meta_url)
    assert res.stdout.count(" up ") == 2, res.stdout


def test_cli_shows_the_running_cluster(cluster: Cluster) -> None:
    res = irdma_cli("shard", "list", "--meta", cluster.meta_url)
    for s in cluster.shards:
        assert s.address in res.stdout
    assert "capacity" in res.stdout and "chunks" in res.stdout
    res = irdma_cli("status", "--meta", cluster.meta_url)
    assert "2 of 2" in res.stdout and "healthy" in res.stdout and "512.0 MiB" in res.stdout


def test_cli_errors_say_what_to_do(tmp_path: object) -> None:
    res = irdma_cli("status", "--meta", f"sqlite://{tmp_path}/nothing.db", check=False)
    assert res.returncode == 1 and "irdma up" in res.stderr
    res = irdma_cli("server", "--listen", "nonsense", check=False)
    assert res.returncode == 2 and "HOST:PORT" in res.stderr
    res = irdma_cli("down", "--dir", str(tmp_path), check=False)
    assert res.returncode == 1 and "--dir" in res.stderr


def test_struct_sizes_are_fixed() -> None:
    assert P.HEADER_SIZE == 16 and struct.calcsize("!QQIIB3x") == P.WRITE_FIXED == 28


def test_verbs_where_there_is_no_device_names_the_cause_and_the_fix() -> None:
    from irdma.transport import verbs_status

    ok, _ = verbs_status()
    if ok:
        pytest.skip("this machine has an RDMA device")
    res = irdma_cli("server", "--listen", "127.0.0.1:0", "--capacity", "8MiB", "--transport", "verbs", "--no-auth",
                    check=False)
    assert res.returncode == 1
    assert "RDMA" in res.stderr and "--transport tcp" in res.stderr
    with pytest.raises(irdma.TransportUnavailable, match="--transport tcp"):
        irdma.connect("sqlite:///nonexistent/meta.db", transport="verbs")


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dead_shard_is_reported_and_fails_only_its_chunks(tmp_path: object, replicas: int) -> None:
    """One replica: the dead shard's chunks fail (loudly), the others read. Two: all read."""
    import signal

    with running_cluster(str(tmp_path), shards=2, replicas=replicas, capacity=16 << 20) as c:
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            data = os.urandom(3 << 20)
            cl.write("/two-shards", data, chunk_size=1 << 20)
            dead = c.shards[1]
            os.kill(dead.pid, signal.SIGKILL)
            wait_until(lambda: not _alive(dead.pid), 10, "the shard to die")
            if replicas == 1:
                with pytest.raises(irdma.ShardUnavailable, match="irdma shard list") as info:
                    cl.read("/two-shards")
                assert str(info.value).count("irdma shard list") == 1, info.value  # the hint said once
            else:
                assert cl.read("/two-shards") == data
                cl.write("/two-shards", data[::-1])  # and writes go on, on the survivor
                assert cl.read("/two-shards") == data[::-1]
            if replicas == 1:  # the chunks of the live shard still read
                layout = irdma.Layout(cl.stat("/two-shards").ino, 1 << 20, cl.stat("/two-shards").stripe)
                live = next(i for i in range(3) if layout.shard_of(i) == c.shards[0].shard_id)
                assert cl.read("/two-shards", live << 20, 1 << 20) == data[live << 20 : (live + 1) << 20]
        res = irdma_cli("shard", "list", "--meta", c.meta_url)
        assert "down" in res.stdout and dead.address in res.stderr
        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        assert "1 of 2" in res.stdout
        if replicas == 1:  # its chunks on the dead shard cannot be read: the file is named, and the fix
            out = " ".join((res.stdout + res.stderr).split())
            assert res.returncode == 2 and "/two-shards" in out and f"restart shard {dead.shard_id}" in out
            assert "force-from" not in out  # no older copy exists anywhere: nothing to adopt
        else:  # every file reads from its other replica: degraded only
            assert res.returncode == 1 and "degraded" in res.stdout
        c.shards = c.shards[:1]  # the dead one has no clean log to check


def _alive(pid: int) -> bool:
    from irdma.ops._proc import pid_alive

    return pid_alive(pid)


def test_a_sync_client_whose_loop_died_says_why(cluster: Cluster) -> None:
    import trio

    c = irdma.connect(cluster.meta_url, transport="tcp")
    try:
        async def boom() -> None:
            raise RuntimeError("background task failed")

        trio.from_thread.run_sync(lambda: c.client.pool.nursery.start_soon(boom), trio_token=c._token)
        c._thread.join(10)
        assert not c._thread.is_alive()
        with pytest.raises(irdma.IrdmaError, match="background task failed") as info:
            c.listdir("/")
        assert info.value.__cause__ is not None
    finally:
        c._token = None  # the loop is gone: nothing to close


def test_clients_racing_to_make_the_same_directories_and_files_all_succeed(cluster: Cluster) -> None:
    """``makedirs`` and ``create`` are ``mkdir -p`` and ``open(O_CREAT)``: a client that loses
    the race to another's create gets the winner's inode, not ``Exists`` (two ranks of a job
    writing their first collective at once)."""
    rounds, n = 20, 3
    start = threading.Barrier(n, timeout=60)
    got: dict[int, list[tuple[int, int]]] = {}
    errors: list[BaseException] = []

    def racer(k: int) -> None:
        try:
            with irdma.connect(cluster.meta_url, transport="tcp") as c:
                seen = []
                for i in range(rounds):
                    start.wait()
                    d = c.makedirs(f"/race/d{i}/sub")
                    f = c.create(f"/race/d{i}/sub/f")
                    seen.append((d.ino, f.ino))
                got[k] = seen
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=racer, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got[0] == got[1] == got[2]  # every client got the same directory and file each round
    with irdma.connect(cluster.meta_url, transport="tcp") as c:
        assert sorted(c.listdir("/race")) == sorted(f"d{i}" for i in range(rounds))


def test_a_write_of_many_windows_queues_without_missing_deadlines(tmp_path: object) -> None:
    """A request waiting behind this client's own for room in a shard's window does not count
    that wait against its deadline while the shard keeps answering: one write of 192 chunks of
    1 MiB to one shard through a window of 1 with a deadline of a sixth of the write's time
    (each request a few ms; the last waits for all the others) takes several deadlines in all, and must succeed (before,
    the requests late in the queue missed their deadline there and the write failed with
    ShardUnavailable). The chunks exist already, so no request waits on the disk to make one."""
    import trio

    from irdma.client.native import Client

    first = np.zeros(192 << 20, dtype=np.uint8)
    data = np.random.default_rng(5).integers(0, 256, 192 << 20, dtype=np.uint8)

    async def run(meta: str) -> tuple[float, float]:
        async with Client.open(meta, transport="tcp", window=1) as c:
            await c.write("/big", first, chunk_size=1 << 20)  # the chunks made, at the usual deadline
            other = data[::-1].copy()
            t0 = trio.current_time()
            await c.write("/big", other)  # the same write, timed at the usual deadline
            alone = trio.current_time() - t0
            # a deadline of a sixth of the whole write: some 32 requests' time each, and the
            # write's last requests queue for about 6 of them (the floor keeps it some 20
            # requests' time on a machine that writes 192 MiB in a tenth of a second)
            c.timeout = max(0.02, alone / 6)
            t0 = trio.current_time()
            await c.write("/big", data)
            took = trio.current_time() - t0
            deadline, c.timeout = c.timeout, 10.0
            assert bytes(await c.read("/big")) == data.tobytes()
            return took, deadline

    with running_cluster(str(tmp_path), shards=1, capacity=256 << 20, replicas=1) as small:
        took, deadline = trio.run(run, small.meta_url)
    assert took > 2 * deadline, f"the write took {took:.2f} s, {deadline:.2f} s a deadline: the test proves nothing"
