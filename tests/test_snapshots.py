"""Snapshots (issue 23) on a real cluster of shard processes (R=2), through the native client,
a real FUSE mount and the real ``irdma`` CLI: the cut, copy-on-write on the shards, the
read-only ``.snapshots`` tree, space, persistence across ``down``/``up``, delete and gc."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import numpy as np
import pytest
import trio
from helpers import Cluster, irdma_cli, mounted, running_cluster

import irdma
from irdma._errors import Exists, ReadOnly
from irdma.ops import cluster as cluster_ops

CHUNK = 64 * 1024


@pytest.fixture()
def cl(tmp_path: str) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path / "c"), shards=2, replicas=2) as c:  # type: ignore[operator]
        yield c


def _used(c: Cluster) -> int:
    async def go() -> int:
        async with irdma.Client.open(c.meta_url, transport="tcp") as client:
            return sum(st.used for _, st, _ in await client.shard_stats() if st is not None)

    return trio.run(go)


def test_snapshot_keeps_the_cut_while_the_file_changes(cl: Cluster) -> None:
    """A file and a directory tree under adam and assign: the snapshot reads as the files were
    at the cut after the live files are rewritten, truncated and removed; writes to it are EROFS."""
    w0 = np.arange(8 * CHUNK // 4, dtype="<f4")

    async def go() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            await c.makedirs("/job/sub")
            await c.write("/job/w", w0, chunk_size=CHUNK)
            await c.write("/job/sub/b", b"bias" * 1000, chunk_size=CHUNK)
            await c.write("/job/opt", np.ones(2 * CHUNK // 4, "<f4"), chunk_size=CHUNK)
            await c.set_update_op("/job/opt", "adam learning_rate=0.1")
            await c.push("/job/opt", np.ones(2 * CHUNK // 4, "<f4"))  # one adam step: moments made
            opt_at_cut = await c.pull("/job/opt")
            state_at_cut = await c.optimizer_state("/job/opt")

            info = await c.snapshot("/job", "s1")
            assert (info.name, info.path, info.files, info.state) == ("s1", "/job/.snapshots/s1", 3, "ready")
            assert info.bytes == w0.nbytes + 4000 + 2 * CHUNK
            with pytest.raises(Exists):
                await c.snapshot("/job", "s1")

            await c.push("/job/w", np.ones_like(w0))  # copy-on-write of every chunk
            await c.push("/job/opt", np.ones(2 * CHUNK // 4, "<f4"))
            await c.write("/job/sub/b", b"XXXX")
            assert np.array_equal(await c.pull("/job/w"), w0 + 1)
            assert np.array_equal(await c.pull("/job/.snapshots/s1/w"), w0)
            assert bytes(await c.read("/job/.snapshots/s1/sub/b")) == b"bias" * 1000
            assert np.array_equal(await c.pull("/job/.snapshots/s1/opt"), opt_at_cut)
            state = await c.optimizer_state("/job/.snapshots/s1/opt")
            assert state.keys() == state_at_cut.keys()
            assert all(np.array_equal(state[k], state_at_cut[k]) for k in state)
            assert "/.snapshots" not in await c.listdir("/job") and ".snapshots" not in await c.listdir("/job")
            assert await c.listdir("/job/.snapshots") == ["s1"]

            with pytest.raises(ReadOnly):
                await c.write("/job/.snapshots/s1/w", b"x")
            with pytest.raises(ReadOnly):
                await c.push("/job/.snapshots/s1/w", np.ones_like(w0))
            with pytest.raises(ReadOnly):
                await c.truncate("/job/.snapshots/s1/w", 0)

            await c.truncate("/job/w", 0)
            await c.unlink("/job/sub/b")
            assert np.array_equal(await c.pull("/job/.snapshots/s1/w"), w0)
            assert bytes(await c.read("/job/.snapshots/s1/sub/b")) == b"bias" * 1000

            # a file's snapshot lands in its directory's .snapshots; keep=1 drops the older ones
            # of the same file only (never s1, of the directory)
            await c.write("/job/w", w0 * 2)
            await c.snapshot("/job/w", "s2", keep=1)
            await c.write("/job/w", w0 * 3)
            await c.snapshot("/job/w", "s3", keep=1)
            assert [s.name for s in await c.snapshots("/job")] == ["s1", "s3"]
            assert await c.listdir("/job/.snapshots/s3") == ["w"]
            assert np.array_equal(await c.pull("/job/.snapshots/s3/w"), w0 * 3)

    trio.run(go)


def test_space_copy_on_write_and_delete(cl: Cluster) -> None:
    """After a snapshot and a rewrite of 10% of a file's chunks, the shards hold the file plus
    10% (times the replicas); deleting the snapshot gives it back; gc finds nothing to free."""
    chunks, replicas = 40, 2
    data = np.random.default_rng(1).standard_normal(chunks * CHUNK // 4).astype("<f4")

    async def go() -> tuple[int, int, int, int]:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            await c.write("/w", data, chunk_size=CHUNK)
            before = sum(st.used for _, st, _ in await c.shard_stats() if st is not None)
            await c.snapshot("/", "s")
            after_snap = sum(st.used for _, st, _ in await c.shard_stats() if st is not None)
            for k in range(0, chunks, 10):  # 4 of 40 chunks
                await c.write("/w", np.zeros(CHUNK // 4, "<f4"), k * CHUNK)
            rewritten = sum(st.used for _, st, _ in await c.shard_stats() if st is not None)
            assert np.array_equal(await c.pull("/.snapshots/s/w"), data)
            (info,) = await c.snapshots("/")
            assert (info.held_alone, info.shared) == (4 * CHUNK * replicas, 36 * CHUNK * replicas)
            assert await c.delete_snapshot("/", "s") == 1
            gone = sum(st.used for _, st, _ in await c.shard_stats() if st is not None)
            return before, after_snap, rewritten, gone

    before, after_snap, rewritten, gone = trio.run(go)
    assert before == chunks * CHUNK * replicas
    assert after_snap == before  # no byte copied at creation
    assert rewritten == before + 4 * CHUNK * replicas
    assert gone == before
    out = irdma_cli("gc", "--dry-run", "--meta", cl.meta_url).stdout
    assert "0 orphaned files" in out and "0 leaked chunks" in out, out
    irdma_cli("snapshot", "create", "--meta", cl.meta_url, "/w", "again")
    listed = irdma_cli("snapshot", "list", "--meta", cl.meta_url, "/", env={**os.environ, "COLUMNS": "100"}).stdout
    assert "again" in listed and "5.0 MiB" in listed and "ready" in listed, listed  # shared: 40 chunks x 2

    # a metadata dump keeps the snapshots: loaded into a new engine, they are listed again
    dump = os.path.join(cl.dir, "meta.json")
    irdma_cli("dump", cl.meta_url, dump)
    loaded = f"sqlite://{cl.dir}/loaded.db"
    irdma_cli("load", loaded, dump)
    from irdma.meta import open_meta

    meta = open_meta(loaded)
    try:
        assert [s.name for s in meta.snapshots(1)] == [b"again"]
        root = meta.lookup(meta.lookup(1, b".snapshots").ino, b"again")
        assert [n for n, _ in meta.readdir(root.ino)] == [b"w"]
        assert meta.chunk_map(meta.lookup(root.ino, b"w").ino)
    finally:
        meta.close()


def test_snapshots_survive_down_and_up(cl: Cluster) -> None:
    """Shared extents and copies are in the shards' data directories: after ``down`` + ``up``
    the snapshot and the live file each read as before, and copy-on-write goes on."""
    w0 = np.arange(4 * CHUNK // 4, dtype="<f4")

    async def before() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            await c.write("/w", w0, chunk_size=CHUNK)
            await c.snapshot("/", "s")
            await c.write("/w", np.zeros(CHUNK // 4, "<f4"))  # chunk 0 copied, 1..3 shared

    trio.run(before)
    cluster_ops.down(cl.dir)
    cluster_ops.up(cl.dir, 2, 64 << 20)

    async def after() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            live = w0.copy()
            live[: CHUNK // 4] = 0
            assert np.array_equal(await c.pull("/w"), live)
            assert np.array_equal(await c.pull("/.snapshots/s/w"), w0)
            await c.push("/w", np.ones_like(w0))
            assert np.array_equal(await c.pull("/w"), live + 1)
            assert np.array_equal(await c.pull("/.snapshots/s/w"), w0)

    trio.run(after)


def test_mount_mkdir_rmdir_and_erofs(cl: Cluster, tmp_path: str) -> None:
    """Through a real mount: ``mkdir D/.snapshots/N`` takes a snapshot, the tree reads as the
    cut, writes in it fail with EROFS, ``ls -a D`` hides ``.snapshots``, ``rmdir`` deletes it;
    the CLI lists and deletes the same snapshots."""
    mnt = str(tmp_path / "mnt")  # type: ignore[operator]
    with mounted(cl.meta_url, mnt):
        os.makedirs(f"{mnt}/job")
        with open(f"{mnt}/job/w", "wb") as f:
            f.write(b"a" * 100_000)
        assert os.path.isdir(f"{mnt}/job/.snapshots")  # always there to a lookup, as CephFS's .snap
        os.mkdir(f"{mnt}/job/.snapshots/first")
        with open(f"{mnt}/job/w", "r+b") as f:
            f.write(b"b" * 10)
        with open(f"{mnt}/job/.snapshots/first/w", "rb") as f:
            assert f.read() == b"a" * 100_000
        with open(f"{mnt}/job/w", "rb") as f:
            assert f.read(11) == b"b" * 10 + b"a"
        assert ".snapshots" not in os.listdir(f"{mnt}/job")
        assert os.listdir(f"{mnt}/job/.snapshots") == ["first"]
        for attempt in (lambda: open(f"{mnt}/job/.snapshots/first/w", "r+b"),
                        lambda: open(f"{mnt}/job/.snapshots/first/new", "wb"),
                        lambda: os.unlink(f"{mnt}/job/.snapshots/first/w"),
                        lambda: os.mkdir(f"{mnt}/job/.snapshots/first/d"),
                        lambda: os.chmod(f"{mnt}/job/.snapshots/first/w", 0o600),
                        lambda: os.rename(f"{mnt}/job/.snapshots/first/w", f"{mnt}/job/x")):
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.EROFS, attempt
        with pytest.raises(OSError) as e:
            os.rmdir(f"{mnt}/job")
        assert e.value.errno == errno.ENOTEMPTY  # its snapshots stay until deleted (as CephFS's)

        out = irdma_cli("snapshot", "list", "--meta", cl.meta_url, "/job").stdout
        assert "first" in out and "ready" in out, out
        irdma_cli("snapshot", "create", "--meta", cl.meta_url, "/job", "second")
        assert sorted(os.listdir(f"{mnt}/job/.snapshots")) == ["first", "second"]
        os.rmdir(f"{mnt}/job/.snapshots/first")
        irdma_cli("snapshot", "delete", "--meta", cl.meta_url, "/job", "second")
        assert not os.path.exists(f"{mnt}/job/.snapshots/second")
        os.unlink(f"{mnt}/job/w")
        os.rmdir(f"{mnt}/job")


def test_shard_copy_on_write_rules(tmp_path: str) -> None:
    """The shard alone, on a data directory: a clone shares extents (no byte, no space), the
    owner's write moves the others to one copy, a clone's write moves that clone alone, a
    freed owner leaves the extent to the clone, and all of it is reloaded from the directory."""
    from irdma.server.shard import Region, Shard
    from irdma.server.store import ShardStore

    from irdma.wire.protocol import UpdateOp

    def open_shard() -> tuple[ShardStore, Shard]:
        st = ShardStore(str(tmp_path), 1, 1 << 24)
        return st, Shard(1, Region(st.capacity, memoryview(st.region)), memoryview(st.versions), st)

    def value(sh: Shard, f: int, i: int) -> float:
        return float(np.frombuffer(sh.read(f, i, 0, 4)[1], "<f4")[0])  # type: ignore[arg-type]

    st, sh = open_shard()
    for i in range(4):
        sh.write(7, i, CHUNK, 0, UpdateOp.ASSIGN, np.full(CHUNK // 4, i, "<f4").tobytes())
    held = sh.used
    assert sh.clone(7, 100) == 4 and sh.clone(7, 101) == 4 and sh.used == held
    where = sh.locate(7, 1).offset  # type: ignore[union-attr]
    sh.write(7, 1, CHUNK, 0, UpdateOp.ADD, np.ones(CHUNK // 4, "<f4").tobytes())
    assert sh.locate(7, 1).offset == where  # the owner stays: a cached place stays right  # type: ignore[union-attr]
    assert sh.used == held + CHUNK and sh.copies == 1  # one copy for both clones
    assert (value(sh, 7, 1), value(sh, 100, 1), value(sh, 101, 1)) == (2.0, 1.0, 1.0)
    assert sh.version_of(100, 1) == 1 and sh.version_of(7, 1) == 2
    sh.write(7, 1, CHUNK, 0, UpdateOp.ADD, np.ones(CHUNK // 4, "<f4").tobytes())
    assert sh.copies == 1  # later writes copy nothing
    where = sh.locate(7, 2).offset  # type: ignore[union-attr]
    sh.write(101, 2, CHUNK, 0, UpdateOp.ASSIGN, np.full(CHUNK // 4, 9, "<f4").tobytes())  # a clone written
    assert sh.locate(7, 2).offset == where and sh.locate(101, 2).offset != where  # type: ignore[union-attr]
    assert (value(sh, 7, 2), value(sh, 100, 2), value(sh, 101, 2)) == (2.0, 2.0, 9.0)
    st.close()
    st, sh = open_shard()
    assert sh.used == held + 2 * CHUNK
    assert (value(sh, 7, 1), value(sh, 100, 1), value(sh, 101, 2), value(sh, 100, 3)) == (3.0, 1.0, 9.0, 3.0)
    sh.free(7, 0)  # the live file goes: its snapshots keep their chunks
    assert (value(sh, 100, 0), value(sh, 100, 3), value(sh, 101, 3)) == (0.0, 3.0, 3.0)
    sh.free(100, 0)
    sh.free(101, 0)
    assert sh.used == 0 and sh.chunk_count == 0
    st.close()


def test_shard_redirect_on_write_of_a_chunk_no_client_located(tmp_path: str) -> None:
    """A chunk no client was told the place of (TCP clients never are) is not copied before its
    first write after a snapshot: the update is written into a new extent, the live key moves
    there, the snapshot keeps the old extent untouched; reloaded the same from the directory."""
    from irdma.server.shard import Region, Shard
    from irdma.server.store import ShardStore

    from irdma.wire.protocol import UpdateOp

    def open_shard() -> tuple[ShardStore, Shard]:
        st = ShardStore(str(tmp_path), 1, 1 << 24)
        return st, Shard(1, Region(st.capacity, memoryview(st.region)), memoryview(st.versions), st)

    def floats(sh: Shard, f: int, i: int) -> np.ndarray:
        return np.frombuffer(bytes(sh.read(f, i, 0, CHUNK)[1]), "<f4")  # type: ignore[arg-type]

    st, sh = open_shard()
    base = np.arange(CHUNK // 4, dtype="<f4")
    sh.write(7, 0, CHUNK, 0, UpdateOp.ASSIGN, base.tobytes())
    sh.write(7, 1, CHUNK, 0, UpdateOp.ASSIGN, base.tobytes())
    sh.clone(7, 100)
    where = sh._chunks[(7, 0)].offset
    sh.write(7, 0, CHUNK, 8, UpdateOp.ADD, np.ones(4, "<f4").tobytes())  # elements 2..5
    assert sh._chunks[(7, 0)].offset != where and sh._chunks[(100, 0)].offset == where  # the writer moved
    want = base.copy()
    want[2:6] += 1
    assert np.array_equal(floats(sh, 7, 0), want) and np.array_equal(floats(sh, 100, 0), base)
    assert sh.version_of(7, 0) == 2 and sh.version_of(100, 0) == 1 and sh.copies == 1
    sh.write(7, 1, CHUNK, 4, UpdateOp.ASSIGN, np.full(2, 9, "<f4").tobytes())  # assign redirects too
    assert floats(sh, 7, 1)[1:4].tolist() == [9.0, 9.0, 3.0] and np.array_equal(floats(sh, 100, 1), base)
    sh.write(7, 0, CHUNK, 0, UpdateOp.ADD, np.ones(CHUNK // 4, "<f4").tobytes())  # not shared now: in place
    assert sh.copies == 2
    st.close()
    st, sh = open_shard()
    assert np.array_equal(floats(sh, 7, 0), want + 1) and np.array_equal(floats(sh, 100, 0), base)
    assert np.array_equal(floats(sh, 100, 1), base) and floats(sh, 7, 1)[1] == 9.0
    sh.free(100, 0)
    sh.free(7, 0)
    assert sh.used == 0
    st.close()


def test_restore_and_clone(cl: Cluster) -> None:
    """``restore`` makes a directory (entries swapped at once, its snapshots kept) or a file
    what the snapshot holds; ``clone`` is a writable copy whose writes change neither the
    snapshot nor the live tree; the CLI does both."""
    a, b = np.arange(3 * CHUNK // 4, dtype="<f4"), np.full(CHUNK // 4, 7, "<f4")

    async def go() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            await c.makedirs("/job/sub")
            await c.write("/job/a", a, chunk_size=CHUNK)
            await c.write("/job/sub/b", b, chunk_size=CHUNK)
            await c.snapshot("/job", "e1")
            await c.push("/job/a", np.ones_like(a))
            await c.unlink("/job/sub/b")
            await c.write("/job/new", b"later")
            await c.restore_snapshot("/job", "e1")
            assert sorted(await c.listdir("/job")) == ["a", "sub"]
            assert np.array_equal(await c.pull("/job/a"), a) and np.array_equal(await c.pull("/job/sub/b"), b)
            assert [s.name for s in await c.snapshots("/job")] == ["e1"]
            await c.push("/job/a", np.ones_like(a))  # the restored file is live and writable
            assert np.array_equal(await c.pull("/job/a"), a + 1)
            assert np.array_equal(await c.pull("/job/.snapshots/e1/a"), a)

            await c.snapshot("/job/a", "f1")  # one file
            await c.push("/job/a", np.ones_like(a))
            await c.restore_snapshot("/job/a", "f1")
            assert np.array_equal(await c.pull("/job/a"), a + 1)

            await c.clone_snapshot("/job", "e1", "/copy")
            assert sorted(await c.listdir("/copy")) == ["a", "sub"]
            await c.push("/copy/a", np.full_like(a, 5))
            assert np.array_equal(await c.pull("/copy/a"), a + 5)
            assert np.array_equal(await c.pull("/job/.snapshots/e1/a"), a)
            assert np.array_equal(await c.pull("/job/a"), a + 1)
            with pytest.raises(Exists):
                await c.clone_snapshot("/job", "e1", "/copy")

    trio.run(go)
    irdma_cli("snapshot", "restore", "--meta", cl.meta_url, "/job", "e1")
    irdma_cli("snapshot", "clone", "--meta", cl.meta_url, "/job", "e1", "/copy2")
    bad = irdma_cli("snapshot", "restore", "--meta", cl.meta_url, "/job", "nope", check=False)
    assert bad.returncode == 1 and "no snapshot named 'nope'" in bad.stderr and "irdma snapshot list" in bad.stderr

    async def check() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            assert np.array_equal(await c.pull("/job/a"), a) and np.array_equal(await c.pull("/copy2/sub/b"), b)

    trio.run(check)
    out = irdma_cli("gc", "--dry-run", "--meta", cl.meta_url).stdout
    assert "0 leaked chunks" in out, out


def fsx_with_snapshots(meta_url: str, transport: str, seed: int, ops: int = 200) -> int:
    """fsx's manner (random writes, adds and truncates mirrored in memory) on a live file with a
    snapshot at random points: every snapshot, read back at the end and some along the way,
    must equal the mirror at its point, and the live file the mirror. Returns the snapshots
    taken. Used on TCP here and on verbs in the VM stage (tests/test_verbs.py)."""
    import random

    rng = random.Random(seed)
    max_size, path = 16 * CHUNK, f"/fsx{seed}"

    async def go() -> int:
        async with irdma.Client.open(meta_url, transport=transport) as c:
            mirror = bytearray()
            await c.write(path, b"", chunk_size=CHUNK)
            taken: dict[str, bytes] = {}
            for i in range(ops):
                r = rng.random()
                if r < 0.5:
                    n = rng.randrange(1, 3 * CHUNK)
                    off = rng.randrange(0, max_size - n)
                    data = rng.randbytes(n)
                    await c.write(path, data, off, op="assign")
                    mirror[len(mirror):] = bytes(max(0, off - len(mirror)))
                    mirror[off : off + n] = data
                elif r < 0.7 and len(mirror) >= 8:
                    k = rng.randrange(1, len(mirror) // 4 + 1)
                    off = 4 * rng.randrange(0, len(mirror) // 4 - k + 1)
                    delta = np.asarray([rng.randrange(-3, 4) for _ in range(k)], "<f4")
                    await c.write(path, delta, off, op="add")
                    with np.errstate(all="ignore"):  # random bytes hold NaNs and infinities: IEEE-754 as the shards
                        cur = np.frombuffer(bytes(mirror[off : off + 4 * k]), "<f4") + delta
                    mirror[off : off + 4 * k] = cur.astype("<f4").tobytes()
                elif r < 0.82:
                    size = rng.randrange(0, max_size)
                    await c.truncate(path, size)
                    mirror[size:] = b""
                    mirror[len(mirror):] = bytes(size - len(mirror))
                elif r < 0.92:
                    name = f"s{i}"
                    await c.snapshot(path, name)
                    taken[name] = bytes(mirror)
                elif taken:
                    name = rng.choice(sorted(taken))
                    assert bytes(await c.read(f"/.snapshots/{name}/{path[1:]}")) == taken[name], f"seed {seed} op {i}: {name}"
                assert (await c.stat(path)).size == len(mirror), f"seed {seed} op {i}"
            assert bytes(await c.read(path)) == bytes(mirror), f"seed {seed}: the live file"
            for name, want in taken.items():
                assert bytes(await c.read(f"/.snapshots/{name}/{path[1:]}")) == want, f"seed {seed}: snapshot {name}"
            for name in taken:
                await c.delete_snapshot(path, name)
            return len(taken)

    return trio.run(go)


def test_fsx_with_snapshots(cl: Cluster) -> None:
    assert fsx_with_snapshots(cl.meta_url, "tcp", seed=1) >= 10


def test_one_replica_per_chunk(tmp_path: str) -> None:
    """With fewer replicas than shards, a snapshot's copy, a restore and a clone find their
    chunks where the clone made them (placed as the live file, not by their own inode number)."""
    with running_cluster(str(tmp_path / "c1"), shards=2, replicas=1) as c:  # type: ignore[operator]
        async def go() -> None:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.makedirs("/job")
                w = np.arange(2048, dtype="<f4")  # 2 chunks of 4 KiB, one on each shard
                await cl.write("/job/w", w, chunk_size=4096)
                await cl.snapshot("/job", "s1")
                await cl.write("/job/w", w + 1)
                assert np.array_equal(await cl.pull("/job/.snapshots/s1/w"), w)
                await cl.clone_snapshot("/job", "s1", "/copy")
                assert np.array_equal(await cl.pull("/copy/w"), w)
                await cl.restore_snapshot("/job", "s1")
                assert np.array_equal(await cl.pull("/job/w"), w)
                await cl.write("/job/w", w + 2)
                assert np.array_equal(await cl.pull("/job/w"), w + 2)
                assert np.array_equal(await cl.pull("/job/.snapshots/s1/w"), w)

        trio.run(go)


def test_two_snapshots_at_once_through_one_client_are_both_made_and_exact(cl: Cluster) -> None:
    """Two snapshots of two directories taken at the same time by one client (as two ``mkdir
    .snapshots/NAME`` through one mount): one cut uses the client's kept snapshot connections,
    the other connections of its own; both are made, each exact."""
    a0, b0 = np.arange(4 * CHUNK // 4, dtype="<f4"), np.full(4 * CHUNK // 4, 3.0, "<f4")

    async def go() -> None:
        async with irdma.Client.open(cl.meta_url, transport="tcp") as c:
            await c.makedirs("/a")
            await c.makedirs("/b")
            await c.write("/a/w", a0, chunk_size=CHUNK)
            await c.write("/b/w", b0, chunk_size=CHUNK)
            made = []

            async def snap(d: str) -> None:
                made.append((await c.snapshot(d, "s")).state)

            for _ in range(3):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(snap, "/a")
                    nursery.start_soon(snap, "/b")
                await c.push("/a/w", np.ones_like(a0))
                await c.push("/b/w", np.ones_like(b0))
                assert np.array_equal(await c.pull("/a/.snapshots/s/w"), a0)
                assert np.array_equal(await c.pull("/b/.snapshots/s/w"), b0)
                await c.delete_snapshot("/a", "s")
                await c.delete_snapshot("/b", "s")
                np.add(a0, 1, out=a0)
                np.add(b0, 1, out=b0)
            assert made == ["ready"] * 6
            assert sorted(c.pool.snapshot_conns) == [1, 2] and not c.pool.snapshot_lock.locked()

    trio.run(go)
