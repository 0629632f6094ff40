"""Snapshots under faults (issue 23), with real shard processes (R=2) on their data directories:
a shard SIGKILLed while a snapshot is made or while its first copy-on-write happens, the whole
cluster stopped and started again, a shard drained. Every snapshot must stay exact (its bytes
equal a model of the file at the cut) and so must the live file; a snapshot that cannot be
made fails with an error that says to try again and leaves nothing behind (no ``creating``
entry in ``irdma snapshot list``, no leaked chunk in ``irdma gc --dry-run``).

Shards are killed by the pid ``irdma up`` recorded (checked against the cluster's
``cluster.json``), restarted on their data directory by ``irdma up`` on the running cluster,
and resynced as ``irdma shard resync`` does; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest
import trio
from helpers import Cluster, irdma_cli, running_cluster, wait_until

import irdma
from irdma._errors import ShardUnavailable
from irdma.client import snapshots as snapshots_mod
from irdma.client.fsck import scan
from irdma.client.native import layout_of
from irdma.meta import open_meta
from irdma.ops import cluster as cluster_ops
from irdma.ops._proc import pid_alive
from irdma.transport.base import ShardConnection
from irdma.wire.auth import read_key_file

pytestmark = [pytest.mark.slow]

CHUNK = 64 * 1024
N = 6 * CHUNK // 4  # float32 elements of the model file: 6 chunks
#: Request deadline of the clients here (seconds; the default): a killed shard fails a request at
#: once (connection refused or reset), and the shards restarted here may be slow on a loaded machine.
TIMEOUT = 10.0


@pytest.fixture()
def cl(tmp_path: str) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path / "c"), shards=2, replicas=2) as c:  # type: ignore[operator]
        yield c


def _open(c: Cluster) -> AbstractAsyncContextManager[irdma.Client]:
    return irdma.Client.open(c.meta_url, transport="tcp", timeout=TIMEOUT)


def _pid(c: Cluster, shard_id: int) -> int:
    """The live process of a shard this cluster's ``irdma up`` started (by its ``cluster.json``)."""
    (p,) = [s for s in cluster_ops.read_state(c.dir) if s.shard_id == shard_id]
    assert cluster_ops.shard_running(p), f"shard {shard_id} (pid {p.pid}) is not running"
    return p.pid


def _kill(c: Cluster, shard_id: int) -> None:
    """SIGKILL a shard and wait (10 s at most) until its process is gone."""
    pid = _pid(c, shard_id)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, f"shard {shard_id} (pid {pid}) to die", interval=0.005)


async def _akill(c: Cluster, shard_id: int) -> None:
    """:func:`_kill` from inside trio (the wait in a worker thread)."""
    await trio.to_thread.run_sync(_kill, c, shard_id)


def _restart(c: Cluster) -> None:
    """``irdma up`` on the running cluster: the dead shards start again on their data
    directories; then resync (``irdma shard resync``) until every shard is up."""
    cluster_ops.up(c.dir, 2, 64 << 20)

    async def heal() -> None:
        async with _open(c) as client:
            with trio.fail_after(30):
                while True:
                    await client.shard_stats()  # a shard found answering again is syncing ...
                    await client.resync_all()  # ... and is brought level, then up
                    health = {r.shard_id: r.health for r in await client.meta.shards()
                              if r.state not in ("drained", "removed")}
                    if all(h == "up" for h in health.values()):
                        return
                    await trio.sleep(0.05)

    trio.run(heal)


async def _exact(client: irdma.Client, expect: dict[str, np.ndarray]) -> None:
    for path, model in expect.items():
        got = await client.pull(path)
        assert np.array_equal(got, model), f"{path} differs from its model at {np.flatnonzero(got != model)[:8]}"


async def _clean(client: irdma.Client, ready: list[str]) -> None:
    """The snapshots of ``/`` are exactly ``ready`` (all ready, none left being made: what
    ``irdma snapshot list`` shows), and the scan of ``irdma fsck`` and ``irdma gc --dry-run``
    finds nothing: no leaked chunk, no orphan, every chunk readable, no replica missing."""
    assert [(s.name, s.state) for s in await client.snapshots("/")] == [(n, "ready") for n in ready]
    rep = await scan(client)
    assert (rep.leaked, rep.orphans, rep.damaged, rep.waiting, rep.missing, rep.unreachable) == \
        ([], [], [], [], {}, []), rep


