"""A job's membership (irdma.train.coord): heartbeats, rejoining at the current clock, job
barriers, elastic clock waits, and the error a survivor gets when a worker is missing; and
``irdma run --elastic``: a worker killed mid-epoch is restarted, rejoins, and the job finishes
with the accuracy of one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from irdma.meta import open_meta
from irdma.meta.aio import AsyncMeta
from irdma.train import coord

BSP = coord.parse_consistency("bsp")


@pytest.fixture
def meta(tmp_path: Any) -> Iterator[AsyncMeta]:
    m = AsyncMeta(open_meta(f"sqlite://{tmp_path}/meta.db", create=True))
    yield m
    m.store.close()


def dead_pid() -> int:
    """The pid of a process that ran and is gone (reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def run(fn: Any, *args: Any) -> Any:
    return trio.run(fn, *args)


def test_a_worker_that_joins_late_or_comes_back_starts_at_the_jobs_current_clock(meta: AsyncMeta) -> None:
    job = 42

    async def main() -> None:
        host, pid = coord.whoami()
        assert await meta.member_join(job, 0, host, pid) == 0
        for _ in range(5):
            await meta.clock_tick(job, 0)
        assert await meta.member_join(job, 1, host, pid) == 5  # late: at worker 0's clock
        await meta.clock_tick(job, 1)
        assert await meta.member_join(job, 0, host, pid) == 6  # after a barrier: up to the largest
        await meta.member_leave(job, 1)
        assert not await meta.member_beat(job, 1)  # left: it must join again to count
        assert await meta.member_beat(job, 0, 3)
        members = {m.worker: m for m in await meta.members(job)}
        assert members[0].live and members[0].epoch == 3 and not members[0].left
        assert members[1].left and not members[1].live
        # a member whose process is gone (this host) is dead at once, and its clock is not followed
        await meta.member_join(job, 2, host, dead_pid())
        for _ in range(10):
            await meta.clock_tick(job, 2)
        assert not {m.worker: m for m in await meta.members(job)}[2].live
        assert await meta.member_join(job, 3, host, pid) == 6

    run(main)


def test_a_survivor_names_the_dead_worker_and_the_fix_and_an_elastic_job_goes_on(meta: AsyncMeta) -> None:
    job, dead = 7, dead_pid()

    async def main() -> None:
        host, pid = coord.whoami()
        await meta.member_join(job, 0, host, pid)
        await meta.member_join(job, 1, host, dead)
        with pytest.raises(coord.SyncTimeout) as caught:
            await coord.tick(meta, job, 0, 2, BSP, 0.3)
        text = f"{caught.value} {caught.value.hint}"
        assert f"worker 1 (clock 0; its process {dead} on {host} is gone) is more than 0 clocks behind" in text
        assert "restart the missing worker with the same rank" in text and "--elastic" in text
        # elastic: the dead worker no longer counts; the clock goes on at once
        with trio.fail_after(5):
            assert await coord.tick(meta, job, 0, 2, BSP, 30, (1, 2)) == 2
        # but never below the minimum of live workers
        with pytest.raises(coord.SyncTimeout, match="1 workers are live, fewer than the elastic minimum 2"):
            await coord.tick(meta, job, 0, 2, BSP, 0.3, (2, 2))
        # a worker that finished is never waited for, elastic or not
        await meta.member_join(job, 1, host, pid)
        await meta.member_leave(job, 1)
        with trio.fail_after(5):
            await coord.tick(meta, job, 0, 2, BSP, 30)

    run(main)


def test_a_parked_worker_does_not_hold_back_an_elastic_clock_and_a_job_barrier_waits_for_the_live(
        meta: AsyncMeta) -> None:
    job, elastic = 9, (1, 4)

    async def main() -> None:
        host, pid = coord.whoami()
        for w in (0, 1, 2):
            await meta.member_join(job, w, host, pid)
        await meta.member_join(job, 3, host, dead_pid())  # died: an elastic barrier does not wait for it
        passed = {w: trio.Event() for w in (0, 1, 2)}

        async def at_barrier(w: int) -> None:
            await coord.job_barrier(meta, job, "epoch-0", w, 4, elastic, 30)
            passed[w].set()

        async def steps(w: int) -> None:
            for _ in range(3):
                await coord.tick(meta, job, w, 4, BSP, 30, elastic)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(at_barrier, 0)
                while not any(m.parked for m in await meta.members(job)):  # noqa: ASYNC110 - state in the database
                    await trio.sleep(0.01)
                async with trio.open_nursery() as workers:  # worker 0 is parked: 1 and 2 step on under BSP
                    workers.start_soon(steps, 1)
                    workers.start_soon(steps, 2)
                assert not passed[0].is_set()
                nursery.start_soon(at_barrier, 1)
                with pytest.raises(coord.SyncTimeout, match=r"worker 0 \(clock 0; waiting at barrier epoch-0\)"):
                    await coord.job_barrier(meta, job, "epoch-1", 2, 4, elastic, 0.3)
                assert 2 not in await meta.arrivals(job, "epoch-1")  # a wait that gave up is taken back
                assert not passed[0].is_set() and not passed[1].is_set()  # worker 2 is live and has not arrived
                nursery.start_soon(at_barrier, 2)
        assert all(e.is_set() for e in passed.values())
        assert (await meta.clocks(job))[0] == 3  # worker 0 joined again at the job's clock
        assert await meta.arrivals(job, "epoch-0") == [0, 1, 2]
        assert not any(m.parked for m in await meta.members(job))

    run(main)


# ---------------------------------------------------------------- irdma run --elastic, end to end
SCRIPT = os.path.join(os.path.dirname(__file__), "elastic_digits.py")


def _accuracy(out: str) -> float:
    found = re.findall(r"accuracy: (0\.\d+)", out)
    assert found, out[-3000:]
    return float(found[-1])


@pytest.mark.long  # 72 s: make test-long (CI's time)
@pytest.mark.slow
def test_a_worker_killed_mid_epoch_is_restarted_and_the_elastic_job_finishes_within_a_point(tmp_path: Any) -> None:
    """Rank 1 SIGKILLs itself in epoch 3 of 40 on its first run; ``irdma run --elastic 2:2``
    restarts it while rank 0 waits for the job's minimum of live workers (never fewer than
    MIN); the round it died in completes with rank 0's push alone (the shards' sum of a round:
    rank 0 closes it once the job's clock passed it, and says so); rank 1 rejoins at the job's
    clock, epoch and weights, and rank 0's test accuracy is within
    1 point of one process training alone. (Going on below MIN's count without the dead worker
    is test_a_survivor_names_the_dead_worker_and_the_fix_and_an_elastic_job_goes_on's.)"""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    cli = [sys.executable, "-m", "irdma.ops.cli", "run", "--shards", "2", "--capacity", "64MiB"]
    alone = subprocess.run([*cli, "-n", "1", "--", sys.executable, SCRIPT],
                           capture_output=True, text=True, timeout=600, env=env)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    both = subprocess.run([*cli, "-n", "2", "--elastic", "2:2", "--consistency", "bsp", "--",
                           sys.executable, SCRIPT, "--die-in-epoch", "3"],
                          capture_output=True, text=True, timeout=600, env=env)
    out = both.stdout + both.stderr
    assert both.returncode == 0, out[-4000:]
    assert re.search(r"rank 1 was killed by SIGKILL; restarting it \(restart 1 of 3\)", out), out[-4000:]
    assert re.search(r"rank 1 rejoins job \S+ at its current clock and epoch 3\b", out), out[-4000:]
    # the round rank 1 died in (rank 0 had pushed) completed with rank 0 alone
    assert re.search(r"\[0\].*BSP job \S+: round \d+ completed with the workers that pushed", out), out[-4000:]
    assert abs(_accuracy(out) - _accuracy(alone.stdout)) <= 0.01, (alone.stdout[-500:], out[-2000:])


@pytest.mark.slow
def test_without_elastic_the_survivor_fails_naming_the_dead_worker_and_the_fix(tmp_path: Any) -> None:
    """Two workers started by hand on a BSP job (no launcher to stop them); rank 1 is killed in
    epoch 1: rank 0's model.fit fails at the job's sync timeout with an error that names worker
    1, says its process is gone, and says what to do."""
    from helpers import running_cluster

    from irdma.ops import launch

    with running_cluster(str(tmp_path / "c"), shards=2, replicas=1) as c:
        job = launch.prepare_job(c.meta_url, "bsp", 2, "bsp", None)
        procs = []
        for rank in (0, 1):
            env = launch.worker_env(job, rank, 2, base=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "--die-in-epoch", "1", "--sync-timeout", "4"],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0
    err = outs[0][1]
    assert re.search(rf"worker 1 \(clock \d+; its process {procs[1].pid} on \S+ is gone\) is more than 0 clocks"
                     r" behind", err), err[-3000:]
    assert "restart the missing worker with the same rank" in err, err[-3000:]
