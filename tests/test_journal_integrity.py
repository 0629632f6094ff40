"""A damaged moves journal never rolls back acknowledged writes (issue 36, point 1).

The moves journal (``moves.log``, :mod:`irdma.server.store`) records the keys a
copy-on-write moved since the chunk index's last transaction. A torn tail (a machine crash
in mid-append) may be dropped; a damaged record *before* good ones may not: the key it moved
would read its old extent, a snapshot's bytes. Such a shard keeps the journal
(``moves.log.damaged``), refuses the chunks the record may have moved (DataLost naming them),
logs what to run, and ``irdma fsck`` exits 2 naming the file.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import zlib

import numpy as np
import pytest
import trio
from helpers import Cluster, irdma_cli, wait_until
from irdma.server.shard import Region, Shard
from irdma.server.store import MOVE_RECORD, ShardStore

import irdma
from irdma._errors import DataLost, NoSpace
from irdma.ops import cluster as cluster_ops
from irdma.ops._proc import pid_alive
from irdma.wire.protocol import UpdateOp

MB = 1 << 20
CHUNK = 64 * 1024


def _record(seq: int, f: int, i: int, offset: int, size: int = MB) -> bytes:
    body = struct.pack("<QQQQQ", seq, f, i, offset, size)
    return body + zlib.crc32(body).to_bytes(4, "little")


def _open(path: str) -> tuple[ShardStore, Shard]:
    store = ShardStore(path, 1, None)
    return store, Shard(1, Region(store.capacity, buffer=memoryview(store.region)), memoryview(store.versions),
                        store=store)


def _three_moves(tmp: str) -> tuple[str, bytes]:
    """A shard directory as a SIGKILL leaves it: file 7's chunks 0-2 at 0-3 MiB, snapshot 100
    sharing them (in the index), then 7's three chunks moved to 4, 5, 6 MiB (journaled only).
    Returns the directory and its journal."""
    path = os.path.join(tmp, "s")
    store = ShardStore(path, 1, 16 * MB)
    store.record_chunks([(7, i, i * MB, MB) for i in range(3)] + [(100, i, i * MB, MB) for i in range(3)])
    store.move_chunks([(7, 0)], 4 * MB, MB)
    store.move_chunks([(7, 1)], 5 * MB, MB)
    store.move_chunks([(7, 2)], 6 * MB, MB)
    dead = os.path.join(tmp, "dead")
    shutil.copytree(path, dead)
    store.close()
    with open(os.path.join(dead, "moves.log"), "rb") as f:
        journal = f.read()
    assert len(journal) == 3 * MOVE_RECORD.size
    return dead, journal


def test_a_damaged_record_before_good_ones_refuses_the_chunks_it_may_have_moved(tmp_path: object,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The red-team's byte at offset 64 (record 1's chunk index): records 0 and 2 replay, the
    journal is kept byte for byte, and the keys record 1 may have moved (7/1 and the snapshot's
    100/1, which still share an extent) are refused: read, write, gather, clone raise DataLost
    naming them; CHECKSUM and LIST see them absent. It holds across a restart; a whole-chunk
    assign (or a free) makes a chunk served again."""
    dead, journal = _three_moves(str(tmp_path))
    bad = bytearray(journal)
    bad[64] = 0xFF
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bad)
    store, shard = _open(dead)
    assert store.damaged_journal == os.path.join(dead, "moves.log.damaged")
    with open(store.damaged_journal, "rb") as kept:
        assert kept.read() == bytes(bad)  # the evidence, whole
    assert sorted(store.chunks()) == sorted([(7, 0, 4 * MB, MB), (7, 1, MB, MB), (7, 2, 6 * MB, MB)]
                                            + [(100, i, i * MB, MB) for i in range(3)])
    assert sorted(shard.lost) == [(7, 1), (100, 1)]
    assert "moves.log.damaged" in caplog.text and "irdma fsck" in caplog.text
    with pytest.raises(DataLost, match=r"chunk \(7, 1\).*moves journal is damaged"):
        shard.read(7, 1, 0, 4)
    with pytest.raises(DataLost, match=r"chunk \(100, 1\)"):
        shard.read(100, 1, 0, 4)
    with pytest.raises(DataLost):
        shard.write(7, 1, MB, 0, UpdateOp.ADD, bytes(4))
    with pytest.raises(DataLost):
        shard.gather(7, np.array([0, 1]), np.array([0, 0]), np.array([4, 4]), memoryview(bytearray(8)))
    with pytest.raises(DataLost):
        shard.clone(7, 200)
    assert shard.read(7, 0, 0, 4)[1] is not None and shard.read(100, 2, 0, 4)[1] is not None
    assert shard.checksum(7, 1) == (0, 0) and shard.version_of(100, 1) == 0
    assert (7, 1) not in [(f, i) for f, i, _, _ in shard.list_chunks(0, 0, 100)]
    del shard
    store.close()

    store, shard = _open(dead)  # still refused after a restart; nothing new damaged
    assert store.damaged_journal is None and sorted(shard.lost) == [(7, 1), (100, 1)]
    shard.write(7, 1, MB, 0, UpdateOp.ASSIGN, b"\x01" * MB)  # rewritten whole
    shard.free(100, 0)
    assert shard.lost == {}
    assert bytes(shard.read(7, 1, 0, 4)[1] or b"") == b"\x01" * 4
    del shard
    store.close()
    store, shard = _open(dead)
    assert shard.lost == {} and bytes(shard.read(7, 1, 0, 4)[1] or b"") == b"\x01" * 4
    del shard
    store.close()