async def _refused(client: irdma.Client, name: str) -> ShardUnavailable:
    """Take snapshot ``name`` of ``/``, which must fail because a shard is down; its error.
    (Until the fix of :func:`test_a_snapshot_refused_for_a_dead_shard_says_to_take_it_again`,
    the error may come wrapped in an ExceptionGroup; that test asserts the plain error.)"""
    try:
        await client.snapshot("/", name)
    except ShardUnavailable as exc:
        return exc
    except BaseExceptionGroup as group:
        leaves = group.exceptions
        assert len(leaves) == 1 and isinstance(leaves[0], ShardUnavailable), group
        return leaves[0]
    raise AssertionError(f"snapshot {name} was made with a shard down")


def _model() -> np.ndarray:
    return np.arange(N, dtype="<f4")


# ---------------------------------------------------------------- 1. a shard dies while a snapshot is made
def test_a_snapshot_refused_for_a_dead_shard_says_to_take_it_again(cl: Cluster) -> None:
    """With a shard SIGKILLed, ``Client.snapshot`` raises a plain ShardUnavailable saying to
    take the snapshot again (once the shard is back)."""
    async def setup() -> None:
        async with _open(cl) as c:
            await c.write("/w", _model(), chunk_size=CHUNK)

    trio.run(setup)
    _kill(cl, 2)

    async def refused() -> None:
        async with _open(cl) as c:
            with pytest.raises(ShardUnavailable) as info:
                await c.snapshot("/", "s")
            assert "again" in str(info.value), info.value

    trio.run(refused)


def test_snapshot_with_a_shard_already_dead_fails_cleanly_then_a_retry_is_exact(cl: Cluster) -> None:
    """The freeze finds a shard down: ``create`` fails, keeps nothing (``irdma snapshot list``
    empty, ``irdma gc --dry-run`` finds nothing) and holds no write back; the live file goes on
    on the other replica; once the shard is back and resynced, the snapshot is taken and is
    exact."""
    w = _model()

    async def setup() -> None:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)

    trio.run(setup)
    _kill(cl, 2)

    async def while_down() -> None:
        async with _open(cl) as c:
            await _refused(c, "s")
            assert await c.snapshots("/") == []
            await c.push("/w", np.ones(N, "<f4"))  # writes go on (on shard 1)
            await _exact(c, {"/w": w + 1})

    trio.run(while_down)
    _restart(cl)
    out = irdma_cli("gc", "--dry-run", "--meta", cl.meta_url).stdout
    assert "0 orphaned files" in out and "0 leaked chunks" in out, out

    async def retry() -> None:
        async with _open(cl) as c:
            await _clean(c, [])
            info = await c.snapshot("/", "s")
            assert info.state == "ready"
            await c.push("/w", np.ones(N, "<f4"))
            await _exact(c, {"/w": w + 2, "/.snapshots/s/w": w + 1})
            await _clean(c, ["s"])

    trio.run(retry)


def test_a_client_keeps_its_snapshot_connections_and_opens_them_again_after_a_restart(cl: Cluster) -> None:
    """One client's snapshots share its snapshot connections (one per shard, opened once), and
    when a shard is SIGKILLed and restarted in between, that client's next snapshot opens a new
    one to it and is exact, as are the ones before."""
    w = _model()

    async def go() -> None:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)
            await c.snapshot("/", "s1")
            first = dict(c.pool.snapshot_conns)
            assert sorted(first) == [1, 2]
            await c.push("/w", np.ones(N, "<f4"))
            await c.snapshot("/", "s2")
            assert all(c.pool.snapshot_conns[sid] is conn for sid, conn in first.items())  # not opened again
            await _akill(cl, 2)
            await trio.to_thread.run_sync(_restart, cl)
            await c.push("/w", np.ones(N, "<f4"))
            await c.snapshot("/", "s3")
            assert c.pool.snapshot_conns[2] is not first[2] and c.pool.snapshot_conns[1] is first[1]
            await _exact(c, {"/w": w + 2, "/.snapshots/s1/w": w, "/.snapshots/s2/w": w + 1, "/.snapshots/s3/w": w + 2})
            await _clean(c, ["s1", "s2", "s3"])

    trio.run(go)


