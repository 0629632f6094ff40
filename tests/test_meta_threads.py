"""The metadata worker threads (irdma.meta.aio.MetaThreads): what a caller of AsyncMeta relies on.

Values and errors come back to the caller; at most ``limit`` calls run at once; a caller
cancelled before its call is handed over runs nothing, one cancelled after gets the call's whole
effect (the call is not abandoned halfway) and the cancellation at its next checkpoint; idle
threads end. Real threads, a real trio run, a real SQLite engine for the last test."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from irdma.meta import open_meta
from irdma.meta.aio import AsyncMeta, MetaThreads


def _wait_until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.005)


def test_values_and_errors_come_back_to_the_caller_on_another_thread() -> None:
    pool = MetaThreads(2)

    async def main() -> None:
        here = threading.get_ident()
        assert await pool.run(threading.get_ident) != here
        assert await pool.run(lambda: 6 * 7) == 42
        with pytest.raises(KeyError, match="nope"):
            await pool.run(lambda: {}["nope"])
        assert await pool.run(lambda: "still serving") == "still serving"

    trio.run(main)


def test_at_most_limit_calls_run_at_once_and_all_finish() -> None:
    pool = MetaThreads(3)
    lock = threading.Lock()
    running = [0, 0]  # now, most

    def call(i: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i

    async def main() -> list[int]:
        out: list[int] = []

        async def one(i: int) -> None:
            out.append(await pool.run(lambda: call(i)))

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(one, i)
        return out

    assert sorted(trio.run(main)) == list(range(12))
    assert running[1] == 3
    assert pool.threads <= 3


def test_a_cancelled_call_either_never_ran_or_ran_to_its_end() -> None:
    pool = MetaThreads(1)
    ran: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def slow() -> None:
        started.set()
        release.wait(10)
        ran.append("slow")

    async def main() -> None:
        # cancelled before the hand-over: nothing runs
        with trio.CancelScope() as scope:
            scope.cancel()
            await pool.run(lambda: ran.append("never"))
        assert scope.cancelled_caught
        # cancelled while running: the call finishes, then the caller sees the cancellation
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(pool.run, slow)
                await trio.to_thread.run_sync(started.wait, 10)
                scope.cancel()
                with trio.CancelScope(shield=True):
                    await trio.sleep(0.05)
                assert ran == []  # the call is still running
                release.set()
        assert ran == ["slow"]  # the caller waited for it: not abandoned halfway

    trio.run(main)


def test_idle_threads_end() -> None:
    pool = MetaThreads(2, idle_s=0.05)

    async def main() -> None:
        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(pool.run, lambda: time.sleep(0.01))

    trio.run(main)
    assert pool.threads >= 1
    _wait_until(lambda: pool.threads == 0)
    assert trio.run(pool.run, lambda: "again") == "again"  # a new thread for a new call


def test_asyncmeta_calls_run_on_the_engine(tmp_path: object) -> None:
    store = open_meta(f"sqlite://{tmp_path}/meta.db", create=True)
    meta = AsyncMeta(store, threads=2)

    async def main() -> None:
        root = await meta.getattr(1)
        assert root.is_dir
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(meta.getattr, 1)
        with pytest.raises(Exception, match="no inode"):
            await meta.getattr(987654)

    try:
        trio.run(main)
    finally:
        store.close()