def test_a_torn_tail_or_a_damaged_stale_record_refuses_nothing(tmp_path: object,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Zero records after the last good one and a cut record are a torn tail (what a machine
    crash in mid-append leaves): dropped with a warning, nothing refused, no copy kept. A bad
    record followed only by records the index already has (a journal left unemptied) changes
    nothing either."""
    dead, journal = _three_moves(str(tmp_path))
    bad = bytearray(journal)
    bad[2 * MOVE_RECORD.size :] = bytes(MOVE_RECORD.size)  # the size grew, the data never came
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bytes(bad) + _record(4, 7, 0, 9 * MB)[:30])
    store, shard = _open(dead)
    assert store.damaged_journal is None and shard.lost == {}
    assert sorted(store.chunks())[:3] == [(7, 0, 4 * MB, MB), (7, 1, 5 * MB, MB), (7, 2, 2 * MB, MB)]
    assert "torn tail" in caplog.text
    assert os.path.getsize(os.path.join(dead, "moves.log")) == 0
    assert not os.path.exists(os.path.join(dead, "moves.log.damaged"))
    del shard
    store.close()
    # the index now has seq 2: records 1-2 of the old journal are stale, a bad one among them harmless
    stale = bytearray(journal[: 2 * MOVE_RECORD.size])
    stale[10] ^= 0xFF
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bytes(stale) + journal[MOVE_RECORD.size : 2 * MOVE_RECORD.size])
    store, shard = _open(dead)
    assert store.damaged_journal is None and shard.lost == {}
    del shard
    store.close()


def test_a_damaged_last_record_or_an_all_bad_journal_is_damage_not_a_torn_tail(tmp_path: object,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A SIGKILL cannot tear one write(2) of a record, and a machine crash leaves a cut record or
    zeros: a whole record with a bad CRC-32 that is not all zeros is damage wherever it is, the
    last one too (the red-team byte inside the last record) and a journal of bad records only.
    Its number is taken as past the index's, so the keys it may have moved are refused and the
    journal kept. Zero records after the last good one (and a cut record) stay a torn tail."""
    dead, journal = _three_moves(str(tmp_path))
    bad = bytearray(journal)
    bad[2 * MOVE_RECORD.size + 10] ^= 0xFF  # record 2's file id: no good record follows it
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bad)
    store, shard = _open(dead)
    assert store.damaged_journal == os.path.join(dead, "moves.log.damaged")
    assert sorted(store.chunks())[:3] == [(7, 0, 4 * MB, MB), (7, 1, 5 * MB, MB), (7, 2, 2 * MB, MB)]
    assert sorted(shard.lost) == [(7, 2), (100, 2)]
    with pytest.raises(DataLost, match=r"chunk \(7, 2\)"):
        shard.read(7, 2, 0, 4)
    del shard
    store.close()

    dead, journal = _three_moves(os.path.join(str(tmp_path), "all"))
    every = bytearray(journal)
    for n in range(3):
        every[n * MOVE_RECORD.size + 30] ^= 0x01  # every record's offset
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bytes(every) + bytes(MOVE_RECORD.size) + b"\x07" * 20)  # then a zero record and a cut one
    store, shard = _open(dead)
    assert store.damaged_journal is not None
    with open(store.damaged_journal, "rb") as kept:
        assert kept.read() == bytes(every) + bytes(MOVE_RECORD.size) + b"\x07" * 20
    assert sorted(shard.lost) == sorted([(7, i) for i in range(3)] + [(100, i) for i in range(3)])
    del shard
    store.close()

    dead, journal = _three_moves(os.path.join(str(tmp_path), "zeros"))
    with open(os.path.join(dead, "moves.log"), "wb") as f:  # a crash: the size grew, the data never came
        f.write(journal + bytes(2 * MOVE_RECORD.size) + bytes(7))
    store, shard = _open(dead)
    assert store.damaged_journal is None and shard.lost == {}
    assert sorted(store.chunks())[:3] == [(7, 0, 4 * MB, MB), (7, 1, 5 * MB, MB), (7, 2, 6 * MB, MB)]
    assert "torn tail" in caplog.text
    del shard
    store.close()


