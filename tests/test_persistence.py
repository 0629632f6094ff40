"""Persistent shards: chunks kept in each shard's data directory survive a restart.

Through real shard processes, a real mount and the CLI: write files (assign and add), stop
the cluster (or SIGKILL its shards), start it again on the same directory, and read every
byte back bit-exact; a dead shard alone is restarted on its data; `irdma destroy` removes it.
"""

from __future__ import annotations

import hashlib
import os
import signal

import numpy as np
import pytest
from helpers import irdma_cli, mounted, wait_until
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore

from irdma.ops import cluster
from irdma.ops._proc import pid_alive
from irdma.wire.protocol import UpdateOp

MB = 1 << 20


def _write_model(m: str) -> dict[str, str]:
    """An assign file and an add file (pushed several times) through the mount; their sha256."""
    os.makedirs(os.path.join(m, "model"))
    weights = os.urandom(9 * MB + 12345)
    with open(os.path.join(m, "model/weights.bin"), "wb") as f:
        f.write(weights)
    with open(os.path.join(m, "model/bias.f32"), "wb") as f:
        f.write(np.zeros(300_000, "<f4").tobytes())
    os.setxattr(os.path.join(m, "model/bias.f32"), "user.irdma.update", b"add")
    for k in range(1, 4):
        with open(os.path.join(m, "model/bias.f32"), "r+b") as f:
            f.write(np.full(300_000, k, "<f4").tobytes())
    expect_bias = np.full(300_000, 6, "<f4").tobytes()
    return {"model/weights.bin": hashlib.sha256(weights).hexdigest(),
            "model/bias.f32": hashlib.sha256(expect_bias).hexdigest()}


