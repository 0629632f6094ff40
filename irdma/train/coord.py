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
:class:`SyncTimeout` (ETIMEDOUT through the mount) naming the workers behind; the job then
either stops, or goes on with fewer workers after ``user.irdma.workers`` is rewritten (workers
with ids past the new N no longer count).

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
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from .._errors import InvalidArgument, IrdmaError

if TYPE_CHECKING:
    from ..meta.aio import AsyncMeta

XATTR_CONSISTENCY = b"user.irdma.consistency"
XATTR_WORKERS = b"user.irdma.workers"
XATTR_SYNC_TIMEOUT = b"user.irdma.sync_timeout"
#: On a directory (the mount's root for its ``.irdma/``): the longest lease (seconds) a lock of
#: that directory's ``.irdma/lock/`` may be taken for through a mount; longer ones are cut to it.
XATTR_MAX_LEASE = b"user.irdma.max_lease"
#: Default of :data:`XATTR_MAX_LEASE` (seconds).
DEFAULT_MAX_LEASE = 600.0
#: Read (not stored) on a job directory: every worker's clock, ``"K:C K:C ..."``.
XATTR_CLOCKS = b"user.irdma.clocks"
#: Default deadline of a wait (seconds).
DEFAULT_SYNC_TIMEOUT = 60.0
#: Polling of the shared state: from the first interval, doubling up to the last (seconds).
POLL_FIRST, POLL_MAX = 0.002, 0.05
#: Deadline (seconds) of the shielded withdrawal of a barrier arrival that gave up; each
#: metadata call is bounded by the engine's own timeout besides.
WITHDRAW_S = 10.0

log = logging.getLogger("irdma.coord")


class SyncTimeout(IrdmaError):
    """A barrier, lock or clock wait reached its deadline (ETIMEDOUT through the mount)."""


class SyncInterrupted(IrdmaError):
    """A wait ended because its caller was interrupted: a signal to the process waiting
    through the mount (EINTR; a barrier arrival is withdrawn first)."""


class SyncDenied(IrdmaError):
    """The caller's uid may not use a sync object: its permission bits, or its directory's,
    do not let it (EACCES through the mount)."""


@dataclass(frozen=True)
class Consistency:
    """A job's consistency model: ``staleness`` None for ASP, 0 for BSP, S for SSP:S."""

    staleness: int | None

    @property
    def name(self) -> str:
        return "asp" if self.staleness is None else "bsp" if self.staleness == 0 else f"ssp:{self.staleness}"


def parse_consistency(value: bytes | str) -> Consistency:
    """``asp``, ``bsp`` or ``ssp:S`` (S >= 0; ``ssp:0`` is BSP).

    Raises:
        InvalidArgument: anything else.
    """
    text = (value.decode("ascii", "replace") if isinstance(value, bytes) else value).strip().lower()
    if text == "asp":
        return Consistency(None)
    if text == "bsp":
        return Consistency(0)
    if text.startswith("ssp:"):
        try:
            s = int(text[4:])
        except ValueError:
            s = -1
        if 0 <= s <= 1 << 20:
            return Consistency(s)
    raise InvalidArgument(f"bad consistency {text!r}: use asp, bsp or ssp:S with S >= 0")


def parse_workers(value: bytes | str) -> int:
    """A worker count, 1 to 2^20. Raises InvalidArgument."""
    try:
        n = int(value.decode("ascii", "replace") if isinstance(value, bytes) else value)
    except ValueError:
        n = 0
    if not 1 <= n <= 1 << 20:
        raise InvalidArgument(f"bad worker count {value!r}: use 1 to {1 << 20}")
    return n


def parse_timeout(value: bytes | str) -> float:
    """A sync deadline in seconds, more than 0 and at most a day. Raises InvalidArgument."""
    try:
        t = float(value.decode("ascii", "replace") if isinstance(value, bytes) else value)
    except ValueError:
        t = -1.0
    if not 0 < t <= 86400 or not math.isfinite(t):
        raise InvalidArgument(f"bad sync timeout {value!r}: seconds, more than 0 and at most 86400")
    return t


def behind(clocks: dict[int, int], workers: int, clock: int, staleness: int) -> list[int]:
    """The workers too far behind for a worker at ``clock`` to go on (SSP's condition)."""
    return [w for w in range(workers) if clocks.get(w, 0) < clock - staleness]


#: What to do about a SyncTimeout: of a clock wait, of a barrier or lock wait.
_CLOCK_HINT = ("check that every worker is alive (`irdma status`); raise user.irdma.sync_timeout"
               " or lower user.irdma.workers to go on without a dead one")
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


async def tick(meta: AsyncMeta, job: int, worker: int, workers: int, consistency: Consistency, timeout: float) -> int:
    """Advance ``worker``'s clock in ``job`` and wait until it may pull its next round.

    Returns:
        The worker's new clock.

    Raises:
        InvalidArgument: ``worker`` is not below ``workers``. SyncTimeout: workers stayed too
            far behind until the deadline (the clock did advance).
    """
    if not 0 <= worker < workers:
        raise InvalidArgument(f"worker {worker} is not one of the job's {workers} workers (0 to {workers - 1})")
    clock = await meta.clock_tick(job, worker)
    if consistency.staleness is None:
        return clock
    staleness = consistency.staleness
    last: list[int] = []

    async def ready() -> bool:
        nonlocal last
        last = behind(await meta.clocks(job), workers, clock, staleness)
        return not last

    try:
        await _poll(ready, trio.current_time() + timeout, f"worker {worker} at clock {clock} under {consistency.name}")
    except SyncTimeout as exc:
        raise SyncTimeout(f"{exc.args[0]}: workers {last} are more than {staleness} clocks behind", exc.hint) from None
    return clock


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
