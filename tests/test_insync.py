"""In-sync sets: every replica of a chunk down at once, in any order, never strands or garbles
an acknowledged byte (issue 20, point 1; Kafka's ISR, 3FS's LASTSRV).

Real shard processes (``irdma up``, 3 shards, 2 replicas), SIGKILL, restarts on the same data
directories, the native client. Chunks are 64 KiB so that every chain of the three shards
holds some of each file.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import trio
from helpers import running_cluster, wait_until

from irdma import DataLost, ShardUnavailable
from irdma.client.native import Client, layout_of
from irdma.ops._proc import pid_alive
from irdma.ops.cluster import key_file_of, shard_dir

CHUNK = 64 << 10
SIZE = 24 * CHUNK

pytestmark = pytest.mark.slow


class Shards:
    """Kill and restart the shards of a test cluster by hand, on their data directories (what
    an operator, or a whole-cluster power loss and reboot, does)."""

    def __init__(self, c: object) -> None:
        self.c = c
        self.procs = {s.shard_id: s for s in c.shards}  # type: ignore[attr-defined]
        self.pids = {s.shard_id: s.pid for s in c.shards}  # type: ignore[attr-defined]
        self.started: list[subprocess.Popen[bytes]] = []

    def kill(self, sid: int) -> None:
        pid = self.pids[sid]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, f"shard {sid} (pid {pid}) to exit")

    def start(self, sid: int, capacity: int | None = None) -> None:
        p = self.procs[sid]
        log = open(p.log, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "irdma.ops.cli", "server", "--listen", p.address, "--shard-id", str(sid),
             "--transport", "tcp", "--data-dir", shard_dir(self.c.dir, sid),  # type: ignore[attr-defined]
             "--key-file", key_file_of(self.c.dir),  # type: ignore[attr-defined]
             *(["--capacity", str(capacity)] if capacity else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.started.append(proc)
        self.pids[sid] = proc.pid

    def stop_started(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _data(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


async def _wait_answering(client: Client, sid: int) -> None:
    """Until the shard answers a STAT (the heartbeat's probe), with a deadline."""
    with trio.fail_after(30):
        while True:
            stats = await client.shard_stats()
            if any(rec.shard_id == sid and st is not None for rec, st, _ in stats):
                return
            await trio.sleep(0.05)


async def _read_all(client: Client, path: str) -> bytes:
    inode = await client.meta.resolve(path)
    buf = bytearray(inode.size)
    await client.read_into(layout_of(inode), 0, memoryview(buf), await client.meta.chunk_map(inode.ino))
    return bytes(buf)


@pytest.mark.parametrize("first,second,restart", [
    (2, 3, "stale-first"), (3, 2, "stale-first"), (2, 3, "in-sync-first"), (1, 3, "together"),
])
def test_every_replica_down_in_any_order_strands_nothing(tmp_path: object, first: int, second: int,
                                                         restart: str) -> None:
    with running_cluster(str(tmp_path), shards=3, capacity=64 << 20, replicas=2) as c:
        shards = Shards(c)
        try:
            trio.run(_scenario, c.meta_url, shards, first, second, restart)
        finally:
            shards.stop_started()


async def _scenario(meta_url: str, shards: Shards, first: int, second: int, restart: str) -> None:
    before, after = _data(1), _data(2)
    async with Client.open(meta_url, client_name="test-insync", timeout=3.0) as client:
        await client.create("/before", chunk_size=CHUNK)
        await client.create("/after", chunk_size=CHUNK)
        await client.write("/before", before)
        await client.flush()
        shards.kill(first)
        await client.write("/after", after)  # acknowledged with `first` out of its chains
        await client.flush()
        assert await _read_all(client, "/after") == after
        shards.kill(second)
        # the chunks of /after on the chain (first, second) are now held up to date by `second` alone
        inode = await client.meta.resolve("/after")
        layout = layout_of(inode)
        both = [i for i in range(SIZE // CHUNK) if set(client.placed(layout, i)[0]) == {first, second}]
        assert both, "the test needs chunks on the chain of both killed shards"
        if restart == "stale-first":
            shards.start(first)
            await _wait_answering(client, first)
            await client.resync_all()
            for i in both:  # the stale copy is never served: EIO naming the shard that has it
                buf = bytearray(CHUNK)
                with pytest.raises(ShardUnavailable, match=f"shards {second}"):
                    await client.read_into(layout, i * CHUNK, memoryview(buf), await client.meta.chunk_map(inode.ino))
            shards.start(second)
        elif restart == "in-sync-first":
            shards.start(second)
            await _wait_answering(client, second)
            await client.resync_all()
            for i in both:  # the in-sync replica serves at once, the other still down
                buf = bytearray(CHUNK)
                await client.read_into(layout, i * CHUNK, memoryview(buf), await client.meta.chunk_map(inode.ino))
                assert bytes(buf) == after[i * CHUNK : (i + 1) * CHUNK]
            shards.start(first)
        else:
            shards.start(first)
            shards.start(second)
        for sid in (first, second):
            await _wait_answering(client, sid)
        await client.resync_all()
        health = {r.shard_id: r.health for r in await client.meta.shards()}
        assert health == {1: "up", 2: "up", 3: "up"}, health
        assert await _read_all(client, "/before") == before
        assert await _read_all(client, "/after") == after
        assert await client.meta.damaged() == []
        assert await client.meta.under_replicated() == 0


def test_force_from_adopts_a_stale_copy_when_the_in_sync_one_is_lost(tmp_path: object) -> None:
    """The only in-sync replica comes back on empty memory: the chunks are lost (EIO, never the
    stale bytes), and ``resync --force-from`` takes the stale replica's copy, as documented."""
    with running_cluster(str(tmp_path), shards=3, capacity=64 << 20, replicas=2) as c:
        shards = Shards(c)
        try:
            trio.run(_lost_scenario, c.meta_url, c.dir, shards)
        finally:
            shards.stop_started()


async def _lost_scenario(meta_url: str, cluster_dir: str, shards: Shards) -> None:
    first, second = 2, 3
    old, new = _data(3), _data(4)
    async with Client.open(meta_url, client_name="test-insync", timeout=3.0) as client:
        await client.create("/f", chunk_size=CHUNK)
        await client.write("/f", old)
        await client.flush()
        shards.kill(first)
        await client.write("/f", new)
        await client.flush()
        shards.kill(second)
        shutil.rmtree(shard_dir(cluster_dir, second))  # its data is gone for good
        shards.start(second, capacity=64 << 20)  # a new, empty memory
        shards.start(first)
        for sid in (first, second):
            await _wait_answering(client, sid)
        await client.resync_all()
        inode = await client.meta.resolve("/f")
        layout = layout_of(inode)
        both = [i for i in range(SIZE // CHUNK) if set(client.placed(layout, i)[0]) == {first, second}]
        assert both
        damaged = await client.meta.damaged()
        assert [d.path for d in damaged] == ["/f"] and sorted(damaged[0].lost_chunks) == both
        for i in both:  # lost: EIO, never the stale bytes `first` still holds
            buf = bytearray(CHUNK)
            with pytest.raises((DataLost, ShardUnavailable)):
                await client.read_into(layout, i * CHUNK, memoryview(buf), await client.meta.chunk_map(inode.ino))
        await client.resync_shard(first, force=True)
        got = await _read_all(client, "/f")
        for i in range(SIZE // CHUNK):
            want = (old if i in both else new)[i * CHUNK : (i + 1) * CHUNK]
            assert got[i * CHUNK : (i + 1) * CHUNK] == want, f"chunk {i}"
        assert await client.meta.damaged() == []
        # and the adopted copy is on both replicas again: kill `first`, read from `second`
        shards.kill(first)
        assert await _read_all(client, "/f") == got
