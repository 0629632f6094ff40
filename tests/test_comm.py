"""Less and smarter communication (issue 12) on real shard processes: P3's slicing and priority
order (a high-priority pull overtakes a low-priority one in flight, and does not without a
priority), the residual cache of layer dropping (nothing lost, exactly), the xattrs, and the mount's
per-file priority and slices. Training with them (``DistributedOptimizer(overlap=, drop=, compress=,
hierarchy=, sync_every=)`` in ``model.fit``): tests/test_distributed.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import trio
import trio.testing
from helpers import Cluster, running_cluster

import irdma
from irdma._errors import InvalidArgument
from irdma.train import comm

MB = 1 << 20


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(str(tmp_path_factory.mktemp("comm")), shards=1, capacity=256 << 20, replicas=1) as c:
        yield c


def _race(url: str, low_level: int, high_level: int) -> list[str]:
    """A 24 MB pull in 160 KB slices at ``low_level`` through a one-request window, then, once
    its slices queue, a one-slice pull at ``high_level``: the order in which they finish."""
    order: list[str] = []
    lock = threading.Lock()
    with irdma.connect(url, transport="tcp", window=1) as c:
        c.write("/big", np.arange(6 * MB, dtype="<f4"), op="assign")  # 24 MB
        c.write("/small", np.ones(40_000, dtype="<f4"), op="assign")
        inode = c.stat("/big")
        window = c.client.pool.pull_limits[inode.stripe[0]]  # pulls have their own window

        def done(name: str) -> object:
            def cb(_: object) -> None:
                with lock:
                    order.append(name)
            return cb

        low = c.submit(lambda cl: cl.pull("/big"), priority=low_level, slice_bytes=160_000)
        low.add_done_callback(done("low"))
        end = time.monotonic() + 30
        while window.waiting < 10:  # the low pull's slices are queued behind the window
            assert not low.done() and time.monotonic() < end, "the low-priority pull never queued its slices"
            time.sleep(0.001)
        high = c.submit(lambda cl: cl.pull("/small"), priority=high_level, slice_bytes=160_000)
        high.add_done_callback(done("high"))
        np.testing.assert_array_equal(high.result(60), np.ones(40_000, dtype="<f4"))
        np.testing.assert_array_equal(low.result(60), np.arange(6 * MB, dtype="<f4"))
        assert window.in_flight == 0 and window.waiting == 0
    return order


def test_high_priority_pull_overtakes_a_low_priority_one_in_flight(one_shard: Cluster) -> None:
    assert _race(one_shard.meta_url, low_level=5, high_level=0) == ["high", "low"]


def test_without_priority_the_later_pull_waits_its_turn(one_shard: Cluster) -> None:
    assert _race(one_shard.meta_url, low_level=3, high_level=3) == ["low", "high"]


def test_slices_cut_pushes_and_pulls_into_requests_of_the_slice_size(one_shard: Cluster) -> None:
    sizes: list[int] = []
    with irdma.connect(one_shard.meta_url, transport="tcp") as c:
        data = np.arange(1_000_000, dtype="<f4")  # 4 MB
        c.write("/sliced", data, op="assign")
        conn = c.client.pool.conns[c.stat("/sliced").stripe[0]]
        inner_read = conn.read

        async def counting_read(file_id: int, chunk: int, offset: int, into: memoryview, *a: object) -> int:
            sizes.append(len(into))
            return await inner_read(file_id, chunk, offset, into, *a)

        conn.read = counting_read  # type: ignore[method-assign]
        out = c.submit(lambda cl: cl.pull("/sliced"), priority=2, slice_bytes=160_000).result(60)
        np.testing.assert_array_equal(out, data)
        assert max(sizes) == 160_000 and sum(sizes) == data.nbytes and len(sizes) >= 25
        sizes.clear()
        c.pull("/sliced")  # no slicing outside the context: pieces of up to a chunk or the max payload
        assert max(sizes) > 160_000
        conn.read = inner_read  # type: ignore[method-assign]


def test_window_admits_by_priority_and_a_cancelled_waiter_takes_nothing() -> None:
    async def main() -> list[int]:
        w = comm.PriorityWindow(1)
        got: list[int] = []
        w.acquire_nowait()  # the one permit is in flight
        doomed = trio.CancelScope()

        async def want(level: int) -> None:
            with comm.priority(level):
                await w.acquire()
            got.append(level)
            w.release()

        async def cancelled() -> None:
            with doomed, comm.priority(1):
                await w.acquire()
                got.append(-1)  # never: cancelled while waiting

        async with trio.open_nursery() as n:
            for level in (7, 3, 9, 3, 0):
                n.start_soon(want, level)
            n.start_soon(cancelled)
            await trio.testing.wait_all_tasks_blocked()
            assert w.waiting == 6
            doomed.cancel()  # the most urgent waiter but one gives up
            await trio.testing.wait_all_tasks_blocked()
            w.release()
        assert w.in_flight == 0 and w.waiting == 0
        return got

    assert trio.run(main) == [0, 3, 3, 7, 9]


def test_window_ages_a_waiter_past_max_wait_ahead_of_more_urgent_ones() -> None:
    clock = trio.testing.MockClock()

    async def main() -> list[int]:
        w = comm.PriorityWindow(1, max_wait=1.0)
        got: list[int] = []
        w.acquire_nowait()

        async def want(level: int) -> None:
            with comm.priority(level):
                await w.acquire()
            got.append(level)
            w.release()

        async with trio.open_nursery() as n:
            n.start_soon(want, 9)
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(2.0)  # the level-9 request has waited past max_wait
            n.start_soon(want, 0)
            await trio.testing.wait_all_tasks_blocked()
            w.release()
        return got

    assert trio.run(main, clock=clock) == [9, 0]


def test_window_fast_path_cancelled_at_its_checkpoint_takes_no_permit() -> None:
    """A permit is free and nobody waits (the fast path): an acquire cancelled at its
    checkpoint, by a cancel already pending or a deadline already past, leaves every permit
    free; one that returns holds exactly one."""

    async def main() -> None:
        w = comm.PriorityWindow(2)
        for _ in range(5):
            with trio.CancelScope() as scope:
                scope.cancel()
                await w.acquire()
            assert scope.cancelled_caught and w.in_flight == 0
            with trio.move_on_after(0) as late:
                await w.acquire()
            assert late.cancelled_caught and w.in_flight == 0
        await w.acquire()
        await w.acquire()
        assert w.in_flight == 2
        w.release()
        w.release()
        assert w.in_flight == 0

    trio.run(main)


def test_priority_and_slice_refuse_bad_values() -> None:
    for bad in (-1, comm.MAX_PRIORITY + 1, 1.5, True):
        with pytest.raises(ValueError, match="priority"):
            with comm.priority(bad):  # type: ignore[arg-type]
                pass
    with pytest.raises(ValueError, match="multiple of 4"):
        with comm.priority(0, slice_bytes=10):
            pass
    assert comm.current() == comm.Scheduling()


def test_residual_cache_loses_nothing_exactly() -> None:
    rng = np.random.default_rng(1)
    cache = comm.ResidualCache(threshold=0.05, scale=0.5)
    weights = {k: rng.integers(-50, 50, size=(64, 32)).astype(np.float32) for k in range(4)}
    computed = {k: np.zeros((64, 32), np.float32) for k in weights}
    pushed = {k: np.zeros((64, 32), np.float32) for k in weights}
    skipped = 0
    for step in range(60):
        for k, w in weights.items():
            scale = 16 if (step + k) % 9 == 0 else 1  # mostly small updates, now and then a big one
            g = (rng.integers(-4, 5, size=w.shape) * scale).astype(np.float32)  # integers: float32 sums are exact
            computed[k] += g
            out = cache.offer(k, g, w)
            if out is None:
                skipped += 1
            else:
                pushed[k] += out
    assert 0 < skipped < 240  # some pushes were dropped, some went
    for k in weights:
        np.testing.assert_array_equal(pushed[k] + cache.residual(k), computed[k])
    rest = cache.flush()
    for k in weights:
        np.testing.assert_array_equal(pushed[k] + rest.get(k, 0), computed[k])
        assert not cache.residual(k).any()


def test_residual_cache_threshold_zero_pushes_every_update_and_checks_shapes() -> None:
    cache = comm.ResidualCache(0.0)
    g = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(cache.offer("a", g, None), g)
    with pytest.raises(ValueError, match="shape"):
        cache.offer("a", np.zeros(5, np.float32), None)
    with pytest.raises(ValueError):
        comm.ResidualCache(-1.0)


def test_comm_xattrs_are_validated_and_normalized(one_shard: Cluster) -> None:
    with irdma.connect(one_shard.meta_url, transport="tcp") as c:
        c.makedirs("/job-x")
        ino = c.stat("/job-x").ino
        meta = c.client.store
        meta.setxattr(ino, comm.XATTR_SLICE, b" 40000 ")
        meta.setxattr(ino, comm.XATTR_PRIORITY, b"3")
        meta.setxattr(ino, comm.XATTR_DROP, b"1e-3")
        assert meta.getxattr(ino, comm.XATTR_SLICE) == b"40000"
        assert meta.getxattr(ino, comm.XATTR_DROP) == b"0.001"
        for name, bad in ((comm.XATTR_SLICE, b"-4"), (comm.XATTR_PRIORITY, b"first"), (comm.XATTR_DROP, b"2"),
                          (comm.XATTR_DROP, b"nan")):
            with pytest.raises(InvalidArgument):
                meta.setxattr(ino, name, bad)
        assert meta.getxattr(ino, comm.XATTR_PRIORITY) == b"3"  # unchanged by the refused ones


@pytest.mark.fuse
def test_mount_pushes_and_pulls_a_file_by_its_directory_priority_and_slices(one_shard: Cluster,
                                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    import errno
    import os

    from helpers import mounted

    with mounted(one_shard.meta_url, str(tmp_path_factory.mktemp("mnt") / "m")) as m:
        job = os.path.join(m, "job-p3")
        os.mkdir(job)
        os.setxattr(job, "user.irdma.priority", b"2")
        os.setxattr(job, "user.irdma.slice", b"1000")  # 4,000-byte slices
        with pytest.raises(OSError) as err:
            os.setxattr(job, "user.irdma.slice", b"lots")
        assert err.value.errno == errno.EINVAL
        assert os.getxattr(job, "user.irdma.slice") == b"1000"
        path = os.path.join(job, "layer-000")
        base = np.arange(100_000, dtype="<f4")
        with open(path, "wb") as f:
            f.write(base.tobytes())
        os.setxattr(path, "user.irdma.update", b"add")
        delta = np.full(100_000, 0.5, dtype="<f4")
        fd = os.open(path, os.O_RDWR)
        try:
            for _ in range(3):
                assert os.pwrite(fd, delta.tobytes(), 0) == delta.nbytes
            os.fsync(fd)
            got = np.frombuffer(os.pread(fd, base.nbytes, 0), dtype="<f4")
        finally:
            os.close(fd)
        np.testing.assert_array_equal(got, base + 1.5)
