"""Faults with real processes: the mount and the shards never lie, never hang, never die.

Each test builds its own small cluster (shard processes) and mounts, injures one part (SIGKILL,
SIGSTOP, a foreign FREE, a full region, a held metadata lock, an exception inside a handler)
and checks what a user would: the bytes come back right or the call fails with an error
(EIO, ENOSPC, EBUSY) within the deadline; zeros only where the file has a hole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio
from helpers import Cluster, irdma_cli, mounted, running_cluster, wait_until

import irdma
from irdma.ops._proc import pid_alive, spawn_detached
from irdma.ops.cluster import ShardProc, key_file_of
from irdma.transport.tcp import TcpTransport
from irdma.wire.auth import read_key_file

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

MB = 1 << 20
TIMEOUT = 2.0  # the mounts' request deadline in these tests (default 10 s)


def restart_shard(c: Cluster, s: ShardProc, capacity: int) -> ShardProc:
    """Start a shard process again on the same address and id (fresh, empty memory)."""
    pid = spawn_detached(["-m", "irdma.ops.cli", "server", "--listen", s.address, "--capacity", str(capacity),
                          "--shard-id", str(s.shard_id), "--transport", "tcp",
                          "--key-file", key_file_of(c.dir)], s.log)
    new = ShardProc(s.shard_id, s.address, pid, s.log)
    c.shards = [new if x.shard_id == s.shard_id else x for x in c.shards]
    from irdma.ops.cluster import _write_state

    _write_state(c.dir, c.shards)

    def answers() -> bool:
        try:
            trio.run(irdma.ops.cluster.wait_for_shard, s.address, "tcp", time.monotonic() + 0.5, None,
                     read_key_file(key_file_of(c.dir)))
            return True
        except irdma.ShardUnavailable:
            return False

    wait_until(answers, 20, f"shard {s.shard_id} to answer again")
    return new


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, f"process {pid} to die")


def peers_closed_on(ports: set[int]) -> int:
    """Connections to these local ports whose peer closed and the listener has not yet (TCP
    CLOSE_WAIT, from /proc/net/tcp): a shard still reading what a dead client sent before it died."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if r[3] == "08" and int(r[1].rsplit(":", 1)[1], 16) in ports)


def chunk_shards(meta_url: str, path: str) -> tuple[irdma.Layout, list[int]]:
    with irdma.connect(meta_url, transport="tcp") as cl:
        inode = cl.stat(path)
    layout = irdma.Layout(inode.ino, inode.chunk_size or 0, inode.stripe)
    return layout, [layout.shard_of(i) for i in range(layout.chunk_count(inode.size))]


def read_or_errno(path: str, off: int, n: int) -> bytes | int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return exc.errno or -1
    try:
        return os.pread(fd, n, off)
    except OSError as exc:
        return exc.errno or -1
    finally:
        os.close(fd)


@contextlib.contextmanager
def mount(c: Cluster, tmp: str, name: str, allow: tuple[str, ...] = (), **kw: object) -> Iterator[str]:
    with mounted(c.meta_url, os.path.join(tmp, name), allow_log=allow, request_timeout=TIMEOUT, **kw) as m:
        yield m


LOST_LOG = ("lost", "failed", "did not answer", "DataLost", "is gone", "refused", "internal error")


