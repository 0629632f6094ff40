"""Worker processes for the side-by-side benchmarks: one push-and-pull round of a model.

Each worker, per round, pushes a gradient for every layer and then pulls every layer. All
workers wait on a barrier file before they start, so their rounds overlap.

    python benchmarks/workers.py irdma-native META SHAPES ROUNDS RANK START_FILE
    python benchmarks/workers.py irdma-mount MOUNTDIR SHAPES ROUNDS RANK START_FILE
    python benchmarks/workers.py irdma-native-unified META SHAPES ROUNDS RANK START_FILE
    python benchmarks/workers.py irdma-native-bsp 'META|JOB|push' SHAPES ROUNDS RANK START_FILE  (or |round)
    python benchmarks/workers.py irdma-mount-unified MOUNTDIR SHAPES ROUNDS RANK START_FILE
    python benchmarks/workers.py redis PORT,PORT SHAPES ROUNDS RANK START_FILE

Prints one JSON line: {"round_s": seconds per round, "bytes": bytes moved per round}; the
native workers add "rounds_t", each timed round's start and end, in order (``time.monotonic()``: :mod:`benchmarks.snapshots` sorts rounds by what ran
meanwhile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np


def _wait_for(path: str, timeout: float = 120.0) -> None:
    """Say this worker is ready (``PATH.ready.PID``), then wait for the start signal ``PATH``."""
    open(f"{path}.ready.{os.getpid()}", "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no start signal {path} within {timeout} s")
        time.sleep(0.001)


#: Each timed round's start and end, ``time.monotonic()`` seconds (one clock for every process
#: of the machine), of the last :func:`_timed_async` (printed as "rounds_t").
ROUNDS_T: list[tuple[float, float]] = []


async def _timed_async(one_round: Callable[[], Awaitable[None]], rounds: int, start: str) -> float:
    """Seconds per round: one warm-up round, untimed (as every system here gets), then the
    start barrier, then ``rounds`` timed rounds (each one's start and end in :data:`ROUNDS_T`)."""
    await one_round()
    _wait_for(start)
    ROUNDS_T.clear()
    t0 = time.perf_counter()
    for _ in range(rounds):
        m = time.monotonic()
        await one_round()
        ROUNDS_T.append((m, time.monotonic()))
    return (time.perf_counter() - t0) / rounds


def irdma_native(meta: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    import trio

    import irdma
    from irdma.client.native import layout_of
    from irdma.wire.protocol import UpdateOp

    grads = [np.full(int(np.prod(s)), 1e-3, "<f4") for s in shapes]
    outs = [np.empty(int(np.prod(s)), "<f4") for s in shapes]

    async def main() -> float:
        async with irdma.Client.open(meta, transport="tcp") as c:
            layouts = [layout_of(c.store.resolve(f"/model/l{i:03d}")) for i in range(len(shapes))]
            limit = trio.CapacityLimiter(16)

            async def push(i: int) -> None:
                async with limit:
                    await c.write_from(layouts[i], 0, memoryview(grads[i]).cast("B"), UpdateOp.ADD)

            async def pull(i: int) -> None:
                async with limit:
                    await c.read_into(layouts[i], 0, memoryview(outs[i]).cast("B"))

            async def one_round() -> None:
                async with trio.open_nursery() as n:  # push every layer, all in flight
                    for i in range(len(shapes)):
                        n.start_soon(push, i)
                async with trio.open_nursery() as n:  # then pull every layer
                    for i in range(len(shapes)):
                        n.start_soon(pull, i)

            return await _timed_async(one_round, rounds, start)

    return trio.run(main)


def irdma_mount(mountdir: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    from concurrent.futures import ThreadPoolExecutor

    grads = [np.full(int(np.prod(s)), 1e-3, "<f4").tobytes() for s in shapes]
    paths = [os.path.join(mountdir, "model", f"l{i:03d}") for i in range(len(shapes))]

    def push(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY)
        try:
            os.write(fd, grads[i])
        finally:
            os.close(fd)  # close: the push is acknowledged by the shard

    def pull(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.read()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(push, range(len(shapes))))  # warm-up, untimed
        list(pool.map(pull, range(len(shapes))))
        _wait_for(start)
        t0 = time.perf_counter()
        for _ in range(rounds):
            list(pool.map(push, range(len(shapes))))
            list(pool.map(pull, range(len(shapes))))
        return (time.perf_counter() - t0) / rounds


def irdma_native_unified(meta: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    """SoftMemoryBox II's unified buffer: every tensor at its offset in one file ``/model/params``
    (update op ``add``); a round is one push of all gradients and one pull of all weights."""
    import trio

    import irdma
    from irdma.client.native import layout_of
    from irdma.wire.protocol import UpdateOp

    total = sum(int(np.prod(s)) for s in shapes)
    grads = np.full(total, 1e-3, "<f4")
    out = np.empty(total, "<f4")

    async def main() -> float:
        async with irdma.Client.open(meta, transport="tcp") as c:
            layout = layout_of(c.store.resolve("/model/params"))

            async def one_round() -> None:
                await c.write_from(layout, 0, memoryview(grads).cast("B"), UpdateOp.ADD)
                await c.read_into(layout, 0, memoryview(out).cast("B"))

            return await _timed_async(one_round, rounds, start)

    return trio.run(main)


def irdma_mount_unified(mountdir: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    """The unified buffer through the mount, as :class:`irdma.train.keras.ShardOptimizer` moves it: the
    file stays open across rounds; a round is one ``pwrite`` of all gradients and one
    ``preadv`` of all weights (the read waits for this mount's push: read your writes)."""
    total = sum(int(np.prod(s)) for s in shapes)
    grads = np.full(total, 1e-3, "<f4")
    out = np.empty(total, "<f4")
    fd = os.open(os.path.join(mountdir, "model", "params"), os.O_RDWR)
    view = memoryview(out).cast("B")

    def one_round() -> None:
        os.pwrite(fd, grads, 0)
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], got)
            if n <= 0:
                raise SystemExit(f"short read at {got}")
            got += n

    try:
        one_round()  # warm-up, untimed
        _wait_for(start)
        t0 = time.perf_counter()
        for _ in range(rounds):
            one_round()
        return (time.perf_counter() - t0) / rounds
    finally:
        os.close(fd)


def redis_peer(ports: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    import redis

    conns = [redis.Redis(host="127.0.0.1", port=int(p)) for p in ports.split(",")]
    grads = [np.full(int(np.prod(s)), 1e-3, "<f4") for s in shapes]
    keys = [f"l{i:03d}" for i in range(len(shapes))]

    def push(i: int) -> None:
        r = conns[i % len(conns)]
        while True:  # read-modify-write under WATCH: an update lost to a race is retried
            with r.pipeline() as p:
                try:
                    p.watch(keys[i])
                    cur = np.frombuffer(p.get(keys[i]), "<f4")
                    p.multi()
                    p.set(keys[i], (cur + grads[i]).tobytes())
                    p.execute()
                    return
                except redis.WatchError:
                    continue

    def pull_all() -> None:
        for k, r in enumerate(conns):
            p = r.pipeline(transaction=False)
            for i in range(k, len(keys), len(conns)):
                p.get(keys[i])
            for v in p.execute():
                np.frombuffer(v, "<f4")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(conns) * 2) as pool:
        list(pool.map(push, range(len(shapes))))  # warm-up, untimed
        pull_all()
        _wait_for(start)
        t0 = time.perf_counter()
        for _ in range(rounds):
            list(pool.map(push, range(len(shapes))))
            pull_all()
        return (time.perf_counter() - t0) / rounds


def irdma_native_bsp(target: str, shapes: list[tuple[int, ...]], rounds: int, start: str) -> float:
    """A BSP round of the unified buffer ``/model/bsp`` (update op SGD with momentum): one push of
    all gradients, the worker's clock in job ``JOB`` (both workers' pushes are in), one pull of all
    weights. ``target`` is ``META|JOB|MODE``: MODE ``push`` takes one optimizer step per worker's
    push (SSP/ASP's, and BSP's before issue 38), ``round`` sums the workers' pushes on the shards
    and takes one step on their mean (:mod:`irdma.server.rounds`)."""
    import dataclasses

    import trio

    import irdma
    from irdma.client.native import layout_of
    from irdma.wire.optimizers import parse_update
    from irdma.wire.protocol import Round, as_update

    meta, job, mode = target.split("|")
    rank = int(sys.argv[5])
    total = sum(int(np.prod(s)) for s in shapes)
    grads = np.full(total, 1e-3, "<f4")
    out = np.empty(total, "<f4")

    async def main() -> float:
        async with irdma.Client.open(meta, transport="tcp") as c:
            inode = c.store.resolve("/model/bsp")
            layout, job_ino = layout_of(inode), c.store.resolve(job).ino
            update = as_update(parse_update(inode.update_op))
            clock = [0]

            async def one_round() -> None:
                op = update if mode == "push" else dataclasses.replace(update, round=Round(job_ino, clock[0], rank, 2))
                await c.write_from(layout, 0, memoryview(grads).cast("B"), op)
                clock[0] = await c.clock_at(job_ino, rank)
                await c.read_into(layout, 0, memoryview(out).cast("B"))

            return await _timed_async(one_round, rounds, start)

    return trio.run(main)


def main() -> None:
    kind, target, shapes_file, rounds, rank, start = sys.argv[1:7]
    with open(shapes_file) as f:
        shapes = [tuple(s) for s in json.load(f)]
    fn = {"irdma-native": irdma_native, "irdma-mount": irdma_mount, "irdma-native-unified": irdma_native_unified,
          "irdma-mount-unified": irdma_mount_unified, "redis": redis_peer, "irdma-native-bsp": irdma_native_bsp}[kind]
    secs = fn(target, shapes, int(rounds), start)
    nbytes = 2 * 4 * sum(int(np.prod(s)) for s in shapes)
    out: dict[str, object] = {"rank": int(rank), "round_s": secs, "bytes": nbytes}
    if ROUNDS_T:
        out["rounds_t"] = ROUNDS_T
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
