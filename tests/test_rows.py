"""Sparse rows through the native client (ps-lite's sparse pull and push): random row ids
with duplicates against numpy, on real shard processes with one and two replicas; the shape
xattr; refused input changes nothing (a lost chunk: test_faults.py); and the mount's own sparse
path (pread/pwrite of rows) agrees with the client's."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Cluster, meta_calls, mounted, running_cluster

import irdma

ROW = 256  # float32 per row
CHUNK = 1 << 20


@pytest.fixture(scope="module", params=[1, 2], ids=["one-replica", "two-replicas"])
def rows_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("rows")), shards=3, capacity=64 << 20,
                         replicas=request.param) as c:
        yield c


def _table(rng: np.random.Generator, nrows: int, cols: int = ROW) -> np.ndarray:
    return (rng.integers(-1000, 1000, size=(nrows, cols)) / 4).astype("<f4")  # sums of these stay exact


@pytest.mark.parametrize("cols", [ROW, 250])  # rows that tile a chunk, rows that cross chunk boundaries
def test_pull_and_push_rows_with_duplicates_match_numpy(rows_cluster: Cluster, cols: int) -> None:
    rng = np.random.default_rng(cols)
    nrows = 5000  # 5 MB: chunks on every shard
    path = f"/emb-{cols}"
    with irdma.connect(rows_cluster.meta_url, transport="tcp") as c:
        table = _table(rng, nrows, cols)
        c.write(path, table, chunk_size=CHUNK)
        c.set_shape(path, (nrows, cols))

        ids = rng.integers(0, nrows, size=3000)  # duplicates, any order
        np.testing.assert_array_equal(c.pull_rows(path, ids), table[ids])

        delta = (rng.integers(-64, 64, size=(len(ids), cols)) / 8).astype("<f4")
        c.push_rows(path, ids, delta, op="add")
        np.add.at(table, ids, delta)
        np.testing.assert_array_equal(c.pull(path).reshape(nrows, cols), table)

        # assign: duplicates are summed first, and their sum is what lands
        few = np.array([7, 3, 7, nrows - 1], dtype=np.int64)
        vals = (rng.integers(-8, 8, size=(4, cols))).astype("<f4")
        c.push_rows(path, few, vals, op="assign")
        table[3], table[7], table[nrows - 1] = vals[1], vals[0] + vals[2], vals[3]
        np.testing.assert_array_equal(c.pull(path).reshape(nrows, cols), table)
        np.testing.assert_array_equal(c.pull_rows(path, [nrows - 1, 0, 3]), table[[nrows - 1, 0, 3]])
        assert c.pull_rows(path, []).shape == (0, cols)
        c.unlink(path)


def test_push_rows_with_the_files_optimizer_steps_only_those_rows(rows_cluster: Cluster) -> None:
    rng = np.random.default_rng(3)
    with irdma.connect(rows_cluster.meta_url, transport="tcp") as c:
        table = rng.standard_normal((2000, ROW)).astype("<f4")
        c.write("/emb-sgd", table, chunk_size=CHUNK)
        c.set_shape("/emb-sgd", table.shape)
        c.set_update_op("/emb-sgd", "sgd learning_rate=0.25")
        ids = rng.choice(2000, size=300, replace=False)
        grad = rng.standard_normal((300, ROW)).astype("<f4")
        c.push_rows("/emb-sgd", ids, grad)  # the file's op
        table[ids] -= grad * np.float32(0.25)
        np.testing.assert_array_equal(c.pull("/emb-sgd").reshape(table.shape), table)
        c.unlink("/emb-sgd")


def test_set_shape_sizes_a_table_and_bad_input_changes_nothing(rows_cluster: Cluster) -> None:
    with irdma.connect(rows_cluster.meta_url, transport="tcp") as c:
        with pytest.raises(irdma.InvalidArgument, match="dimensions"):
            c.set_shape("/emb-new", (1000.5, ROW))  # type: ignore[arg-type]
        assert "emb-new" not in c.listdir("/")  # refused before anything was made
        c.set_shape("/emb-new", (1000, ROW))  # a table of 1000 rows, all zeros
        assert c.stat("/emb-new").size == 1000 * ROW * 4
        c.push_rows("/emb-new", [900, 10], np.ones((2, ROW), "<f4"), op="add")
        assert c.stat("/emb-new").size == 1000 * ROW * 4  # a push never changes the size
        got = c.pull("/emb-new").reshape(1000, ROW)
        assert got[900].tolist() == [1.0] * ROW and got[10].tolist() == [1.0] * ROW
        assert not got[np.r_[0:10, 11:900, 901:1000]].any()  # the other rows read as zeros
        np.testing.assert_array_equal(c.pull_rows("/emb-new", [999, 900]), got[[999, 900]])
        before = c.read("/emb-new")
        with pytest.raises(irdma.InvalidArgument, match="past the last row"):
            c.push_rows("/emb-new", [1000], np.ones((1, ROW), "<f4"))
        with pytest.raises(irdma.InvalidArgument, match="negative"):
            c.push_rows("/emb-new", [-1], np.ones((1, ROW), "<f4"))
        with pytest.raises(irdma.InvalidArgument, match="values"):
            c.push_rows("/emb-new", [1, 2], np.ones((1, ROW), "<f4"))
        with pytest.raises(irdma.InvalidArgument, match="past the end"):
            c.pull_rows("/emb-new", [1000])
        with pytest.raises(irdma.InvalidArgument, match="integers"):
            c.pull_rows("/emb-new", [1.5])
        with pytest.raises(irdma.InvalidArgument, match="disagrees"):
            c.pull_rows("/emb-new", [1], row_len=ROW + 1)
        with pytest.raises(irdma.InvalidArgument, match="dimensions"):
            c.set_shape("/emb-new", (0, ROW))
        assert c.read("/emb-new") == before
        c.write("/plain", np.zeros(4 * ROW, "<f4"))
        with pytest.raises(irdma.InvalidArgument, match="row_len"):
            c.pull_rows("/plain", [1])
        np.testing.assert_array_equal(c.pull_rows("/plain", [3], row_len=ROW), np.zeros((1, ROW), "<f4"))
        c.unlink("/emb-new")
        c.unlink("/plain")


def test_concurrent_pushes_of_many_workers_into_a_fresh_table_all_land(rows_cluster: Cluster) -> None:
    """ps-lite's pattern: workers push rows into a table just made by set_shape, at once; every
    push lands (none is undone by another's bookkeeping), with overlapping ids summed."""
    import trio

    rng = np.random.default_rng(21)
    pushes = [rng.integers(0, 3000, size=400) for _ in range(12)]

    async def main() -> None:
        async with irdma.Client.open(rows_cluster.meta_url, transport="tcp") as c:
            await c.set_shape("/emb-con", (3000, ROW))
            async with trio.open_nursery() as nursery:
                for ids in pushes:
                    nursery.start_soon(lambda ids=ids: c.push_rows("/emb-con", ids, np.ones((len(ids), ROW), "<f4"),
                                                                   op="add"))
            got = await c.pull("/emb-con", shape=(3000, ROW))
            want = np.zeros(3000, "<f4")
            for ids in pushes:
                np.add.at(want, ids, 1)
            np.testing.assert_array_equal(got, np.repeat(want[:, None], ROW, axis=1))
            await c.unlink("/emb-con")

    trio.run(main)


def test_rows_through_the_mount_agree_with_the_client(rows_cluster: Cluster, tmp_path: object) -> None:
    """The mount's sparse path: a pread per row (the documented way) sees what push_rows
    wrote, and a pwrite per row is what pull_rows reads."""
    rng = np.random.default_rng(11)
    with irdma.connect(rows_cluster.meta_url, transport="tcp") as c:
        table = _table(rng, 3000)
        c.write("/emb-mnt", table, chunk_size=CHUNK)
        c.set_shape("/emb-mnt", table.shape)
        ids = rng.choice(3000, size=200, replace=False)
        delta = np.ones((200, ROW), "<f4")
        c.push_rows("/emb-mnt", ids, delta, op="add")
        table[ids] += delta
        with mounted(rows_cluster.meta_url, str(tmp_path) + "/m") as m:
            fd = os.open(m + "/emb-mnt", os.O_RDWR)
            try:
                rb = ROW * 4
                for i in ids[:50].tolist():
                    np.testing.assert_array_equal(np.frombuffer(os.pread(fd, rb, i * rb), "<f4"), table[i])
                new = np.full(ROW, 2.5, "<f4")
                for i in ids[:20].tolist():
                    assert os.pwrite(fd, new.tobytes(), i * rb) == rb
                    table[i] = new
                os.fsync(fd)
            finally:
                os.close(fd)
        np.testing.assert_array_equal(c.pull_rows("/emb-mnt", ids), table[ids])
        c.unlink("/emb-mnt")



def test_pulls_and_pushes_by_path_spare_the_metadata_and_still_see_every_change(rows_cluster: Cluster) -> None:
    """A training loop's pulls and pushes by path make no metadata call in the steady state
    (the table is read at most once a TABLE_CACHE_S, issue 40), and the cache is never seen:
    another client's growth of the table is there for the next pull of a new row; its
    replacement of the table (other bytes, same path) within the second; this client's own
    replacement at once."""
    import time

    from irdma.client.sparse import TABLE_CACHE_S

    rng = np.random.default_rng(40)
    path = "/emb-cached"
    with irdma.connect(rows_cluster.meta_url, transport="tcp") as a, \
            irdma.connect(rows_cluster.meta_url, transport="tcp") as b:
        table = _table(rng, 1000)
        a.write(path, table, chunk_size=256 << 10)  # 1 MB: chunks on every shard
        a.set_shape(path, (1000, ROW))
        ids = rng.integers(0, 1000, size=300)
        np.testing.assert_array_equal(a.pull_rows(path, ids), table[ids])  # reads the table

        calls, t0, steps = meta_calls(), time.monotonic(), 30
        for _ in range(steps):
            ids = rng.integers(0, 1000, size=300)
            np.testing.assert_array_equal(a.pull_rows(path, ids), table[ids])
            delta = (rng.integers(-64, 64, size=(len(ids), ROW)) / 8).astype("<f4")
            a.push_rows(path, ids, delta, op="add")
            np.add.at(table, ids, delta)
        # at most one table read (2 calls) and one mtime refresh per TABLE_CACHE_S, against 7 calls a step before
        seconds = time.monotonic() - t0
        assert meta_calls() - calls <= 3 * (seconds / TABLE_CACHE_S + 1) < 7 * steps
        np.testing.assert_array_equal(b.pull(path).reshape(1000, ROW), table)

        # another client grows the table: the next pull of a new row has it at once
        grown = np.concatenate([table, _table(rng, 500)])
        b.write(path, grown[1000:], offset=table.nbytes)
        b.set_shape(path, (1500, ROW))
        np.testing.assert_array_equal(a.pull_rows(path, [1499, 3, 1200]), grown[[1499, 3, 1200]])
        a.push_rows(path, [1499], np.ones((1, ROW), "<f4"), op="add")
        grown[1499] += 1
        np.testing.assert_array_equal(b.pull_rows(path, [1499]), grown[[1499]])

        # another client replaces it (other bytes at the same path): seen within the second
        other = _table(rng, 1500)
        b.unlink(path)
        b.write(path, other, chunk_size=256 << 10)
        b.set_shape(path, (1500, ROW))
        deadline = time.monotonic() + TABLE_CACHE_S + 5
        while not np.array_equal(a.pull_rows(path, [0, 777, 1499]), other[[0, 777, 1499]]):
            assert time.monotonic() < deadline, "a pull still saw the replaced table"
        # this client replaces it: its next pull and push act on the new table
        mine = _table(rng, 1500)
        a.unlink(path)
        a.write(path, mine, chunk_size=256 << 10)
        a.set_shape(path, (1500, ROW))
        np.testing.assert_array_equal(a.pull_rows(path, [0, 777, 1499]), mine[[0, 777, 1499]])
        a.push_rows(path, [777], np.ones((1, ROW), "<f4"), op="add")
        mine[777] += 1
        np.testing.assert_array_equal(b.pull(path).reshape(1500, ROW), mine)
        a.unlink(path)


@pytest.mark.parametrize("op", ["add", "sgd learning_rate=0.5"])
def test_a_scatter_the_shard_cannot_hold_changes_nothing(op: str) -> None:
    """A SCATTER over three chunks whose third finds no room: NoSpace, and no chunk was stepped
    or left behind (the shard makes every chunk and optimizer state first, then applies)."""
    from irdma.server.shard import Region, Shard, split_extents

    from irdma.wire import protocol as P
    from irdma.wire.optimizers import parse_update

    shard = Shard(1, Region(2 * CHUNK + (64 << 10)))  # room for two chunks and their states
    shard.write(7, 0, CHUNK, 0, P.UpdateOp.ASSIGN, np.ones(CHUNK // 4, "<f4").tobytes())
    before = (shard.snapshot(7, 0), shard.used, shard.chunk_count)
    end = CHUNK - 1024  # each chunk's last 1 KiB: a new one takes its whole extent
    ext = P.extents([0, 1, 2], [end, end, end], [1024, 1024, 1024])
    update = parse_update(op)
    parts = split_extents(ext, CHUNK, update, 3 * 1024)
    with pytest.raises(irdma.NoSpace):
        shard.scatter(7, CHUNK, parts, update, np.ones(3 * 256, "<f4").tobytes())
    assert (shard.snapshot(7, 0), shard.used, shard.chunk_count) == before
