"""Consistency models and synchronization functions, over the metadata engine (async, trio).

Consistency (per job directory)
-------------------------------
A directory is a training *job* when it has ``user.irdma.consistency`` = ``asp`` | ``bsp`` |
``ssp:S`` and ``user.irdma.workers`` = N. Each worker ``0 .. N-1`` has a *clock*, the number
of push rounds it finished; it advances it at the end of each round by reading
``DIR/.irdma-clock@K`` through the mount (a read: the kernel serializes writes and setxattr
on one inode, so a wait there would hold the other workers back), :meth:`irdma.Client.clock`
natively. Under
SSP with staleness S (Ho et al., "More Effective Distributed ML via a Stale Synchronous
Parallel Parameter Server", NIPS 2013; Petuum) a worker whose clock is now ``c`` may pull the
parameters of round ``c + 1`` only once the slowest worker's clock is at least ``c - S``; BSP
is S = 0 (every worker waits for every other at each round, a barrier); ASP never waits. The
clock call itself blocks until that holds, so the pull that follows it is never staler than
S rounds: tick, then pull. The clocks live in the metadata engine (SQLite for one host,
PostgreSQL for many), so every mount and native client of the namespace sees the same ones.

A worker that died or hangs never blocks the others forever: a wait gives up at its deadline
(``user.irdma.sync_timeout`` on the job directory, seconds, default 60) with
:class:`SyncTimeout` (ETIMEDOUT through the mount) naming the workers behind and, for each,
whether its process is gone or its heartbeats stopped; the job then either stops, or goes on
with fewer workers after ``user.irdma.workers`` is rewritten (workers with ids past the new N
no longer count).

Membership and elastic jobs (Horovod Elastic's and torchrun's behaviour)
------------------------------------------------------------------------
A worker of :mod:`irdma.keras` is a *member* of its job (the metadata engine's ``members``
table): it joins (:func:`join`), beats every :data:`HEARTBEAT_S` seconds, records the epoch
it began and leaves when it finishes. A member is *live* while it beats (within
:data:`~irdma.meta.base.MEMBER_EXPIRY_S`) and, on the metadata client's host, its process
runs: a killed worker stops counting at once. A member that finished (left) is never waited
for. A worker that joins while the others train, a restarted one or one whose heartbeats
lapsed, joins *at the current clock*: its clock moves up to the largest of the live members'
(and it pulls the current weights before its first step).

With ``user.irdma.elastic`` = ``MIN:MAX`` on the job directory (``irdma run --elastic``) a
clock wait counts only the live members that are not parked at a job barrier (a dead worker
no longer holds the others back; a worker waiting at the end of its epoch for a late one does
not hold that one back either), and waits while fewer than MIN are live; worker ids run from
0 to MAX - 1. Without it every worker ``0 .. N-1`` that has not left counts, live or not.
*Job barriers* (:func:`job_barrier`) are passed once every live member arrived (elastic) or
every worker that has not left (otherwise); arrivals are kept, so a worker that rejoins and
reaches a barrier the others passed goes through. Each arrival records the worker's clock, and
a worker leaving the barrier moves its clock up to the largest of those (a worker that arrived
early, not counted meanwhile, catches up): never to a clock a worker that passed first reached
since, which under BSP would count a step the slower one never took and leave the two waiting
for each other at the next barrier.

Synchronization functions (SoftMemoryBox II, Ahn et al., IEEE Access 2020)
--------------------------------------------------------------------------
``barrier(name, n)``: returns once ``n`` callers arrived (one generation; the next ``n``
arrivals form the next). ``lock(name, lease)``: exclusive, held until released or until the
lease runs out (a holder that dies frees it after at most the lease); a holder renews by
acquiring again. ``fetch_add(name, delta)``: atomic add on a 64-bit counter, returning the
value before. Every wait has a deadline and raises :class:`SyncTimeout` at it, and may be
cancelled (trio): a barrier arrival that gives up either way is withdrawn (under a shielded
cancel scope with its own deadline, :data:`WITHDRAW_S`), so the next generation never counts a
caller that left. Through a mount the objects have owners and permission bits and a lock's
lease is capped by ``user.irdma.max_lease`` (:mod:`irdma.fs.control`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import trio

from .._errors import InvalidArgument, IrdmaError, NoAttribute, SyncTimeout
from ..meta.base import MEMBER_EXPIRY_S, Member
from ..xattrs import XATTR_CONSISTENCY, XATTR_ELASTIC, XATTR_SYNC_TIMEOUT, XATTR_WORKERS, Consistency

if TYPE_CHECKING:
    from ..meta.aio import AsyncMeta

#: Seconds between a member's heartbeats.
HEARTBEAT_S = 1.0
#: Polling of the shared state: from the first interval, doubling up to the last (seconds).
POLL_FIRST, POLL_MAX = 0.002, 0.05
#: Deadline (seconds) of the shielded withdrawal of a barrier arrival that gave up; each
#: metadata call is bounded by the engine's own timeout besides.
WITHDRAW_S = 10.0

log = logging.getLogger("irdma.coord")


def behind(clocks: dict[int, int], workers: int | list[int], clock: int, staleness: int) -> list[int]:
    """The workers (``0 .. workers-1``, or those listed) too far behind for a worker at
    ``clock`` to go on (SSP's condition)."""
    ids = range(workers) if isinstance(workers, int) else workers
    return [w for w in ids if clocks.get(w, 0) < clock - staleness]


def counted(members: list[Member], workers: int, elastic: tuple[int, int] | None, me: int) -> list[int]:
    """The workers a clock wait of worker ``me`` waits for (see the module docstring)."""
    if elastic is not None:
        return [m.worker for m in members if m.live and m.parked is None and m.worker != me]
    gone = {m.worker for m in members if m.left}
    return [w for w in range(workers) if w not in gone and w != me]


def describe_workers(ids: list[int], members: list[Member], clocks: dict[int, int]) -> str:
    """``worker 1 (clock 17; its process 4242 on host h is gone), ...``: what a timeout names."""
    by_id = {m.worker: m for m in members}
    out = []
    for w in ids:
        m, what = by_id.get(w), f"clock {clocks.get(w, 0)}"
        if m is None:
            what += "; it never joined"
        elif not m.live:
            age = (time.time_ns() - m.heartbeat_ns) / 1e9
            what += (f"; no heartbeat for {age:.0f} s" if age > MEMBER_EXPIRY_S
                     else f"; its process {m.pid} on {m.host} is gone")
        elif m.parked is not None:
            what += f"; waiting at barrier {m.parked}"
        out.append(f"worker {w} ({what})")
    return ", ".join(out)


#: What to do about a SyncTimeout: of a clock wait, of a barrier or lock wait.
_CLOCK_HINT = ("restart the missing worker with the same rank (it rejoins at the job's current clock); run the"
               " job elastic to go on without a dead worker (`irdma run --elastic MIN:MAX`, or lower"
               " user.irdma.workers); raise user.irdma.sync_timeout for slow ones")
_SYNC_HINT = ("check that every party is alive; through a mount, `irdma mount --sync-timeout` sets the deadline"
              " (natively: the timeout argument)")


async def _poll(check: Any, deadline: float, what: str, hint: str = _CLOCK_HINT) -> Any:
    """Await ``check()`` until it returns something true, polling with backoff; SyncTimeout at
    ``deadline`` (trio time)."""
    interval = POLL_FIRST
    while True:
        out = await check()
        if out:
            return out
        if trio.current_time() >= deadline:
            raise SyncTimeout(f"{what}: gave up at the deadline", hint)
        await trio.sleep(min(interval, max(0.0, deadline - trio.current_time())))
        interval = min(interval * 2, POLL_MAX)


#: Seconds a job directory's settings (consistency, workers, sync timeout, elastic) serve its
#: clock ticks (:meth:`irdma.Client.clock_at`) before they are read again.
JOB_SETTINGS_S = 1.0


class JobSettings:
    """Job directories' inodes and settings xattrs as one client's clock ticks read them."""

    def __init__(self, meta: AsyncMeta) -> None:
        self.meta = meta
        #: job (path or inode) -> (inode, xattrs, when read (monotonic s), meta.changes then)
        self._jobs: dict[int | str, tuple[int, tuple[bytes | None, ...], float, int]] = {}

    async def get(self, job: int | str) -> tuple[int, tuple[bytes | None, ...]]:
        """A job directory's inode and its consistency, workers, sync timeout and elastic
        xattrs (None: not set), as read at most :data:`JOB_SETTINGS_S` ago and not since this
        client changed the namespace or an xattr (``AsyncMeta.changes``): a step's clock tick
        is then one metadata call, not six. Another client's change of them is seen within
        that time.

        Raises:
            NotFound: no such directory. The metadata engine's errors.
        """
        got = self._jobs.get(job)
        now = time.monotonic()
        if got is not None and now - got[2] < JOB_SETTINGS_S and got[3] == self.meta.changes:
            return got[0], got[1]
        changes = self.meta.changes
        ino = job if isinstance(job, int) else (await self.meta.resolve(job)).ino

        async def xattr(name: bytes) -> bytes | None:
            try:
                return await self.meta.getxattr(ino, name)
            except NoAttribute:
                return None

        raw = (await xattr(XATTR_CONSISTENCY), await xattr(XATTR_WORKERS), await xattr(XATTR_SYNC_TIMEOUT),
               await xattr(XATTR_ELASTIC))
        if len(self._jobs) >= 256:
            self._jobs.clear()
        self._jobs[job] = self._jobs[ino] = (ino, raw, now, changes)
        return ino, raw


async def tick(meta: AsyncMeta, job: int, worker: int, workers: int, consistency: Consistency, timeout: float,
               elastic: tuple[int, int] | None = None) -> int:
    """Advance ``worker``'s clock in ``job`` and wait, at most ``timeout`` seconds, until it may
    pull its next round (``elastic``: the job's MIN:MAX, see the module docstring).

    Returns:
        The worker's new clock.

    Raises:
        InvalidArgument: ``worker`` is not below ``workers``. SyncTimeout: workers stayed too
            far behind until the deadline (the clock did advance); it names each and why.
    """
    if not 0 <= worker < workers:
        raise InvalidArgument(f"worker {worker} is not one of the job's {workers} workers (0 to {workers - 1})")
    clock = await meta.clock_tick(job, worker)
    if consistency.staleness is None:
        return clock
    staleness = consistency.staleness
    last: list[int] = []
    state: dict[str, Any] = {}

    async def ready() -> bool:
        nonlocal last
        members = await meta.members(job)
        state.update(members=members, clocks=await meta.clocks(job))
        last = behind(state["clocks"], counted(members, workers, elastic, worker), clock, staleness)
        if elastic is not None:
            live = sum(m.live or m.left for m in members)  # a worker that finished is no loss
            state["live"] = live
            if live < elastic[0]:
                return False
        return not last

    try:
        await _poll(ready, trio.current_time() + timeout, f"worker {worker} at clock {clock} under {consistency.name}")
    except SyncTimeout as exc:
        if last:
            what = (f"{describe_workers(last, state['members'], state['clocks'])}"
                    f" {'is' if len(last) == 1 else 'are'} more than {staleness} clocks behind")
        else:
            what = f"{state.get('live')} workers are live, fewer than the elastic minimum {elastic and elastic[0]}"
            raise SyncTimeout(f"{exc.args[0]}: {what}", "start more workers (irdma run --elastic restarts failed"
                              " ones), or lower the minimum") from None
        raise SyncTimeout(f"{exc.args[0]}: {what}", exc.hint) from None
    return clock


def whoami() -> tuple[str, int]:
    """``(host, pid)`` of this process, as a member records it."""
    return socket.gethostname(), os.getpid()


async def join(meta: AsyncMeta, job: int, worker: int, barrier: str | None = None) -> int:
    """Join job ``job`` as ``worker`` (again: after a restart, a lapse, or leaving job barrier
    ``barrier``); its clock, moved up to the job's current clock (from a barrier: to the
    barrier's, see the module docstring)."""
    host, pid = whoami()
    return int(await meta.member_join(job, worker, host, pid, barrier))


async def heartbeat(meta: AsyncMeta, job: int, worker: int, stop: Any = None) -> None:
    """Beat for ``worker`` every :data:`HEARTBEAT_S` seconds until cancelled, ``stop`` (a
    ``threading.Event``) is set or the member left; join again when the job stopped counting it
    (its heartbeats lapsed), still parked at the barrier it waits at. A metadata error is logged
    and the next beat tries again (a member that cannot beat lapses, which is what the others
    need)."""
    while stop is None or not stop.is_set():
        await trio.sleep(HEARTBEAT_S)
        if stop is not None and stop.is_set():
            return
        try:
            if await meta.member_beat(job, worker):
                continue
            mine = next((m for m in await meta.members(job) if m.worker == worker), None)
            if mine is not None and mine.left:
                return  # it finished: never counted again
            log.warning("worker %d of job %d: its heartbeats had lapsed; it joins again", worker, job)
            await join(meta, job, worker)
            if mine is not None and mine.parked is not None:
                await meta.member_park(job, worker, mine.parked)  # still waiting there
        except IrdmaError as exc:
            log.warning("worker %d of job %d: heartbeat failed (%s); trying again", worker, job, exc)


async def job_barrier(meta: AsyncMeta, job: int, name: str, worker: int, workers: int,
                      elastic: tuple[int, int] | None, timeout: float) -> None:
    """Wait at job barrier ``name``, at most ``timeout`` seconds, until the members it waits for
    arrived (see the module docstring), parked meanwhile; then join again (the clock moves up
    to the largest clock the arrivals had when they arrived). Barrier names are for one use:
    :func:`irdma.keras.barrier` numbers its calls.

    Raises:
        SyncTimeout: not all arrived by the deadline (it names the missing ones).
    """
    await meta.member_park(job, worker, name)
    state: dict[str, Any] = {}

    async def passed() -> bool:
        members, arrived = await meta.members(job), set(await meta.arrivals(job, name))
        if elastic is not None:
            want = [m.worker for m in members if m.live]
        else:
            gone = {m.worker for m in members if m.left}
            want = [w for w in range(workers) if w not in gone]
        state.update(members=members, missing=[w for w in want if w not in arrived and w != worker])
        return not state["missing"]

    try:
        await _poll(passed, trio.current_time() + timeout, f"barrier {name} of worker {worker}")
    except BaseException as exc:  # the deadline, a cancellation: the arrival is taken back
        with trio.CancelScope(shield=True, deadline=trio.current_time() + WITHDRAW_S):
            await meta.member_park(job, worker, name, False)
            clocks = await meta.clocks(job)
        if isinstance(exc, SyncTimeout):
            raise SyncTimeout(f"{exc.args[0]}: {describe_workers(state['missing'], state['members'], clocks)}"
                              " did not arrive", exc.hint) from None
        raise
    await join(meta, job, worker, name)


async def barrier(meta: AsyncMeta, name: str, n: int, timeout: float) -> None:
    """Wait until ``n`` callers arrived at barrier ``name``.

    Raises:
        InvalidArgument (another count is waiting), SyncTimeout (this arrival is withdrawn).
        A cancellation (trio) withdraws the arrival too before it propagates.
    """
    gen, released = await meta.barrier_arrive(name, n)
    if released:
        return

    async def passed() -> bool:
        return bool(await meta.barrier_generation(name) > gen)

    try:
        await _poll(passed, trio.current_time() + timeout, f"barrier {name} of {n}", _SYNC_HINT)
    except BaseException as exc:  # the deadline, a cancellation (an interrupted caller), a bug
        if await _withdraw(meta, name, gen) and isinstance(exc, SyncTimeout):
            return  # released just as we gave up
        raise


async def _withdraw(meta: AsyncMeta, name: str, gen: int) -> bool:
    """Take back an arrival at generation ``gen`` of barrier ``name`` that gave up, shielded
    from the cancellation that may be ending its wait, within :data:`WITHDRAW_S`; True if the
    barrier released that generation meanwhile (nothing to take back)."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + WITHDRAW_S) as scope:
        try:
            if await meta.barrier_leave(name, gen):
                return False
            return bool(await meta.barrier_generation(name) > gen)
        except IrdmaError as exc:  # the caller's own error (or cancellation) is the one to report
            log.warning("barrier %s: the arrival of generation %d that gave up may still count (%s)", name, gen, exc)
    if scope.cancelled_caught:
        log.warning("barrier %s: withdrawing an arrival of generation %d took over %g s", name, gen, WITHDRAW_S)
    return False


async def lock(meta: AsyncMeta, name: str, holder: str, lease: float, timeout: float) -> int:
    """Take lock ``name`` for ``holder`` with a lease of ``lease`` seconds, waiting up to
    ``timeout``; returns the lease's expiry (ns since the epoch).

    Raises:
        SyncTimeout: another holder kept it (and kept renewing it) past the deadline.
    """
    state: dict[str, Any] = {}

    async def take() -> bool:
        ok, who, expires = await meta.lock_acquire(name, holder, lease)
        state.update(ok=ok, who=who, expires=expires)
        return bool(ok)

    try:
        await _poll(take, trio.current_time() + timeout, f"lock {name}", _SYNC_HINT)
    except SyncTimeout as exc:
        raise SyncTimeout(f"{exc.args[0]}: held by {state.get('who')}", exc.hint) from None
    return int(state["expires"])
