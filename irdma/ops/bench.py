"""``irdma bench``: sequential pull/push bandwidth and small-request latency, like
``ib_write_bw`` or ``fio`` for irdma.

Against a cluster through the native client (``--meta``), or through a mount (``--mount``)
with plain ``os.pread``/``os.pwrite`` of ``--block`` bytes. Bandwidth is bytes moved over wall
time, in MB/s (10^6 bytes per second); latency in microseconds. Every run is bounded by the
file size and ``--latency-ops``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import trio

from .._errors import NotFound
from ..client.native import Client, layout_of
from ..placement import Layout
from ..wire.protocol import UpdateOp


@dataclass
class BenchResult:
    """One measured figure."""

    name: str  # "pull", "push-assign", "push-assign-existing", "push-add", "latency-4k-read"
    bytes: int = 0
    seconds: float = 0.0
    mb_s: float = 0.0
    p50_us: float | None = None
    p99_us: float | None = None
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class BenchConfig:
    size: int = 256 << 20  # bytes of the test file
    chunk_size: int = 4 << 20
    block: int = 4 << 20  # bytes per request
    concurrency: int = 4  # requests in flight
    latency_ops: int = 1000
    direct_io: bool = True  # through a mount: bulk parameters use direct I/O (xattr user.irdma.io)
    path: str = "/.irdma-bench"
    tests: tuple[str, ...] = ("push-assign", "pull", "push-add", "latency")


Progress = Callable[[str, int, int], None]  # (test, done bytes or ops, total)


def _mb_s(n: int, secs: float) -> float:
    return n / secs / 1e6 if secs > 0 else 0.0


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    us = sorted(x * 1e6 for x in samples_s)
    p50 = statistics.median(us)
    p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
    return p50, p99


async def bench_native(client: Client, cfg: BenchConfig, progress: Progress) -> list[BenchResult]:
    """Run the benchmark through the native client. The file is removed at the end."""
    results: list[BenchResult] = []
    with contextlib.suppress(NotFound):  # left over from an interrupted run
        await client.unlink(cfg.path)
    inode = await client.create(cfg.path, chunk_size=cfg.chunk_size)
    layout = layout_of(inode)
    src = np.random.default_rng(0).integers(0, 255, cfg.block, dtype=np.uint8).tobytes()
    blocks = list(range(0, cfg.size, cfg.block))

    async def stream(name: str, fn: Callable[[Layout, int, int], object]) -> BenchResult:
        done = 0
        limiter = trio.Semaphore(cfg.concurrency)

        async def one(off: int) -> None:
            nonlocal done
            async with limiter:
                n = min(cfg.block, cfg.size - off)
                await fn(layout, off, n)  # type: ignore[misc]
                done += n
                progress(name, done, cfg.size)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for off in blocks:
                nursery.start_soon(one, off)
        secs = time.perf_counter() - t0
        return BenchResult(name, cfg.size, secs, _mb_s(cfg.size, secs))

    async def push(op: UpdateOp) -> Callable[[Layout, int, int], object]:
        async def fn(layout: Layout, off: int, n: int) -> None:
            await client.write_from(layout, off, memoryview(src)[:n], op)

        return fn

    bufs = [bytearray(cfg.block) for _ in range(cfg.concurrency)]
    free = list(range(cfg.concurrency))

    async def pull(layout: Layout, off: int, n: int) -> None:
        i = free.pop()
        try:
            await client.read_into(layout, off, memoryview(bufs[i])[:n])
        finally:
            free.append(i)

    try:
        if {"push-assign", "pull", "push-assign-existing", "latency"} & set(cfg.tests):
            r = await stream("push-assign", await push(UpdateOp.ASSIGN))
            await client.meta.extend(inode.ino, cfg.size, time.time_ns())
            if "push-assign" in cfg.tests:
                results.append(r)
        if "pull" in cfg.tests:
            results.append(await stream("pull", pull))
        if "push-assign-existing" in cfg.tests:  # the chunks exist now: no fresh shard memory
            results.append(await stream("push-assign-existing", await push(UpdateOp.ASSIGN)))
        if "push-add" in cfg.tests:
            results.append(await stream("push-add", await push(UpdateOp.ADD)))
        if "latency" in cfg.tests:
            rng = np.random.default_rng(1)
            buf = memoryview(bytearray(4096))
            samples = []
            for i in range(cfg.latency_ops):
                off = int(rng.integers(0, max(1, cfg.size // 4096))) * 4096
                t0 = time.perf_counter()
                await client.read_into(layout, off, buf)
                samples.append(time.perf_counter() - t0)
                if i % 50 == 0:
                    progress("latency-4k-read", i, cfg.latency_ops)
            p50, p99 = _percentiles(samples)
            results.append(BenchResult("latency-4k-read", 4096 * len(samples), sum(samples),
                                       _mb_s(4096 * len(samples), sum(samples)), p50, p99))
    finally:
        await client.unlink(cfg.path)
    return results


def bench_mount(mountpoint: str, cfg: BenchConfig, progress: Progress) -> list[BenchResult]:
    """Run the benchmark through a mount with plain os calls (threads for concurrency)."""
    path = os.path.join(mountpoint, cfg.path.lstrip("/"))
    results: list[BenchResult] = []
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.close(fd)
    os.setxattr(path, "user.irdma.chunk_size", str(cfg.chunk_size).encode())
    if cfg.direct_io:
        os.setxattr(path, "user.irdma.io", b"direct")
    src = np.random.default_rng(0).integers(0, 255, cfg.block, dtype=np.uint8).tobytes()
    blocks = list(range(0, cfg.size, cfg.block))

    def stream(name: str, op: str) -> BenchResult:
        fd = os.open(path, os.O_RDWR)
        lock = threading.Lock()
        done = [0]
        todo = list(reversed(blocks))

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    off = todo.pop()
                n = min(cfg.block, cfg.size - off)
                if op == "read":
                    got = len(os.pread(fd, n, off))
                    assert got == n, f"short read {got} of {n} at {off}"
                else:
                    os.pwrite(fd, src[:n], off)
                with lock:
                    done[0] += n
                    progress(name, done[0], cfg.size)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(cfg.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # the close waits for every push (FUSE flush): the bytes are acknowledged by the shards
        # when the clock stops, as a native push's are (fsync would also have them sync to disk)
        os.close(fd)
        secs = time.perf_counter() - t0
        return BenchResult(name, cfg.size, secs, _mb_s(cfg.size, secs))

    try:
        r = stream("push-assign", "write")
        if "push-assign" in cfg.tests:
            results.append(r)
        if "pull" in cfg.tests:
            results.append(stream("pull", "read"))
        if "push-assign-existing" in cfg.tests:
            results.append(stream("push-assign-existing", "write"))
        if "push-add" in cfg.tests:
            os.setxattr(path, "user.irdma.update", b"add")
            results.append(stream("push-add", "write"))
            os.setxattr(path, "user.irdma.update", b"assign")
        if "latency" in cfg.tests:
            rng = np.random.default_rng(1)
            samples = []
            # O_DIRECT: every read is a request to the mount, not a page-cache hit
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
            try:
                for i in range(cfg.latency_ops):
                    off = int(rng.integers(0, max(1, cfg.size // 4096))) * 4096
                    t0 = time.perf_counter()
                    os.preadv(fd, [buf], off)
                    samples.append(time.perf_counter() - t0)
                    if i % 50 == 0:
                        progress("latency-4k-read", i, cfg.latency_ops)
            finally:
                os.close(fd)
                buf.close()
            p50, p99 = _percentiles(samples)
            results.append(BenchResult("latency-4k-read", 4096 * len(samples), sum(samples),
                                       _mb_s(4096 * len(samples), sum(samples)), p50, p99))
    finally:
        os.unlink(path)
    return results


def as_dicts(results: list[BenchResult]) -> list[dict[str, object]]:
    return [asdict(r) for r in results]