_REAL_CONTROL = snapshots_mod._control


def _kill_at(c: Cluster, client: irdma.Client, victim: int, before: str | None = None,
             after: str | None = None) -> list[str]:
    """Wrap ``client``'s snapshot calls to the shards (FREEZE, CLONE, THAW on the connections of
    :func:`irdma.client.snapshots._control`): SIGKILL shard ``victim`` just before its ``before``
    call is sent, or just after its ``after`` call answered. Returns the calls seen, in order
    (``"clone 2"``)."""
    seen: list[str] = []

    class Spy:
        def __init__(self, sid: int, conn: object) -> None:
            self.sid, self.conn = sid, conn

        def __getattr__(self, name: str) -> object:
            fn = getattr(self.conn, name)
            if name not in ("freeze", "clone", "thaw"):
                return fn

            async def call(*args: object) -> object:
                seen.append(f"{name} {self.sid}")
                if self.sid == victim and name == before and pid_alive(_pid(c, victim)):
                    await _akill(c, victim)
                out = await fn(*args)
                if self.sid == victim and name == after:
                    await _akill(c, victim)
                return out

            return call

    @contextlib.asynccontextmanager
    async def control(cl: irdma.Client, shards: Sequence[int]) -> AsyncIterator[dict[int, object]]:
        async with _REAL_CONTROL(cl, shards) as conns:
            yield {sid: Spy(sid, conn) for sid, conn in conns.items()} if cl is client else conns

    snapshots_mod._control = control  # type: ignore[assignment]
    return seen