def test_a_shard_that_kept_a_damaged_journal_keeps_the_extents_a_lost_move_may_name(
        tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    """The damaged record 1 moved 7/1 to 5 MiB, written there and acknowledged: in the index
    that extent is free. While the shard refuses chunks, it neither zeroes nor hands out a free
    extent such a record may name (the bytes the kept journal points at stay, across restarts
    and trims, and new chunks go elsewhere); its advice is what works (rewrite or delete, or
    resync: a restore from a snapshot of the same extent is refused too). Once every refused
    chunk is rewritten or freed, the extents are free again (trimmed, then reused)."""
    dead, journal = _three_moves(str(tmp_path))
    moved = b"\x5a" * MB  # the acknowledged bytes of 7/1's move
    with open(os.path.join(dead, "region"), "r+b") as f:
        f.seek(5 * MB)
        f.write(moved)
    bad = bytearray(journal)
    bad[64] = 0xFF
    with open(os.path.join(dead, "moves.log"), "wb") as f:
        f.write(bad)
    store, shard = _open(dead)
    assert sorted(shard.lost) == [(7, 1), (100, 1)]
    assert bytes(store.region[5 * MB : 6 * MB]) == moved  # not zeroed at open
    made = 0
    with pytest.raises(NoSpace):
        for i in range(16):  # fill the shard: no new chunk takes the extent
            shard.write(300, i, MB, 0, UpdateOp.ASSIGN, b"\x01" * MB)
            made += 1
    assert made == 10  # 16 MiB: 5 in chunks, 1 kept
    shard.trim(0)
    assert bytes(store.region[5 * MB : 6 * MB]) == moved
    text = caplog.text
    assert "rewrite or delete those files" in text and "or restore" not in text  # a restore is refused
    with pytest.raises(DataLost) as refused:
        shard.read(7, 1, 0, 4)
    assert "restore" not in str(refused.value) and "rewrite or delete" in str(refused.value)
    shard.free(300, 0)
    shard.trim(0)  # (untrimmed, their extents would be held at the next open too: written and free)
    del shard
    store.close()

    store, shard = _open(dead)  # a restart keeps them too
    assert bytes(store.region[5 * MB : 6 * MB]) == moved and shard.held == [(5 * MB, MB)]
    shard.write(7, 1, MB, 0, UpdateOp.ASSIGN, b"\x02" * MB)  # what works: rewritten whole,
    shard.free(100, 1)  # and deleted
    assert shard.lost == {}
    shard.trim(0)  # free again: zeroed, and taken by a new chunk
    assert bytes(store.region[5 * MB : 6 * MB]) == bytes(MB)
    for i in range(10):
        shard.write(300, i, MB, 0, UpdateOp.ASSIGN, b"\x01" * MB)
    del shard
    store.close()


def _pid(c: Cluster, shard_id: int) -> int:
    (p,) = [s for s in cluster_ops.read_state(c.dir) if s.shard_id == shard_id]
    assert cluster_ops.shard_running(p)
    return p.pid


@pytest.mark.slow
@pytest.mark.parametrize("last", [False, True], ids=["byte 64", "inside the last record"])
def test_one_corrupted_byte_in_moves_log_is_refused_not_rolled_back(tmp_path: object, last: bool) -> None:
    """The red-team recipe with real shards (``--replicas 1``): 6 chunks of 64 KiB, a snapshot,
    all 6 pushed to (acknowledged), shard 1 SIGKILLed, one byte of its moves.log overwritten
    (at 64, or 10 bytes into the last record: no good record follows it), ``irdma up``. No chunk reads old bytes: the one whose move is damaged raises DataLost
    (the client's EIO), the rest read the new bytes; the journal is kept; the shard's log says
    what happened and what to run; ``irdma fsck`` exits 2 naming the file."""
    d = os.path.join(str(tmp_path), "c")
    c = Cluster(d, 2, 64 * MB, replicas=1)
    n = 6 * CHUNK // 4
    w = np.arange(n, dtype="<f4")
    try:
        async def before() -> None:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.write("/w", w, chunk_size=CHUNK)
                await cl.snapshot("/", "s1")
                await cl.push("/w", np.ones(n, "<f4"))  # copy-on-write: journaled moves

        trio.run(before)
        journal = os.path.join(d, "shards", "1", "moves.log")
        assert os.path.getsize(journal) >= 2 * MOVE_RECORD.size
        pid = _pid(c, 1)
        os.kill(pid, signal.SIGKILL)  # the pid this cluster's `irdma up` recorded
        wait_until(lambda: not pid_alive(pid), 10, "shard 1 to die", interval=0.005)
        with open(journal, "r+b") as f:
            f.seek(os.path.getsize(journal) - MOVE_RECORD.size + 10 if last else 64)
            f.write(b"\xff")
        with open(journal, "rb") as g:
            damaged = g.read()
        cluster_ops.up(d, 2, 64 * MB)

        async def after() -> tuple[list[str], list[str]]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                got = []
                for path, want in (("/w", w + 1), ("/.snapshots/s1/w", w)):
                    out = []
                    for k in range(6):
                        try:
                            data = await cl.read(path, k * CHUNK, CHUNK)
                        except DataLost:
                            out.append("lost")
                            continue
                        piece = want[k * CHUNK // 4 : (k + 1) * CHUNK // 4]
                        out.append("new" if np.frombuffer(data, "<f4").tobytes() == piece.tobytes() else "WRONG")
                    got.append(out)
                return got[0], got[1]

        live, snap = trio.run(after)
        assert "WRONG" not in live + snap, (live, snap)
        assert live.count("lost") == 1, live
        with open(journal + ".damaged", "rb") as kept:
            assert kept.read() == damaged
        with open(os.path.join(d, "logs", "shard-1.log")) as text:
            log = text.read()
        assert "moves.log.damaged" in log and "irdma fsck" in log, log[-2000:]
        fsck = irdma_cli("fsck", "--meta", c.meta_url, check=False)
        assert fsck.returncode == 2, fsck.stdout + fsck.stderr
        assert re.search(r"/w\b", fsck.stdout + fsck.stderr), fsck.stdout + fsck.stderr
    finally:
        cluster_ops.down(d)
