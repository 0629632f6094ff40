"""Space follows the bytes (issue 39, item 1): a small file holds an extent sized to what was
written, not a whole chunk, and its extent grows as the file grows.

Through real shard processes (``irdma up`` clusters on data directories) and the native client,
checked as a user checks: the shards' STAT (what `irdma status` sums as "used"), the bytes read
back from each replica, a snapshot and copy-on-write, a SIGKILL and restart, a drain, gc, a full
cluster, and the place a LOCATE (the verbs transport's one-sided path) gives out.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import trio
from helpers import RawShard, irdma_cli, running_cluster, wait_until

import irdma
from irdma.client.view import layout_of
from irdma.ops import cluster
from irdma.ops._proc import pid_alive
from irdma.transport.base import ShardConnection
from irdma.wire import protocol as P
from irdma.wire.auth import read_key_file

pytestmark = [pytest.mark.slow]

KB = 1 << 10
MB = 1 << 20
PAGE = 4 * KB
CHUNK = 4 * MB  # the default chunk size


async def _used(cl: irdma.Client) -> dict[int, int]:
    return {rec.shard_id: st.used for rec, st, _ in await cl.shard_stats() if st is not None}


async def _replica_copies(cl: irdma.Client, path: str) -> list[bytes]:
    """The file's bytes as each replica holds them (replica r of every chunk, read from that shard)."""
    inode = await cl.stat(path)
    layout = layout_of(inode)
    n = -(-inode.size // layout.chunk_size)
    copies = []
    for r in range(layout.replicas):
        out = bytearray(inode.size)
        for idx in range(n):
            sid = cl.placed(layout, idx)[0][r]
            lo = idx * layout.chunk_size
            await cl.shard_call(sid, ShardConnection.read, inode.ino, idx, 0,
                                memoryview(out)[lo : min(inode.size, lo + layout.chunk_size)])
        copies.append(bytes(out))
    return copies


async def _write_all(cl: irdma.Client, files: dict[str, bytes]) -> None:
    limit = trio.CapacityLimiter(8)

    async def one(path: str, data: bytes) -> None:
        async with limit:
            await cl.write(path, data)

    async with trio.open_nursery() as nursery:
        for path, data in files.items():
            nursery.start_soon(one, path, data)


async def _used_becomes(cl: irdma.Client, want: int, timeout: float = 20.0) -> int:
    """The shards' used bytes in all, once they reach ``want`` (or at the deadline)."""
    deadline = trio.current_time() + timeout
    while True:
        used = sum((await _used(cl)).values())
        if used == want or trio.current_time() > deadline:
            return used
        await trio.sleep(0.1)  # the shards free them within a second of the SYNC (their trim loop)


def test_a_thousand_4k_files_on_two_replicas_hold_8_mib_not_8_gib(tmp_path: object) -> None:
    """1,000 files of 4 KiB, 2 replicas, default 4 MiB chunks: the shards hold 4 KiB per file
    per replica (8000 KiB in all, <= 64 MiB; whole chunks took 8 GiB: NoSpace after 16 files of
    these 64 MiB shards), `irdma status` is healthy, and the files read back exact."""
    rng = np.random.default_rng(39)
    files = {f"/f{k}": rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for k in range(1000)}
    with running_cluster(str(tmp_path / "c"), shards=2, capacity=64 * MB) as c:  # type: ignore[operator]
        async def run() -> dict[int, int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await _write_all(cl, files)
                for path in ("/f0", "/f500", "/f999"):
                    assert bytes(await cl.read(path)) == files[path]
                    assert await _replica_copies(cl, path) == [files[path]] * 2
                return await _used(cl)

        used = trio.run(run)
        assert sum(used.values()) == 1000 * PAGE * 2 <= 64 * MB, used
        status = json.loads(irdma_cli("status", "--json", "--meta", c.meta_url).stdout)  # what an operator reads
        assert (status["bytes_held"], status["bytes_in_files"]) == (1000 * PAGE * 2, 1000 * PAGE), status


def test_a_file_grown_in_small_appends_reads_back_exact_from_each_replica(tmp_path: object) -> None:
    """A file that grows from 4 KiB to 10 MiB in appends of a few KiB to 300 KiB reads back
    byte-exact from each replica. Once fsynced, each replica holds the extents of its bytes:
    4 + 4 + 2 MiB (the extents its chunks grew out of are free again), not 3 whole chunks."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 10 * MB, dtype=np.uint8).tobytes()
    with running_cluster(str(tmp_path / "c"), shards=2, capacity=64 * MB) as c:  # type: ignore[operator]
        async def run() -> tuple[list[bytes], int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                pos = 4 * KB
                await cl.write("/grow", data[:pos])
                while pos < len(data):
                    n = min(len(data) - pos, int(rng.integers(1, 300 * KB)))
                    await cl.write("/grow", data[pos : pos + n], offset=pos)
                    pos += n
                assert bytes(await cl.read("/grow")) == data
                copies = await _replica_copies(cl, "/grow")
                await cl.flush()  # fsync: the moves are durable, the extents grown out of come back
                return copies, await _used_becomes(cl, 2 * 10 * MB)

        copies, used = trio.run(run)
        assert copies == [data, data]
        assert used == 2 * (4 + 4 + 2) * MB, used


def test_small_files_through_a_snapshot_and_copy_on_write(tmp_path: object) -> None:
    """20 files of 4 KiB and a snapshot of them (sharing their extents: no byte more held); then
    half are overwritten in place (each copied on write to a 4 KiB extent of its own) and half
    grown to 14 KiB past the shared extent (each moved alone to a 16 KiB one). The snapshot keeps
    the old bytes, the files have the new ones on both replicas, and the shards hold just that."""
    old = {f"/d/f{k}": bytes([k]) * PAGE for k in range(20)}
    new = {p: (b"N" * 100 + b[100:] if k % 2 == 0 else b + b"G" * 10 * KB) for k, (p, b) in enumerate(old.items())}
    with running_cluster(str(tmp_path / "c"), shards=2, capacity=64 * MB) as c:  # type: ignore[operator]
        async def run() -> tuple[int, int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.makedirs("/d")
                await _write_all(cl, old)
                await cl.snapshot("/d", "s")
                shared = sum((await _used(cl)).values())
                for k, path in enumerate(old):
                    await cl.write(path, new[path][:100] if k % 2 == 0 else new[path][PAGE:],
                                   offset=0 if k % 2 == 0 else PAGE)
                for path in old:
                    assert bytes(await cl.read(f"/d/.snapshots/s/{os.path.basename(path)}")) == old[path], path
                    assert await _replica_copies(cl, path) == [new[path]] * 2, path
                return shared, sum((await _used(cl)).values())

        shared, parted = trio.run(run)
        assert shared == 2 * 20 * PAGE
        assert parted == 2 * (20 * PAGE + 10 * PAGE + 10 * 16 * KB), parted


def test_small_files_and_grown_ones_survive_a_sigkill_of_every_shard(tmp_path: object) -> None:
    """Small files, and one grown to 1 MiB in appends with no fsync (its moves to bigger
    extents are in the shards' moves journals only): SIGKILL every shard, `irdma up` again on
    the data directories; every file reads back exact from each replica and the shards hold
    the extents of the bytes (4 KiB a small file, 1 MiB the grown one, per replica)."""
    d = str(tmp_path / "c")  # type: ignore[operator]
    small = {f"/s{k}": os.urandom(100 + 37 * k) for k in range(50)}
    grown = os.urandom(MB)
    url = cluster.up(d, 2, 64 * MB)
    try:
        async def write() -> None:
            async with irdma.Client.open(url, transport="tcp") as cl:
                await _write_all(cl, small)
                for pos in range(0, MB, 48 * KB):
                    await cl.write("/grown", grown[pos : pos + 48 * KB], offset=pos)

        trio.run(write)
        for s in cluster.read_state(d):
            os.kill(s.pid, signal.SIGKILL)
        for s in cluster.read_state(d):
            wait_until(lambda s=s: not pid_alive(s.pid), 10, "the shard to die")
        irdma_cli("up", "--dir", d)

        async def check() -> int:
            async with irdma.Client.open(url, transport="tcp") as cl:
                for path, data in [*small.items(), ("/grown", grown)]:
                    assert await _replica_copies(cl, path) == [data, data], path
                return sum((await _used(cl)).values())

        assert trio.run(check) == 2 * (50 * PAGE + MB)
    finally:
        cluster.down(d)


def test_a_drain_and_gc_keep_small_files_small(tmp_path: object) -> None:
    """3 shards, 2 replicas: 100 files of 4 KiB, and 10 leaked 4 KiB chunks of no file written
    straight to shard 1. `irdma gc` frees the leaked ones (40 KiB); draining shard 1 copies each
    small chunk as its 4 KiB (a whole-chunk copy carries the extent's bytes: protocol 12), so the
    two shards left hold 4 KiB per file per replica and every file reads back exact."""
    files = {f"/f{k}": os.urandom(PAGE) for k in range(100)}
    with running_cluster(str(tmp_path / "c"), shards=3, capacity=64 * MB, replicas=2) as c:  # type: ignore[operator]
        async def write() -> int:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await _write_all(cl, files)
                held = sum((await _used(cl)).values())
                for k in range(10):  # leaked: a file id no inode has
                    await cl.shard_call(1, ShardConnection.write, 1 << 40, k, CHUNK, 0, P.UpdateOp.ASSIGN, b"L" * PAGE)
                assert sum((await _used(cl)).values()) == held + 10 * PAGE
                return held

        held = trio.run(write)
        assert held == 100 * PAGE * 2
        res = irdma_cli("gc", "--meta", c.meta_url)
        assert "10 leaked chunks" in res.stdout, res.stdout
        res = irdma_cli("shard", "drain", "1", "--meta", c.meta_url, check=False)
        assert res.returncode == 0, res.stdout + res.stderr

        async def after() -> dict[int, int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                for path, data in files.items():
                    assert await _replica_copies(cl, path) == [data, data], path
                return await _used(cl)

        used = trio.run(after)
        assert used[2] + used[3] == 100 * PAGE * 2, used


def test_a_full_cluster_answers_enospc_and_keeps_every_byte(tmp_path: object) -> None:
    """Shards of 256 KiB, 2 replicas: 64 files of 4 KiB fill them; the next file is refused
    with NoSpace (ENOSPC on a mount), and so is an append that would grow a file past its
    4 KiB extent; neither leaves a byte or a changed size behind. Deleting a file makes room."""
    files = {f"/f{k}": os.urandom(PAGE) for k in range(64)}
    with running_cluster(str(tmp_path / "c"), shards=2, capacity=256 * KB) as c:  # type: ignore[operator]
        async def run() -> None:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await _write_all(cl, files)
                full = await _used(cl)
                assert full == {1: 256 * KB, 2: 256 * KB}
                with pytest.raises(irdma.NoSpace):
                    await cl.write("/more", b"m" * PAGE)
                with pytest.raises(irdma.NoSpace):
                    await cl.write("/f3", b"g" * 100, offset=PAGE)  # grows past its extent
                assert await _used(cl) == full
                assert (await cl.stat("/more")).size == 0 and (await cl.stat("/f3")).size == PAGE
                assert await _replica_copies(cl, "/f3") == [files["/f3"]] * 2
                await cl.unlink("/f0")
                await cl.write("/more", b"m" * PAGE)
                assert bytes(await cl.read("/more")) == b"m" * PAGE

        trio.run(run)


def test_a_located_chunk_holds_its_whole_size_and_never_moves(tmp_path: object) -> None:
    """LOCATE gives a client the chunk's place for one-sided RDMA READs of any byte of it: the
    chunk grows to its whole size first (a 4 KiB file's 4 KiB extent would end where another
    chunk's bytes begin), and an append after that leaves it where it was (a cached place is
    never stale by growth)."""
    with running_cluster(str(tmp_path / "c"), shards=1, capacity=64 * MB, replicas=1) as c:  # type: ignore[operator]
        async def write(data: bytes, offset: int, want: int) -> tuple[int, int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.write("/f", data, offset=offset)
                await cl.flush()  # the 4 KiB extent a LOCATE grew it out of is free again
                return (await cl.stat("/f")).ino, await _used_becomes(cl, want)

        ino, used = trio.run(write, b"a" * PAGE, 0, PAGE)
        assert used == PAGE
        raw = RawShard(c.shards[0].address, read_key_file(cluster.key_file_of(c.dir)))
        try:
            raw.request(P.Locate(ino, 0), 1)
            first = raw.reply()
            assert isinstance(first, P.LocateReply) and first.exists and first.chunk_size == CHUNK, first
            assert trio.run(write, b"b" * MB, PAGE, CHUNK)[1] == CHUNK
            raw.request(P.Locate(ino, 0), 2)
            again = raw.reply()
            assert isinstance(again, P.LocateReply) and again.region_offset == first.region_offset, (first, again)
        finally:
            raw.close()


def test_a_format_1_data_directory_opens_upgraded_and_a_newer_one_is_refused(tmp_path: object) -> None:
    """A data directory of format 1 (every extent a whole chunk; its index has no extent column)
    opens with its chunks whole and their bytes, is format 2 from then on (an irdma of format 1
    refuses it), and takes small extents for new chunks; a directory of a format this irdma does
    not know is refused with what to do."""
    import json
    import sqlite3

    from irdma.server.shard import Region, Shard
    from irdma.server.store import ShardStore

    path = str(tmp_path / "s")  # type: ignore[operator]
    data = os.urandom(MB)
    store = ShardStore(path, 1, 16 * MB)
    shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    shard.write(7, 0, MB, 0, P.UpdateOp.ASSIGN, data)  # a whole chunk: what format 1 holds
    del shard
    store.close()
    db = sqlite3.connect(os.path.join(path, "chunks.db"))  # the index as format 1 made it
    db.executescript("CREATE TABLE old(file INTEGER NOT NULL, idx INTEGER NOT NULL, offset INTEGER NOT NULL,"
                     " size INTEGER NOT NULL, PRIMARY KEY(file, idx));"
                     " INSERT INTO old SELECT file, idx, offset, size FROM chunks; DROP TABLE chunks;"
                     " ALTER TABLE old RENAME TO chunks;")
    db.close()
    info_path = os.path.join(path, "shard.json")
    with open(info_path) as f:
        info = json.load(f)
    with open(info_path, "w") as f:
        json.dump({**info, "format": 1}, f)

    store = ShardStore(path, 1, None)
    shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    assert bytes(shard.read(7, 0, 0, MB)[1]) == data and shard.used == MB  # type: ignore[arg-type]
    shard.write(8, 0, MB, 0, P.UpdateOp.ASSIGN, b"s" * 10)
    assert shard.used == MB + PAGE
    del shard
    store.close()
    with open(info_path) as f:
        assert json.load(f)["format"] == 2
    with open(info_path, "w") as f:
        json.dump({**info, "format": 3}, f)
    with pytest.raises(irdma.IrdmaError, match="data format 3; this irdma reads formats 1, 2") as exc:
        ShardStore(path, 1, None)
    assert exc.value.hint