def test_shard_killed_between_freeze_and_clone_takes_it_all_back(cl: Cluster) -> None:
    """Shard 2 answered the freeze and dies before its CLONE: ``create`` fails, the other
    shard's freeze is released at once (a push right after is not held for the lease), nothing
    is left; after the restart and resync a retry is exact."""
    w = _model()

    async def run() -> None:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)
            seen = _kill_at(cl, c, 2, before="clone")
            await _refused(c, "s")
            assert "freeze 2" in seen and "clone 2" in seen, seen
            assert await c.snapshots("/") == []
            t0 = time.monotonic()
            await c.push("/w", np.ones(N, "<f4"))
            # the freeze's lease is 5 s: a push held by a freeze left behind would wait for it
            assert time.monotonic() - t0 < 3.0, "a push waited for the failed snapshot's freeze"
            await _exact(c, {"/w": w + 1})

    trio.run(run)
    _restart(cl)

    async def retry() -> None:
        async with _open(cl) as c:
            await _clean(c, [])
            await c.snapshot("/", "s")
            await c.write("/w", np.zeros(CHUNK // 4, "<f4"), CHUNK)  # one chunk copied on write
            live = w + 1
            live[CHUNK // 4 : CHUNK // 2] = 0
            await _exact(c, {"/w": live, "/.snapshots/s/w": w + 1})
            await _clean(c, ["s"])

    trio.run(retry)


def test_shard_killed_after_its_clone_keeps_the_snapshot_in_its_data_directory(cl: Cluster) -> None:
    """Shard 2 dies right after its CLONE answered: the snapshot is made (ready) and exact; its
    clone is in shard 2's data directory, so after a restart and resync the snapshot reads
    exact from shard 2 alone (shard 1 killed then)."""
    w = _model()

    async def run() -> None:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)
            _kill_at(cl, c, 2, after="clone")
            info = await c.snapshot("/", "s")
            assert info.state == "ready"
            await c.push("/w", np.ones(N, "<f4"))  # copy-on-write on shard 1 alone
            await _exact(c, {"/w": w + 1, "/.snapshots/s/w": w})

    trio.run(run)
    _restart(cl)

    async def clean() -> None:
        async with _open(cl) as c:
            await _clean(c, ["s"])

    trio.run(clean)
    _kill(cl, 1)

    async def from_shard_2() -> None:
        async with _open(cl) as c:
            await _exact(c, {"/w": w + 1, "/.snapshots/s/w": w})

    trio.run(from_shard_2)


# ---------------------------------------------------------------- 2. a shard dies during the first write after a snapshot
def test_shard_killed_during_the_first_copy_on_write(cl: Cluster) -> None:
    """The first push after a snapshot (every chunk is copied on write) while shard 2 is
    stopped: shard 1 applies its chunks (copy-on-write) and forwards them to the stopped shard;
    shard 2 is then SIGKILLed with those updates unapplied. The push is acknowledged by
    shard 1 alone; the snapshot and the live file read exact while shard 2 is down, and after
    it restarts on its data directory (its chunks still shared with the snapshot there) and is
    resynced, also from shard 2 alone."""
    w = _model()

    async def run() -> None:
        async with _open(cl) as c, _open(cl) as watcher:
            await c.write("/w", w, chunk_size=CHUNK)
            await c.snapshot("/", "s")
            inode = await c.meta.resolve("/w")
            layout = layout_of(inode)
            heads1 = [i for i in range(6) if c.chain_of(layout, i)[0] == 1]
            assert heads1 and len(heads1) < 6  # shard 1 heads some chunks, shard 2 the others
            os.kill(_pid(cl, 2), signal.SIGSTOP)
            pushed = trio.Event()

            async def push() -> None:
                await c.push("/w", np.ones(N, "<f4"))
                pushed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(push)
                await watcher.refresh_view()
                with trio.fail_after(10):  # shard 1 applied its chunks (and copied them on write)
                    while True:
                        versions = [(await watcher.shard_call(
                            1, ShardConnection.checksum, inode.ino, i, watcher.view.epoch))[0] for i in heads1]
                        if all(v == 2 for v in versions):
                            break
                        await trio.sleep(0.01)
                assert not pushed.is_set()  # held by the stopped tail
                await _akill(cl, 2)
            await _exact(c, {"/w": w + 1, "/.snapshots/s/w": w})

    trio.run(run)
    _restart(cl)

    async def after() -> None:
        async with _open(cl) as c:
            await _exact(c, {"/w": w + 1, "/.snapshots/s/w": w})
            await c.push("/w", np.ones(N, "<f4"))
            await _exact(c, {"/w": w + 2, "/.snapshots/s/w": w})
            await _clean(c, ["s"])

    trio.run(after)
    _kill(cl, 1)  # shard 2's own copies: the live file's and the snapshot's

    async def from_shard_2() -> None:
        async with _open(cl) as c:
            await _exact(c, {"/w": w + 2, "/.snapshots/s/w": w})

    trio.run(from_shard_2)


# ---------------------------------------------------------------- 3. the whole cluster stopped and started again
def test_down_and_up_with_shared_and_copied_chunks_then_copies_after_the_restart(cl: Cluster) -> None:
    """Snapshot s1, chunk 0 copied on write (1..5 still shared); ``irdma down`` + ``up`` (the
    functions the commands run): all exact; then chunk 1 is copied on write after the restart,
    snapshot s2 is taken and chunk 2 copied (shared by the live file, s1 and s2 until then);
    ``down`` + ``up`` again: s1, s2 and the live file exact; deleting s1 leaves s2 and the
    live file exact and nothing to collect."""
    w = _model()
    q = CHUNK // 4
    s1 = w.copy()
    live = w.copy()
    live[:q] = -1

    async def before() -> None:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)
            await c.snapshot("/", "s1")
            await c.write("/w", np.full(q, -1, "<f4"), 0)

    trio.run(before)
    cluster_ops.down(cl.dir)
    cluster_ops.up(cl.dir, 2, 64 << 20)
    live2 = live.copy()
    live2[q : 2 * q] = -2
    s2 = live2.copy()
    live3 = live2.copy()
    live3[2 * q : 3 * q] = -3

    async def after_first() -> None:
        async with _open(cl) as c:
            await _exact(c, {"/w": live, "/.snapshots/s1/w": s1})
            await c.write("/w", np.full(q, -2, "<f4"), CHUNK)  # a chunk shared since before the restart
            await c.snapshot("/", "s2")
            await c.write("/w", np.full(q, -3, "<f4"), 2 * CHUNK)  # shared by the live file, s1 and s2
            await _exact(c, {"/w": live3, "/.snapshots/s1/w": s1, "/.snapshots/s2/w": s2})

    trio.run(after_first)
    cluster_ops.down(cl.dir)
    cluster_ops.up(cl.dir, 2, 64 << 20)

    async def after_second() -> None:
        async with _open(cl) as c:
            await _exact(c, {"/w": live3, "/.snapshots/s1/w": s1, "/.snapshots/s2/w": s2})
            await c.push("/w", np.ones(N, "<f4"))
            await _exact(c, {"/w": live3 + 1, "/.snapshots/s1/w": s1, "/.snapshots/s2/w": s2})
            assert await c.delete_snapshot("/", "s1") == 1
            await _exact(c, {"/w": live3 + 1, "/.snapshots/s2/w": s2})
            await _clean(c, ["s2"])

    trio.run(after_second)


# ---------------------------------------------------------------- 4. a shard drained; a rebalance
def _add_shard(c: Cluster) -> int:
    """Start a new shard on a data directory of the cluster and register it, as ``irdma server``
    and ``irdma shard add`` do (recorded in ``cluster.json``: ``down`` stops it); its id."""
    address = f"127.0.0.1:{cluster_ops._free_port('127.0.0.1')}"
    with contextlib.closing(open_meta(c.meta_url)) as meta:
        rec = meta.add_shard(address)
    settings = cluster_ops.ShardSettings("tcp", "fsync", None, 64 << 20, cluster_ops.shard_dir(c.dir, rec.shard_id))
    proc = cluster_ops._spawn(c.dir, rec.shard_id, address, settings, 64 << 20)
    cluster_ops._write_state(c.dir, [*cluster_ops.read_state(c.dir), proc])
    c.shards.append(proc)  # its log is checked at the end too
    trio.run(cluster_ops.wait_for_shard, address, "tcp", time.monotonic() + 20, proc.pid,
             read_key_file(cluster_ops.key_file_of(c.dir)))
    return rec.shard_id


def test_rebalance_and_drain_of_shards_holding_snapshot_chunks_keep_them_exact(cl: Cluster) -> None:
    """A snapshot, one chunk copied on write; a third shard added and ``irdma rebalance``: exact;
    then shard 1 (holding chunks of the live file and of the snapshot, some shared) drained:
    the live file and the snapshot read exact, nothing is left on shard 1 or to collect, and
    the shard that received the moved chunks serves them all exact alone."""
    w = _model()
    q = CHUNK // 4
    live = w.copy()
    live[:q] = -1

    async def before() -> None:
        async with _open(cl) as client:
            await client.write("/w", w, chunk_size=CHUNK)
            await client.snapshot("/", "s")
            await client.write("/w", np.full(q, -1, "<f4"), 0)

    trio.run(before)
    new = _add_shard(cl)

    async def moves() -> None:
        async with _open(cl) as client:
            assert await client.rebalance()  # moves made (from shards 1 and 2)
            assert len({e.file_id async for page in client.list_chunks(new) for e in page}) == 2
            await _exact(client, {"/w": live, "/.snapshots/s/w": w})
            await _clean(client, ["s"])
            assert len({e.file_id async for page in client.list_chunks(1) for e in page}) == 2
            await client.drain_shard(1)
            assert [e async for page in client.list_chunks(1) for e in page] == []
            await _exact(client, {"/w": live, "/.snapshots/s/w": w})
            await client.push("/w", np.ones(N, "<f4"))
            await _exact(client, {"/w": live + 1, "/.snapshots/s/w": w})
            await _clean(client, ["s"])

    trio.run(moves)
    _kill(cl, 2)

    async def from_new() -> None:
        async with _open(cl) as client:
            await _exact(client, {"/w": live + 1, "/.snapshots/s/w": w})

    trio.run(from_new)


def test_snapshots_keep_two_replicas_through_a_drain_and_removal(tmp_path: str) -> None:
    """Three shards (R=2): snapshot s1, shard 1 drained, removed and stopped, snapshot s2: then
    each remaining shard alone serves the live file, s1 and s2 exact."""
    w = _model()
    with running_cluster(str(tmp_path / "c"), shards=3, replicas=2) as c:  # type: ignore[operator]
        async def before() -> None:
            async with _open(c) as client:
                await client.write("/w", w, chunk_size=CHUNK)
                await client.write("/pad", b"x")  # the copy's inode number is not the source's mod 3
                await client.snapshot("/", "s1")
                await client.drain_shard(1)
                await client.remove_shard(1)

        trio.run(before)
        _kill(c, 1)
        c.shards = [s for s in c.shards if s.shard_id != 1]

        async def s2() -> None:
            async with _open(c) as client:
                await client.snapshot("/", "s2")

        trio.run(s2)
        for victim in (2, 3):
            _kill(c, victim)

            async def alone() -> None:
                async with _open(c) as client:
                    await _exact(client, {"/w": w, "/.snapshots/s1/w": w, "/.snapshots/s2/w": w})

            trio.run(alone)
            _restart(c)


# ---------------------------------------------------------------- 5. the creator dies
_DYING_CREATOR = r"""
import sys, time, trio, irdma
from irdma.client import snapshots as S
async def main():
    async with irdma.Client.open(sys.argv[1], transport="tcp") as c:
        ino = (await c.meta.resolve("/")).ino
        snap, files = await c.meta.snapshot_begin(ino, sys.argv[2].encode())
        await S._cut(c, snap, files)  # the shards cloned: only the metadata commit is left
        print("cut", flush=True)
        await trio.sleep(600)  # killed here
trio.run(main)
"""


def test_a_snapshot_left_creating_by_a_dead_creator_is_deleted_by_gc_and_by_a_create_with_keep(cl: Cluster) -> None:
    """A creator SIGKILLed after its shards cloned, before its metadata commit, leaves its
    snapshot ``creating`` (``irdma snapshot list`` shows it) and its clones on the shards.
    While young it may still be in progress: ``irdma gc`` keeps it. Once older than
    ABANDONED_S (10 minutes; the test ages its row), ``irdma gc --dry-run`` names it, ``irdma
    gc`` deletes it and frees its clones (the shards hold the chunks they held before), and
    another left so is deleted by the next create with ``keep`` in that directory."""
    import sqlite3
    import subprocess
    import sys

    w = _model()

    async def setup() -> int:
        async with _open(cl) as c:
            await c.write("/w", w, chunk_size=CHUNK)
            await c.flush()
            return sum(st.chunks for _, st, _ in await c.shard_stats() if st is not None)

    before = trio.run(setup)

    def dead_creator(name: str) -> None:
        p = subprocess.Popen([sys.executable, "-c", _DYING_CREATOR, cl.meta_url, name], stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "cut"
        finally:
            os.kill(p.pid, signal.SIGKILL)  # the pid this test started
            p.wait(30)
            if p.stdout is not None:
                p.stdout.close()

    def age(name: str) -> None:
        db = sqlite3.connect(cl.meta_url.removeprefix("sqlite://"))
        with db:
            db.execute("UPDATE snapshots SET created_ns = created_ns - ? WHERE name = ?",
                       (int((snapshots_mod.ABANDONED_S + 60) * 1e9), name.encode()))
        db.close()

    dead_creator("dead")
    listed = irdma_cli("snapshot", "list", "/", "--meta", cl.meta_url).stdout
    assert "dead" in listed and "creating" in listed, listed
    young = irdma_cli("gc", "--meta", cl.meta_url).stdout
    assert "0 abandoned snapshots" in young, young  # it may still be in progress: kept
    age("dead")
    dry = irdma_cli("gc", "--dry-run", "--meta", cl.meta_url).stdout
    assert "would free:" in dry and "1 abandoned snapshots" in dry and "'dead'" in dry, dry
    done = irdma_cli("gc", "--meta", cl.meta_url).stdout
    assert "freed:" in done and "1 abandoned snapshots" in done, done
    assert "dead" not in irdma_cli("snapshot", "list", "/", "--meta", cl.meta_url).stdout

    async def after_gc() -> None:
        async with _open(cl) as c:
            await _clean(c, [])
            assert sum(st.chunks for _, st, _ in await c.shard_stats() if st is not None) == before
            await _exact(c, {"/w": w})

    trio.run(after_gc)
    dead_creator("dead2")
    age("dead2")

    async def keep() -> None:
        async with _open(cl) as c:
            await c.snapshot("/", "kept", keep=2)
            await _clean(c, ["kept"])
            await _exact(c, {"/w": w, "/.snapshots/kept/w": w})

    trio.run(keep)