def test_a_restarted_shard_never_reads_as_zeros(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=64 * MB) as c, \
            mount(c, tmp, "m", allow=LOST_LOG) as m:
        os.makedirs(os.path.join(m, "d"))
        os.setxattr(os.path.join(m, "d"), "user.irdma.chunk_size", b"1048576")
        data = os.urandom(6 * MB)
        with open(os.path.join(m, "d/weights"), "wb") as f:
            f.write(data)
        ones = np.ones(512 * 1024, "<f4")
        with open(os.path.join(m, "d/grads"), "wb") as f:
            f.write(ones.tobytes())
        os.setxattr(os.path.join(m, "d/grads"), "user.irdma.update", b"add")
        layout, shards = chunk_shards(c.meta_url, "/d/weights")
        victim = c.shards[1]
        assert victim.shard_id in shards and c.shards[0].shard_id in shards
        kill(victim.pid)
        restart_shard(c, victim, 64 * MB)

        # every chunk reads back right or fails with EIO: never zeros
        path = os.path.join(m, "d/weights")
        for i, sid in enumerate(shards):
            got = read_or_errno(path, i * MB, MB)
            if sid == victim.shard_id:
                assert got == errno.EIO, f"chunk {i} on the restarted shard: {got!r:.60}"
            else:
                assert got == data[i * MB : (i + 1) * MB], f"chunk {i} on the live shard differs"
        with pytest.raises(OSError) as info:
            with open(path, "rb") as f:
                f.read()
        assert info.value.errno == errno.EIO
        # an add file is not silently reset to zeros by the next push
        fd = os.open(os.path.join(m, "d/grads"), os.O_WRONLY)
        try:
            with pytest.raises(OSError) as info:
                os.pwrite(fd, np.ones(512 * 1024, "<f4").tobytes(), 0)
                os.fsync(fd)
            assert info.value.errno == errno.EIO
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        # the native client says so too
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            with pytest.raises(irdma.DataLost):
                cl.pull("/d/weights")
            # sparse rows too: a pull of rows on the lost chunks, and a push of rows into them
            lost = next(i for i, sid in enumerate(shards) if sid == victim.shard_id)
            rows = np.arange(lost * 1024, (lost + 1) * 1024, 97)  # 1 KiB rows of that chunk
            with pytest.raises(irdma.DataLost):
                cl.pull_rows("/d/weights", rows, row_len=256)
            _, grad_shards = chunk_shards(c.meta_url, "/d/grads")
            gone = grad_shards.index(victim.shard_id)
            with pytest.raises(irdma.DataLost):
                cl.push_rows("/d/grads", np.arange(gone * 1024, (gone + 1) * 1024, 7), np.ones((147, 256), "<f4"),
                             op="add", row_len=256)
        # status and fsck name the damaged files and exit 2
        res = irdma_cli("status", "--meta", c.meta_url, check=False)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "/d/weights" in res.stdout and "/d/grads" in res.stdout and "data lost" in res.stdout
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert res.returncode == 2 and "/d/weights" in res.stdout, res.stdout + res.stderr
        # rewriting a file heals it
        with open(path, "wb") as f:
            f.write(data)
        with open(path, "rb") as f:
            assert f.read() == data
        os.unlink(os.path.join(m, "d/grads"))  # freed once its unlink grace period is over
        wait_until(lambda: irdma_cli("status", "--meta", c.meta_url, check=False).returncode == 0, 30,
                   "status to be healthy once the damaged files are gone")


def test_a_stopped_shard_fails_its_reads_within_the_deadline_and_nothing_else(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=64 * MB) as c, \
            mount(c, tmp, "m", allow=LOST_LOG) as m:
        os.makedirs(os.path.join(m, "d"))
        os.setxattr(os.path.join(m, "d"), "user.irdma.chunk_size", b"1048576")
        files = {}
        for k in range(4):  # small files: each on one shard (the stripe starts at its inode)
            files[f"d/f{k}"] = os.urandom(100_000)
            with open(os.path.join(m, f"d/f{k}"), "wb") as f:
                f.write(files[f"d/f{k}"])
        where = {name: chunk_shards(c.meta_url, "/" + name)[1][0] for name in files}
        victim = c.shards[1]
        on_victim = [n for n, s in where.items() if s == victim.shard_id]
        on_live = [n for n, s in where.items() if s != victim.shard_id]
        assert on_victim and on_live
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert read_or_errno(os.path.join(m, on_victim[0]), 0, 100_000) == errno.EIO
            elapsed = time.monotonic() - t0
            assert elapsed < 2 * TIMEOUT + 3, f"EIO after {elapsed:.1f} s, deadline {TIMEOUT} s"
            # the mount still serves every other file meanwhile
            for name in on_live:
                assert read_or_errno(os.path.join(m, name), 0, 100_000) == files[name]
            fd = os.open(os.path.join(m, on_victim[0]), os.O_WRONLY)
            try:
                with pytest.raises(OSError) as info:
                    os.pwrite(fd, b"x" * 10, 0)
                    os.fsync(fd)
                assert info.value.errno == errno.EIO
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        # back: the shard answers again and its files read right
        wait_until(lambda: read_or_errno(os.path.join(m, on_victim[0]), 0, 100_000) == files[on_victim[0]],
                   3 * TIMEOUT + 10, "the resumed shard's file to read back")