def _digests(m: str, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        with open(os.path.join(m, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.long  # 30 s: make test-long (CI's time)
@pytest.mark.fuse
@pytest.mark.slow
def test_down_then_up_and_killed_shards_bring_back_every_file(tmp_path: object) -> None:
    d = os.path.join(str(tmp_path), "c")
    url = cluster.up(d, 2, 64 * MB)
    try:
        with mounted(url, os.path.join(str(tmp_path), "m1")) as m:
            expect = _write_model(m)
            assert _digests(m, list(expect)) == expect
        irdma_cli("down", "--dir", d)
        assert not any(pid_alive(s.pid) for s in cluster.read_state(d))
        res = irdma_cli("up", "--dir", d)
        assert "restarted shard" in res.stderr
        with mounted(url, os.path.join(str(tmp_path), "m2")) as m:
            assert _digests(m, list(expect)) == expect
            # SIGKILL every shard (no clean shutdown): the page cache keeps their files
            for s in cluster.read_state(d):
                os.kill(s.pid, signal.SIGKILL)
            for s in cluster.read_state(d):
                wait_until(lambda s=s: not pid_alive(s.pid), 10, "the shard to die")
            irdma_cli("up", "--dir", d)
            assert _digests(m, list(expect)) == expect
            # the shards kept their incarnation: nothing is reported lost
            assert irdma_cli("status", "--meta", url, check=False).returncode == 0
            # one dead shard: `up` restarts just that one
            before = cluster.read_state(d)
            os.kill(before[1].pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(before[1].pid), 10, "the shard to die")
            res = irdma_cli("up", "--dir", d)
            after = cluster.read_state(d)
            assert after[0].pid == before[0].pid and after[1].pid != before[1].pid
            assert f"restarted shard {before[1].shard_id}" in res.stderr
            assert _digests(m, list(expect)) == expect
            with open(os.path.join(m, "model/bias.f32"), "r+b") as f:  # and it takes new pushes
                f.write(np.ones(300_000, "<f4").tobytes())
            with open(os.path.join(m, "model/bias.f32"), "rb") as f:
                assert np.array_equal(np.frombuffer(f.read(), "<f4"), np.full(300_000, 7, "<f4"))
        res = irdma_cli("up", "--dir", d, check=False)
        assert res.returncode == 0 and "already runs" in res.stderr  # nothing to start: no error
    finally:
        irdma_cli("down", "--dir", d, check=False)
    res = irdma_cli("destroy", "--dir", d, check=False)  # asks; no answer on stdin: nothing removed
    assert res.returncode != 0 and os.path.exists(os.path.join(d, "meta.db"))
    irdma_cli("destroy", "--dir", d, "--yes")
    assert not os.path.exists(os.path.join(d, "meta.db")) and not os.path.exists(os.path.join(d, "shards"))


def test_a_shard_store_reopens_with_its_chunks_versions_and_incarnation(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "s")
    store = ShardStore(path, 3, 16 * MB)
    shard = Shard(3, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    data = os.urandom(MB)
    assert shard.write(7, 0, MB, 0, UpdateOp.ASSIGN, data) == 1
    shard.write(7, 2, MB, 0, UpdateOp.ASSIGN, b"x" * 4096)
    shard.write(8, 0, MB, 0, UpdateOp.ADD, np.ones(1024, "<f4").tobytes())
    shard.write(8, 0, MB, 0, UpdateOp.ADD, np.ones(1024, "<f4").tobytes())
    shard.free(7, 1)  # chunk 2 of file 7 goes: its extent is punched out of the file
    incarnation, used = shard.incarnation, shard.used
    shard.sync()
    del shard
    store.close()

    again = ShardStore(path, 3, None)
    shard = Shard(3, Region(again.capacity, buffer=memoryview(again.region)), memoryview(again.versions), store=again)
    assert shard.incarnation == incarnation and shard.used == used == MB + 4096  # file 8: one page written
    version, view = shard.read(7, 0, 0, MB)
    assert version == 1 and view is not None and bytes(view) == data
    version, view = shard.read(8, 0, 0, 4096)
    assert version == 2 and view is not None and np.array_equal(np.frombuffer(view, "<f4"), np.full(1024, 2, "<f4"))
    assert shard.read(7, 2, 0, 10) == (0, None)
    # the allocator knows what is taken: a new chunk does not overlap an old one
    shard.write(9, 0, MB, 0, UpdateOp.ASSIGN, b"y" * MB)
    assert bytes(shard.read(7, 0, 0, MB)[1]) == data  # type: ignore[arg-type]
    # the region file costs disk only for the chunks held (the freed one was punched out)
    blocks = os.stat(os.path.join(path, "region")).st_blocks * 512
    assert blocks <= 3 * MB + 64 * 1024
    del shard
    again.close()
    with pytest.raises(Exception, match="holds shard 3"):
        ShardStore(path, 4, None)
    with pytest.raises(Exception, match="not 8388608"):
        ShardStore(path, 3, 8 * MB)


def test_a_store_that_cannot_punch_zeroes_freed_extents(tmp_path: object) -> None:
    """RDMA-registered stores write zeros instead of punching holes; freed bytes still read 0."""
    store = ShardStore(os.path.join(str(tmp_path), "s"), 1, 4 * MB)
    store.punch = False
    shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    shard.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"\xff" * MB)
    shard.free(5, 0)
    shard.write(6, 0, MB, 10, UpdateOp.ASSIGN, b"a")  # reuses the freed extent
    version, view = shard.read(6, 0, 0, MB)
    assert view is not None and bytes(view) == bytes(10) + b"a" + bytes(MB - 11)
    del shard, view
    store.close()


def test_a_freed_extent_is_punched_by_trim_and_reads_zeros_when_taken_before(tmp_path: object) -> None:
    """Freed extents are zeroed (punched) by Shard.trim once old enough, not at once: the next
    copy-on-write copies take them resident (issue 23's step time). A chunk made on a freed
    extent before its trim still starts as zeros."""
    path = os.path.join(str(tmp_path), "s")
    store = ShardStore(path, 1, 8 * MB)
    shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
    region = os.path.join(path, "region")
    shard.write(5, 0, MB, 0, UpdateOp.ASSIGN, b"\xff" * MB)
    shard.write(5, 1, MB, 0, UpdateOp.ASSIGN, b"\xee" * MB)
    assert shard.free_files([5]) == 2 and shard.used == 0
    held = os.stat(region).st_blocks * 512
    assert held >= 2 * MB  # not punched yet
    assert shard.trim() == 0  # younger than TRIM_DELAY_S: kept
    shard.write(6, 0, MB, 10, UpdateOp.ASSIGN, b"a")  # takes a page of the first freed extent at once
    version, view = shard.read(6, 0, 0, MB)
    assert view is not None and bytes(view) == bytes(10) + b"a" + bytes(MB - 11)
    del view
    assert shard.trim(older_than=0) == 2 * MB - 4096  # only what is still free
    assert os.stat(region).st_blocks * 512 <= held - 2 * MB + 4096 + 64 * 1024
    assert bytes(store.region[4096 : 2 * MB]) == bytes(2 * MB - 4096)
    del shard
    store.close()


_DIES_AFTER_COPY_ON_WRITE = r"""
import os, sys
import numpy as np
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore
from irdma.wire.protocol import UpdateOp
MB = 1 << 20
store = ShardStore(sys.argv[1], 1, 16 * MB)
shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
for i in range(3):
    shard.write(7, i, MB, 0, UpdateOp.ASSIGN, np.full(MB // 4, i, "<f4").tobytes())
shard.clone(7, 100)  # an index transaction: the chunks above are in the index
for i in range(3):  # the first write after the clone moves each live key: journaled only
    shard.write(7, i, MB, 0, UpdateOp.ADD, np.ones(MB // 4, "<f4").tobytes())
shard.write(7, 1, MB, 0, UpdateOp.ADD, np.ones(MB // 4, "<f4").tobytes())  # in place now
shard.clone(7, 200)
shard.write(7, 2, MB, 0, UpdateOp.ADD, np.ones(MB // 4, "<f4").tobytes())  # journaled
shard.free(200, 0)  # an index transaction after that move (which it folds in first)
shard.clone(7, 300)
shard.write(7, 0, MB, 0, UpdateOp.ADD, np.ones(MB // 4, "<f4").tobytes())  # journaled only
print(os.path.getsize(os.path.join(sys.argv[1], "moves.log")), flush=True)
os._exit(0)  # as SIGKILL: no close, no sync; the page cache keeps the region and the journal
"""


def _reopen(path: str) -> tuple[ShardStore, Shard]:
    store = ShardStore(path, 1, None)
    return store, Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions),
                        store=store)


def _value(shard: Shard, f: int, i: int) -> float:
    version, view = shard.read(f, i, 0, 4)
    assert view is not None, (f, i)
    return float(np.frombuffer(view, "<f4")[0])


def test_copy_on_write_moves_survive_a_shard_process_that_dies(tmp_path: object) -> None:
    """The first write after a snapshot moves the live key to a new extent and journals that
    move (moves.log) instead of a chunk-index transaction. A shard process that dies without
    closing its store (os._exit, as SIGKILL) comes back with every move: the live file has its
    acknowledged updates, the snapshots their bytes at the clone, nothing freed comes back."""
    import subprocess
    import sys

    path = os.path.join(str(tmp_path), "s")
    out = subprocess.run([sys.executable, "-c", _DIES_AFTER_COPY_ON_WRITE, path], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0  # the last move was in the journal only when the process died
    store, shard = _reopen(path)
    assert [_value(shard, 7, i) for i in range(3)] == [2.0, 3.0, 4.0]
    assert [_value(shard, 100, i) for i in range(3)] == [0.0, 1.0, 2.0]
    assert [_value(shard, 300, i) for i in range(3)] == [1.0, 3.0, 4.0]
    assert not shard.has_file(200)  # freed after a move of its sharer: stays freed
    # the live file's 3 extents, snapshot 100's 3, and the one snapshot 300 kept when the
    # live chunk 0 moved (its chunks 1 and 2 share the live file's)
    assert shard.used == 7 * MB
    assert os.path.getsize(os.path.join(path, "moves.log")) == 0  # folded into the index at open
    del shard
    store.close()


_GROWS_IN_PLACE_THEN_DIES = r"""
import os, sys
from irdma.server.shard import Region, Shard
from irdma.server.store import ShardStore
from irdma.wire.protocol import UpdateOp
MB = 1 << 20
store = ShardStore(sys.argv[1], 1, 16 * MB)
shard = Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions), store=store)
shard.write(5, 0, 4 * MB, 0, UpdateOp.ASSIGN, b"a" * MB)  # a 1 MiB extent at the region's start
shard.write(4, 0, 4 * MB, 0, UpdateOp.ASSIGN, b"\xee" * MB)  # the next 1 MiB
shard.free(4, 0)  # freed, not trimmed: the region still holds its bytes there
shard.write(5, 0, 4 * MB, 3 * MB, UpdateOp.ASSIGN, b"d" * MB)  # grows over the freed bytes
for k in range(4):  # another file, front to back in 1 MiB writes, as a mount sends them
    shard.write(6, 0, 4 * MB, k * MB, UpdateOp.ASSIGN, bytes([65 + k]) * MB)
print(shard.used, flush=True)
os._exit(0)  # as SIGKILL: the growths are in the moves journal only
"""


def test_a_chunk_grows_in_place_over_free_space_and_survives_a_process_that_dies(tmp_path: object) -> None:
    """A chunk whose next bytes are free grows into them in place: a file written front to back
    in 1 MiB writes holds its 4 MiB and nothing more at once (a moved extent would stay held,
    parked, until a sync), and bytes it never wrote read as zeros even where a freed, untrimmed
    extent left its bytes. A shard process that dies (os._exit, as SIGKILL) comes back with
    every growth."""
    import subprocess
    import sys

    path = os.path.join(str(tmp_path), "s")
    out = subprocess.run([sys.executable, "-c", _GROWS_IN_PLACE_THEN_DIES, path], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 8 * MB  # two 4 MiB chunks: nothing parked, so nothing moved
    want5 = b"a" * MB + bytes(2 * MB) + b"d" * MB
    want6 = b"".join(bytes([65 + k]) * MB for k in range(4))
    store, shard = _reopen(path)
    assert shard.used == 8 * MB
    for f, want in ((5, want5), (6, want6)):
        version, view = shard.read(f, 0, 0, 4 * MB)
        assert view is not None and bytes(view) == want, f
        del view
    shard.write(9, 0, 4 * MB, 0, UpdateOp.ASSIGN, b"z" * 4 * MB)  # the allocator knows what is taken
    assert bytes(shard.read(5, 0, 0, 4 * MB)[1]) == want5  # type: ignore[arg-type]
    assert bytes(shard.read(6, 0, 0, 4 * MB)[1]) == want6  # type: ignore[arg-type]
    del shard
    store.close()


def _as_killed(store: ShardStore, to: str) -> str:
    """A copy of ``store``'s directory as a SIGKILL now would leave it (no transaction is open:
    the SQLite file and its WAL are copied whole); ``store`` goes on."""
    import shutil

    shutil.copytree(store.path, to)
    return to


def test_the_moves_journal_skips_a_torn_record_and_records_the_index_has(tmp_path: object) -> None:
    """A machine crash may leave half a record at the journal's end, or whole ones of zeros
    (the size grew, the data never came): a torn tail, dropped (any other bad record is damage:
    test_journal_integrity). Records the index already has (a journal left unemptied) never
    replay over later changes."""
    import struct
    import zlib

    from irdma.server.store import MOVE_RECORD

    path = os.path.join(str(tmp_path), "s")
    store = ShardStore(path, 1, 8 * MB)
    store.record_chunks([(5, 0, 0, MB), (6, 0, MB, MB)])
    store.move_chunks([(5, 0)], 2 * MB, MB)
    stale = os.pread(store._log_fd, MOVE_RECORD.size, 0)
    store.unrecord_chunks([(5, 0)])  # folds the move, then forgets the key
    store.move_chunks([(6, 0)], 3 * MB, MB)
    dead = _as_killed(store, os.path.join(str(tmp_path), "dead"))
    store.close()
    journal = os.path.join(dead, "moves.log")
    with open(journal, "rb") as f:
        live = f.read()
    assert len(live) == MOVE_RECORD.size

    def record(seq: int, f: int, i: int, offset: int) -> bytes:
        body = struct.pack("<QQQQQ", seq, f, i, offset, MB)
        return body + zlib.crc32(body).to_bytes(4, "little")

    with open(journal, "wb") as f:  # stale, live, a zero record and a cut one
        f.write(stale + live + bytes(MOVE_RECORD.size) + record(99, 5, 0, 0)[:30])
    again = ShardStore(dead, 1, None)
    assert sorted(again.chunks()) == [(6, 0, 3 * MB, MB)] and again.damaged_journal is None
    again.close()


def test_a_move_whose_journal_fold_fails_records_nothing(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the journal is full its moves are folded into the index before the next append: if
    that fails, the move raises and nothing of it is recorded (its caller frees the extent it
    names, which another chunk may take), in the process nor after a SIGKILL."""
    import sqlite3

    from irdma.server import store as store_mod

    monkeypatch.setattr(store_mod, "JOURNAL_FOLD", 1)
    path = os.path.join(str(tmp_path), "s")
    store = ShardStore(path, 1, 8 * MB)
    store.record_chunks([(7, 0, 0, MB)])
    store.move_chunks([(7, 0)], MB, MB)  # journaled: the journal is full now
    store._db.execute("CREATE TEMP TRIGGER fail BEFORE UPDATE ON journal BEGIN SELECT RAISE(ABORT, 'disk I/O'); END")
    with pytest.raises(sqlite3.Error, match="disk I/O"):
        store.move_chunks([(7, 0)], 2 * MB, MB)
    dead = _as_killed(store, os.path.join(str(tmp_path), "dead"))
    store._db.execute("DROP TRIGGER fail")
    store.record_chunks([(9, 0, 2 * MB, MB)])  # the extent freed by the failed move's caller, taken
    assert sorted(store.chunks()) == [(7, 0, MB, MB), (9, 0, 2 * MB, MB)]
    store.close()
    again = ShardStore(dead, 1, None)
    assert sorted(again.chunks()) == [(7, 0, MB, MB)]
    again.close()