def test_a_foreign_free_is_reported_not_read_as_zeros(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=64 * MB) as c, \
            mount(c, tmp, "m", allow=LOST_LOG) as m:
        data = os.urandom(3 * MB)
        with open(os.path.join(m, "f"), "wb") as f:
            f.write(data)
        layout, shards = chunk_shards(c.meta_url, "/f")

        async def free_everywhere() -> None:
            async with trio.open_nursery() as n:
                for s in c.shards:
                    conn = await TcpTransport().connect(s.address, n, client_name="foreign",
                                                        key=read_key_file(key_file_of(c.dir)))
                    await conn.free(layout.file_id, 0)
                    await conn.aclose()

        trio.run(free_everywhere)
        assert read_or_errno(os.path.join(m, "f"), 0, 3 * MB) == errno.EIO
        res = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert res.returncode == 2 and str(layout.file_id) in res.stdout, res.stdout + res.stderr


def test_a_killed_mount_is_recovered_and_leaks_nothing(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, capacity=128 * MB) as c, mount(c, tmp, "m") as m:
        def used() -> int:
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                return sum(st.used for _, st, _ in cl.shard_stats())

        base = used()
        victim_mnt = os.path.join(tmp, "victim")
        os.makedirs(victim_mnt)
        from irdma.fs.mount import spawn_mount

        pid = spawn_mount(c.meta_url, victim_mnt, transport="tcp", log_file=victim_mnt + ".log",
                          request_timeout=TIMEOUT)
        writer = subprocess.Popen([sys.executable, "-c", (
            "import os, sys\n"
            "f = open(sys.argv[1], 'wb')\n"
            "for i in range(64): f.write(os.urandom(1 << 20))\n"
            "f.flush(); os.fsync(f.fileno())\n"
            "import time; time.sleep(60)\n"), os.path.join(victim_mnt, "big")])
        try:
            wait_until(lambda: used() >= base + 32 * MB, 60, "the writer's chunks to reach the shards")
            kill(pid)
        finally:
            writer.kill()
            writer.wait(10)
        # what the dead mount had sent is applied (a shard closes a connection once it read it
        # all) before gc scans: a write landing after the scan is the next gc's to free
        ports = {int(sh.address.rsplit(":", 1)[1]) for sh in c.shards}
        wait_until(lambda: peers_closed_on(ports) == 0, 60, "the shards to finish the dead mount's connections")
        # the file the dead mount was writing holds no acknowledged byte past what was stored
        assert irdma_cli("umount", victim_mnt).returncode == 0
        res = irdma_cli("gc", "--meta", c.meta_url, "--dry-run")
        assert "would free" in res.stdout
        size = os.path.getsize(os.path.join(m, "big"))
        chunk = 4 * MB
        outs = [res.stdout]
        # a write of the dead mount the shards applied after a gc's scan is the next gc's to free
        # (the full suite under load left 48 MiB after one gc, once in 3 runs): a few gc passes, as
        # an operator would run, must leave nothing
        for _ in range(3):
            outs.append(irdma_cli("gc", "--meta", c.meta_url).stdout)
            if used() <= base + -(-size // chunk) * chunk:
                break
        assert used() <= base + -(-size // chunk) * chunk, f"gc left chunks of the dead writer: {''.join(outs)}"
        # extending the file shows zeros past the old end, never the dead writer's bytes
        os.truncate(os.path.join(m, "big"), size + 16 * MB)
        with open(os.path.join(m, "big"), "rb") as f:
            f.seek(size)
            assert f.read() == bytes(16 * MB)
        # and the mountpoint takes a new mount
        with mounted(c.meta_url, victim_mnt) as again:
            assert os.path.getsize(os.path.join(again, "big")) == size + 16 * MB


def test_sizes_count_only_stored_bytes_after_enospc(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=8 * MB) as c, \
            mount(c, tmp, "m", allow=("failed", "full")) as m:
        data = os.urandom(40 * MB)
        path = os.path.join(m, "big")
        with pytest.raises(OSError) as info:
            with open(path, "wb") as f:
                for i in range(0, len(data), MB):
                    f.write(data[i : i + MB])
        assert info.value.errno == errno.ENOSPC
        size = os.path.getsize(path)
        assert 0 < size < len(data)
        with open(path, "rb") as f:
            assert f.read() == data[:size], "the file's size counts bytes that were never stored"
        # 1-byte files (a page of shard memory each) until one fails: it keeps size 0, not 1 byte of \0
        k = 0
        with pytest.raises(OSError) as info:
            while k < 10_000:
                with open(os.path.join(m, f"one{k}"), "wb") as f:
                    f.write(b"x")
                k += 1
        assert info.value.errno == errno.ENOSPC
        assert os.path.getsize(os.path.join(m, f"one{k}")) == 0
        assert all(os.path.getsize(os.path.join(m, f"one{j}")) == 1 for j in range(k))


@contextlib.contextmanager
def small_disk(path: str, size: int) -> Iterator[str]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (a disk that fills up), unmounted at the end."""
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def test_a_full_disk_under_the_data_directory_is_enospc_and_the_shard_lives_on(tmp_path: object) -> None:
    """A shard whose region (64 MiB) is bigger than the disk its data directory is on (20 MiB):
    4 MiB files through the mount until the disk is full. The write that finds no room fails
    with ENOSPC (before: the shard died of SIGBUS at its first write into a page the disk had
    no block for, and every file on it went with it); the shard goes on serving, every file
    whose close returned reads back as written, and room freed by rm is used again."""
    tmp = str(tmp_path)
    with small_disk(os.path.join(tmp, "disk"), 20 * MB) as disk, \
            running_cluster(os.path.join(disk, "c"), shards=1, replicas=1, capacity=64 * MB) as c, \
            mount(c, tmp, "m", allow=("failed", "full", "no room")) as m:
        rng = np.random.default_rng(5)
        kept: dict[str, bytes] = {}
        failed = None
        for k in range(16):  # 64 MiB of files: the disk is full long before
            data = rng.integers(0, 256, 4 * MB, dtype=np.uint8).tobytes()
            path = os.path.join(m, f"f{k}")
            try:
                with open(path, "wb") as f:
                    f.write(data)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                failed = path
                break
            kept[path] = data
        assert failed is not None, "64 MiB of files fitted on a 20 MiB disk"
        assert len(kept) >= 2, "the disk held less than 8 MiB of files"
        assert all(pid_alive(s.pid) for s in c.shards), "a shard died when its disk filled up"
        for path, data in kept.items():
            with open(path, "rb") as f:
                assert f.read() == data, f"{path} does not read back as written"
        def used() -> int:
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                return sum(st.used for _, st, _ in cl.shard_stats() if st is not None)

        held = used()
        os.unlink(failed)
        gone = next(iter(kept))
        os.unlink(gone)
        del kept[gone]
        wait_until(lambda: used() <= held - 4 * MB, 20, "the removed file's chunks to be freed (its unlink grace)")
        data = rng.integers(0, 256, 4 * MB, dtype=np.uint8).tobytes()
        with open(os.path.join(m, "again"), "wb") as f:  # into the extent the rm freed
            f.write(data)
        with open(os.path.join(m, "again"), "rb") as f:
            assert f.read() == data
        assert all(pid_alive(s.pid) for s in c.shards)


def test_rename_over_with_a_reader_on_another_mount(tmp_path: object) -> None:
    tmp = str(tmp_path)
    size = 256 * 1024
    with running_cluster(os.path.join(tmp, "c"), shards=2, capacity=64 * MB) as c, \
            mount(c, tmp, "w") as w, mount(c, tmp, "r") as r:
        os.setxattr(w, "user.irdma.chunk_size", b"262144")  # small files, small chunks
        with open(os.path.join(w, "ckpt"), "wb") as f:
            f.write(bytes([0]) * size)
        done = threading.Event()
        stats = {"reads": 0, "enoent": 0, "mixed": 0, "errors": 0, "versions": set()}

        def reader() -> None:
            deadline = time.monotonic() + 30
            # until the writer is done and the last version is seen (kernels cache names for 1 s)
            while not (done.is_set() and 120 in stats["versions"]) and time.monotonic() < deadline:  # type: ignore[operator]
                try:
                    with open(os.path.join(r, "ckpt"), "rb") as f:
                        got = f.read()
                except FileNotFoundError:
                    stats["enoent"] += 1  # type: ignore[operator]
                    continue
                except OSError as exc:
                    stats["errors"] += 1  # type: ignore[operator]
                    stats.setdefault("errnos", []).append(errno.errorcode.get(exc.errno or 0))  # type: ignore[union-attr]
                    continue
                stats["reads"] += 1  # type: ignore[operator]
                if len(got) != size or got.count(got[:1]) != size:
                    stats["mixed"] += 1  # type: ignore[operator]
                else:
                    stats["versions"].add(got[0])  # type: ignore[attr-defined]

        t = threading.Thread(target=reader)
        t.start()
        try:
            for v in range(1, 121):
                tmpf = os.path.join(w, "ckpt.tmp")
                with open(tmpf, "wb") as f:
                    f.write(bytes([v]) * size)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmpf, os.path.join(w, "ckpt"))
        finally:
            done.set()
            t.join(60)
        assert stats["enoent"] == 0 and stats["mixed"] == 0 and stats["errors"] == 0, str(stats)
        assert stats["reads"] >= 20 and 120 in stats["versions"], str(stats)  # type: ignore[operator]


INJECT = """
import sys
from irdma.meta.sqlite import SqliteMeta
_orig = SqliteMeta.getxattr
def getxattr(self, ino, name):
    if name == b"user.inject.bug":
        raise RuntimeError("injected bug")
    return _orig(self, ino, name)
SqliteMeta.getxattr = getxattr
from irdma.fs.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_exception_in_a_fuse_handler_fails_that_request_only(tmp_path: object) -> None:
    tmp = str(tmp_path)
    mnt = os.path.join(tmp, "m")
    os.makedirs(mnt)
    with running_cluster(os.path.join(tmp, "c"), shards=1, capacity=16 * MB) as c:
        with open(os.path.join(tmp, "m.log"), "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", INJECT, c.meta_url, mnt, "--transport", "tcp"],
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            from irdma.fs.mount import find_mount

            wait_until(lambda: find_mount(mnt) is not None, 30, "the mount")
            with open(os.path.join(mnt, "f"), "wb") as f:
                f.write(b"hello")
            with pytest.raises(OSError) as info:
                os.getxattr(os.path.join(mnt, "f"), "user.inject.bug")
            assert info.value.errno == errno.EIO
            # the next requests are served
            with open(os.path.join(mnt, "f"), "rb") as f:
                assert f.read() == b"hello"
            with pytest.raises(OSError) as info:
                os.getxattr(os.path.join(mnt, "f"), "user.other")
            assert info.value.errno == errno.ENODATA
            assert proc.poll() is None
        finally:
            irdma_cli("umount", mnt, check=False)
            proc.wait(20)
        with open(os.path.join(tmp, "m.log")) as f:
            text = f.read()
        assert "injected bug" in text and "Traceback" in text  # logged once, with its traceback


def test_an_exception_in_a_shard_request_fails_that_request_only() -> None:
    from irdma.server.serve import ShardServer
    from irdma.server.shard import Region, Shard

    from irdma.wire.protocol import UpdateOp

    async def main() -> None:
        shard = Shard(0, Region(8 * MB))
        server = ShardServer(shard)
        async with trio.open_nursery() as n:
            host, port = await n.start(server.serve_tcp, "127.0.0.1", 0)
            conn = await TcpTransport().connect(f"{host}:{port}", n)
            await conn.write(1, 0, MB, 0, UpdateOp.ASSIGN, b"abcd")
            orig = shard.read

            def broken(*args: object) -> object:
                shard.read = orig  # type: ignore[method-assign]
                raise RuntimeError("injected bug")

            shard.read = broken  # type: ignore[method-assign]
            buf = memoryview(bytearray(4))
            with pytest.raises(irdma.ShardUnavailable, match="INTERNAL"):
                await conn.read(1, 0, 0, buf)
            assert await conn.read(1, 0, 0, buf) == 1 and bytes(buf) == b"abcd"  # same connection
            await conn.aclose()
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_held_metadata_lock_gets_ebusy_and_the_rest_is_served(tmp_path: object) -> None:
    tmp = str(tmp_path)
    with running_cluster(os.path.join(tmp, "c"), shards=1, capacity=16 * MB) as c, \
            mount(c, tmp, "m", allow=("locked", "heartbeat")) as m:
        with open(os.path.join(m, "f"), "wb") as f:
            f.write(b"data" * 1000)
        fd = os.open(os.path.join(m, "f"), os.O_RDONLY)
        db = sqlite3.connect(c.meta_url.removeprefix("sqlite://"), isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")  # another process's write lock, held past the deadline
            result: dict[str, object] = {}

            def mkdir() -> None:
                t0 = time.monotonic()
                try:
                    os.mkdir(os.path.join(m, "newdir"))
                    result["ok"] = True
                except OSError as exc:
                    result["errno"] = exc.errno
                result["s"] = time.monotonic() - t0

            t = threading.Thread(target=mkdir)
            t.start()
            # meanwhile the mount serves reads and stats
            for _ in range(5):
                assert os.pread(fd, 4000, 0) == b"data" * 1000
                assert os.stat(os.path.join(m, "f")).st_size == 4000
            t.join(4 * TIMEOUT + 10)
            assert not t.is_alive()
            assert result.get("errno") == errno.EBUSY, result
        finally:
            db.execute("ROLLBACK")
            db.close()
            os.close(fd)
        os.mkdir(os.path.join(m, "newdir"))  # and works once the lock is gone


def test_a_directory_of_100000_entries_lists_completely(tmp_path: object) -> None:
    tmp = str(tmp_path)
    n = 100_000
    with running_cluster(os.path.join(tmp, "c"), shards=1, capacity=16 * MB) as c, mount(c, tmp, "m") as m:
        os.mkdir(os.path.join(m, "big"))
        with irdma.connect(c.meta_url, transport="tcp") as cl:
            parent = cl.stat("/big").ino
        # made in one transaction (100,000 creates through FUSE would take minutes)
        db = sqlite3.connect(c.meta_url.removeprefix("sqlite://"), isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            t = time.time_ns()
            for i in range(n):
                cur = db.execute("INSERT INTO inodes(mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size,"
                                 " stripe, update_op) VALUES (?,0,0,1,?,?,?,4096,'1','assign')",
                                 (0o100644, t, t, t))
                db.execute("INSERT INTO dentries VALUES (?,?,?)", (parent, f"e{i:06d}".encode(), cur.lastrowid))
            db.execute("COMMIT")
        finally:
            db.close()
        names = os.listdir(os.path.join(m, "big"))
        assert len(names) == n and len(set(names)) == n
