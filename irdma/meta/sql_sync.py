"""The SQL engine's synchronization state: worker clocks (ASP/BSP/SSP), barriers, leased
locks and counters (a mixin of :class:`~irdma.meta.sql.SqlMeta`, which supplies ``_db`` and
``_tx``).

Every call is one short transaction (SERIALIZABLE on PostgreSQL, the write lock on SQLite), so
the state is shared by every mount and native client of the namespace, on any host; the waits
(a barrier's generation, a lock held by another, a worker clock too far ahead) poll these rows
from :mod:`irdma.client.coord` with a deadline. Times are the metadata host's clients' wall clocks
(``time.time_ns``): leases assume clocks synchronised to well under a lease (NTP). On PostgreSQL
each of these transactions carries its call's transaction id (:mod:`irdma.meta.sql`), so a clock
tick, a barrier arrival, a lock, a counter add or a join whose COMMIT got no answer (a restart,
a failover) is applied exactly once and returns what it computed.

Tables (both engines)::

    sync(kind, name, value, gen, n, holder, expires_ns)   kind: 'barrier' | 'lock' | 'counter'
    sync_owners(kind, name, uid, gid, mode)               a sync object's owner and permission bits
    clocks(job, worker, clock)                            job: the job directory's inode
    members(job, worker, host, pid, heartbeat_ns, epoch, parked, gone)   a job's membership
    arrivals(job, name, worker, clock)                    a job barrier's arrivals (members), each with
                                                          the worker's clock when it arrived

A sync object's *key* is its name (1 to :data:`MAX_SYNC_NAME` bytes, no '/') for the objects of
a mount's root ``.irdma/`` and of native clients, or ``DIR/NAME`` (``DIR`` a directory's inode
number) for the objects of directory DIR's ``.irdma/`` (:mod:`irdma.fs.control`): a name never
holds '/', so no root name can reach a directory's object. A lock's holder is the caller's text;
the mount writes it ``UID@HOST/SESSION/PID`` (:meth:`SqlSync.lock_release_uid` reads the uid).
``sync_owners`` has a row once a mount used the object (native clients do not check owners).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from irdma._errors import InvalidArgument
from irdma._proc import pid_alive

from .base import MEMBER_EXPIRY_S, Member
from .sql_rows import Cursor, now

SYNC_SCHEMA = """
CREATE TABLE IF NOT EXISTS sync(
    kind TEXT NOT NULL, name TEXT NOT NULL, value BIGINT NOT NULL DEFAULT 0, gen BIGINT NOT NULL DEFAULT 0,
    n BIGINT NOT NULL DEFAULT 0, holder TEXT, expires_ns BIGINT NOT NULL DEFAULT 0, PRIMARY KEY(kind, name));
CREATE TABLE IF NOT EXISTS sync_owners(
    kind TEXT NOT NULL, name TEXT NOT NULL, uid BIGINT NOT NULL, gid BIGINT NOT NULL, mode BIGINT NOT NULL,
    PRIMARY KEY(kind, name));
CREATE TABLE IF NOT EXISTS clocks(
    job BIGINT NOT NULL, worker BIGINT NOT NULL, clock BIGINT NOT NULL, PRIMARY KEY(job, worker));
CREATE TABLE IF NOT EXISTS members(
    job BIGINT NOT NULL, worker BIGINT NOT NULL, host TEXT NOT NULL, pid BIGINT NOT NULL,
    heartbeat_ns BIGINT NOT NULL, epoch BIGINT NOT NULL DEFAULT 0, parked TEXT, gone BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY(job, worker));
CREATE TABLE IF NOT EXISTS arrivals(
    job BIGINT NOT NULL, name TEXT NOT NULL, worker BIGINT NOT NULL, clock BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY(job, name, worker));
"""
#: Columns added to the sync tables since their first schema (each engine adds them on open where
#: missing): the clock a worker had when it arrived at a job barrier (0 for arrivals made before).
SYNC_COLUMNS = {"arrivals": {"clock": "BIGINT NOT NULL DEFAULT 0"}}
#: Longest name of a barrier, lock or counter (bytes of UTF-8).
MAX_SYNC_NAME = 200


def check_sync_name(name: str) -> None:
    """Raises InvalidArgument for an empty, too long or path-like name."""
    if not name or len(name.encode()) > MAX_SYNC_NAME or "/" in name or "\0" in name:
        raise InvalidArgument(f"bad name {name!r}: 1 to {MAX_SYNC_NAME} bytes, no '/'")


def sync_key(scope: int | None, name: str) -> str:
    """The key of object ``name`` of directory inode ``scope``'s ``.irdma/`` (None: the root's
    and native clients', the name itself). Raises InvalidArgument for a bad name."""
    check_sync_name(name)
    return name if scope is None else f"{int(scope)}/{name}"


def check_sync_key(key: str) -> None:
    """Raises InvalidArgument unless ``key`` is a name or ``DIR/NAME`` (see the module docstring)."""
    scope, slash, name = key.partition("/")
    if slash and not (scope.isdigit() and scope.isascii()):
        raise InvalidArgument(f"bad name {key!r}: 1 to {MAX_SYNC_NAME} bytes, no '/'")
    check_sync_name(name if slash else key)


def holder_uid(holder: str | None) -> int | None:
    """The uid of a holder written ``UID@...`` (a mount's), else None (a native client's)."""
    uid, at, _ = (holder or "").partition("@")
    return int(uid) if at and uid.isdigit() and uid.isascii() else None


class SqlSync:
    """Clocks, barriers, locks and counters (see the module docstring)."""

    if TYPE_CHECKING:
        @property
        def _db(self) -> Cursor: ...

        def _tx(self, read_only: bool = False) -> Any: ...

        _host: str

    # ---------------------------------------------------------------- counters
    def counter_add(self, name: str, delta: int) -> int:
        """Add ``delta`` to counter ``name`` (created at 0); the value *before* (fetch-and-add)."""
        check_sync_key(name)
        with self._tx() as c:
            row = c.execute("SELECT value FROM sync WHERE kind='counter' AND name=?", (name,)).fetchone()
            old = int(row[0]) if row else 0
            if not -(1 << 62) < old + delta < 1 << 62:
                raise InvalidArgument(f"counter {name} would overflow")
            c.execute("INSERT INTO sync(kind, name, value) VALUES ('counter', ?, ?)"
                      " ON CONFLICT (kind, name) DO UPDATE SET value=excluded.value", (name, old + delta))
            return old

    # ---------------------------------------------------------------- barriers
    def barrier_arrive(self, name: str, n: int) -> tuple[int, bool]:
        """Arrive at barrier ``name`` of ``n`` parties: ``(generation, released)``; the caller
        waits until :meth:`barrier_generation` passes the generation unless it was the last.

        Raises:
            InvalidArgument: ``n`` < 1, or the barrier is already waiting for a different count.
        """
        check_sync_key(name)
        if not 1 <= n <= 1 << 20:
            raise InvalidArgument(f"a barrier needs 1 to {1 << 20} parties, not {n}")
        with self._tx() as c:
            row = c.execute("SELECT value, gen, n FROM sync WHERE kind='barrier' AND name=?", (name,)).fetchone()
            count, gen, want = (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, n)
            if count and want != n:
                raise InvalidArgument(f"barrier {name} is waiting for {want} parties ({count} arrived), not {n}")
            if count + 1 >= n:
                count, gen_next, released = 0, gen + 1, True
            else:
                count, gen_next, released = count + 1, gen, False
            c.execute("INSERT INTO sync(kind, name, value, gen, n) VALUES ('barrier', ?, ?, ?, ?)"
                      " ON CONFLICT (kind, name) DO UPDATE SET value=excluded.value, gen=excluded.gen, n=excluded.n",
                      (name, count, gen_next, n))
            return gen, released

    def barrier_generation(self, name: str) -> int:
        row = self._db.execute("SELECT gen FROM sync WHERE kind='barrier' AND name=?", (name,)).fetchone()
        return int(row[0]) if row else 0

    def barrier_state(self, name: str) -> tuple[int, int, int]:
        """``(generation, arrivals waiting, parties they wait for)`` of barrier ``name``
        (``(0, 0, 0)`` for one never used)."""
        row = self._db.execute("SELECT gen, value, n FROM sync WHERE kind='barrier' AND name=?", (name,)).fetchone()
        return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)

    def barrier_leave(self, name: str, gen: int) -> bool:
        """Withdraw an arrival that gave up (its deadline passed, or its caller was interrupted)
        if the barrier has not released that generation since; True when withdrawn."""
        with self._tx() as c:
            row = c.execute("SELECT value, gen FROM sync WHERE kind='barrier' AND name=?", (name,)).fetchone()
            if row is None or int(row[1]) != gen or int(row[0]) == 0:
                return False
            c.execute("UPDATE sync SET value=value-1 WHERE kind='barrier' AND name=?", (name,))
            return True

    # ---------------------------------------------------------------- leased locks
    def lock_acquire(self, name: str, holder: str, lease_s: float) -> tuple[bool, str | None, int]:
        """Take lock ``name`` for ``holder`` until ``lease_s`` seconds from now if it is free,
        its lease ran out, or ``holder`` has it (a renewal).

        Returns:
            ``(acquired, holder now, expiry in ns)``.
        """
        check_sync_key(name)
        if not 0 < lease_s <= 86400:
            raise InvalidArgument(f"a lease is more than 0 and at most 86400 s, not {lease_s:g}")
        with self._tx() as c:
            t = now()
            row = c.execute("SELECT holder, expires_ns FROM sync WHERE kind='lock' AND name=?", (name,)).fetchone()
            if row is not None and row[0] is not None and row[0] != holder and int(row[1]) > t:
                return False, str(row[0]), int(row[1])
            expires = t + int(lease_s * 1e9)
            c.execute("INSERT INTO sync(kind, name, holder, expires_ns) VALUES ('lock', ?, ?, ?)"
                      " ON CONFLICT (kind, name) DO UPDATE SET holder=excluded.holder, expires_ns=excluded.expires_ns",
                      (name, holder, expires))
            return True, holder, expires

    def lock_release(self, name: str, holder: str) -> bool:
        """Release lock ``name`` if ``holder`` holds it (its lease not run out); True if it did."""
        with self._tx() as c:
            row = c.execute("SELECT holder, expires_ns FROM sync WHERE kind='lock' AND name=?", (name,)).fetchone()
            if row is None or row[0] != holder or int(row[1]) <= now():
                return False
            c.execute("UPDATE sync SET holder=NULL, expires_ns=0 WHERE kind='lock' AND name=?", (name,))
            return True

    def lock_release_uid(self, name: str, uid: int) -> tuple[bool, str | None]:
        """Release lock ``name`` if a holder of uid ``uid`` (written ``UID@...``) holds it, or
        any holder if ``uid`` is 0 (root).

        Returns:
            ``(released, holder)``: the holder it had (None: it was free or its lease ran out).
        """
        with self._tx() as c:
            row = c.execute("SELECT holder, expires_ns FROM sync WHERE kind='lock' AND name=?", (name,)).fetchone()
            if row is None or row[0] is None or int(row[1]) <= now():
                return False, None
            holder = str(row[0])
            if uid != 0 and holder_uid(holder) != uid:
                return False, holder
            c.execute("UPDATE sync SET holder=NULL, expires_ns=0 WHERE kind='lock' AND name=?", (name,))
            return True, holder

    def lock_state(self, name: str) -> tuple[str | None, int]:
        """``(holder, expiry in ns)`` of lock ``name``; ``(None, 0)`` when free."""
        row = self._db.execute("SELECT holder, expires_ns FROM sync WHERE kind='lock' AND name=?", (name,)).fetchone()
        if row is None or row[0] is None or int(row[1]) <= now():
            return None, 0
        return str(row[0]), int(row[1])

    # ---------------------------------------------------------------- owners
    def sync_owner(self, kind: str, name: str) -> tuple[int, int, int] | None:
        """``(uid, gid, permission bits)`` of object ``name`` of ``kind``, or None if no mount
        has used it yet."""
        row = self._db.execute("SELECT uid, gid, mode FROM sync_owners WHERE kind=? AND name=?", (kind, name)).fetchone()
        return (int(row[0]), int(row[1]), int(row[2])) if row else None

    def sync_claim(self, kind: str, name: str, uid: int, gid: int, mode: int) -> tuple[int, int, int]:
        """The owner of object ``name`` of ``kind``: recorded as ``(uid, gid, mode)`` unless it
        already has one (the first user owns it, as the creator of a file does)."""
        check_sync_key(name)
        with self._tx() as c:
            c.execute("INSERT INTO sync_owners VALUES (?,?,?,?,?) ON CONFLICT (kind, name) DO NOTHING",
                      (kind, name, uid, gid, mode & 0o7777))
            row = c.execute("SELECT uid, gid, mode FROM sync_owners WHERE kind=? AND name=?", (kind, name)).fetchone()
            return int(row[0]), int(row[1]), int(row[2])

    def sync_chown(self, kind: str, name: str, uid: int, gid: int, mode: int) -> None:
        """Set the owner and permission bits of a claimed object (chown, chmod: the kernel has
        checked that the caller may)."""
        with self._tx() as c:
            c.execute("UPDATE sync_owners SET uid=?, gid=?, mode=? WHERE kind=? AND name=?",
                      (uid, gid, mode & 0o7777, kind, name))

    # ---------------------------------------------------------------- worker clocks
    def clock_tick(self, job: int, worker: int) -> int:
        """Advance worker ``worker``'s clock in job ``job`` (a directory's inode) by one; the new clock."""
        if not 0 <= worker < 1 << 20:
            raise InvalidArgument(f"worker ids are 0 to {(1 << 20) - 1}, not {worker}")
        with self._tx() as c:
            row = c.execute("SELECT clock FROM clocks WHERE job=? AND worker=?", (job, worker)).fetchone()
            clock = (int(row[0]) if row else 0) + 1
            c.execute("INSERT INTO clocks VALUES (?,?,?) ON CONFLICT (job, worker) DO UPDATE SET clock=excluded.clock",
                      (job, worker, clock))
            return clock

    def clocks(self, job: int) -> dict[int, int]:
        """Every worker's clock in job ``job`` (workers that never ticked are absent: clock 0)."""
        return {int(w): int(k) for w, k in self._db.execute("SELECT worker, clock FROM clocks WHERE job=?", (job,))}

    def clock_reset(self, job: int) -> None:
        """Forget job ``job``'s clocks, members and barrier arrivals (a new run in the same
        directory)."""
        with self._tx() as c:
            for table in ("clocks", "members", "arrivals"):
                c.execute(f"DELETE FROM {table} WHERE job=?", (job,))

    # ---------------------------------------------------------------- a job's members
    def _member_live(self, host: str, pid: int, heartbeat_ns: int, gone: int, t: int) -> bool:
        if gone or heartbeat_ns < t - int(MEMBER_EXPIRY_S * 1e9):
            return False
        if host == self._host:  # a process that started after the last heartbeat is another one
            return pid_alive(pid, heartbeat_ns)
        return True

    def members(self, job: int) -> list[Member]:
        """Every worker that joined job ``job`` (a directory's inode), by worker id."""
        t = now()
        return [Member(int(w), str(h), int(p), int(hb), int(e), None if pk is None else str(pk), bool(g),
                       self._member_live(str(h), int(p), int(hb), int(g), t))
                for w, h, p, hb, e, pk, g in self._db.execute(
                    "SELECT worker, host, pid, heartbeat_ns, epoch, parked, gone FROM members WHERE job=?"
                    " ORDER BY worker", (job,))]

    def member_join(self, job: int, worker: int, host: str, pid: int, barrier: str | None = None) -> int:
        """Make ``worker`` (process ``pid`` on ``host``) a live member of job ``job``: a
        heartbeat now, not parked, not gone; and move its clock up (a clock never goes down).
        Returns its clock.

        Without ``barrier`` (a worker that joins late, or comes back after a crash or a lapse)
        the clock moves up to the largest clock of the job's other live members, so that it goes
        on at the job's current clock. With ``barrier`` (a worker leaving job barrier
        ``barrier``, :func:`irdma.client.coord.job_barrier`) it moves up to the largest clock the
        barrier's arrivals had when they arrived, the same for every worker that passes it: not
        to a clock a worker that passed first has reached since (its first step after the
        barrier), which would count a step the slower one never took, and under BSP leave the
        two waiting for each other at the next barrier.

        Raises:
            InvalidArgument: a worker id outside 0 .. 2^20 - 1."""
        if not 0 <= worker < 1 << 20:
            raise InvalidArgument(f"worker ids are 0 to {(1 << 20) - 1}, not {worker}")
        with self._tx() as c:
            t = now()
            clocks = {int(w): int(k) for w, k in c.execute("SELECT worker, clock FROM clocks WHERE job=?", (job,))}
            if barrier is None:
                live = {int(w) for w, h, p, hb, g in c.execute(
                    "SELECT worker, host, pid, heartbeat_ns, gone FROM members WHERE job=? AND worker<>?",
                    (job, worker)) if self._member_live(str(h), int(p), int(hb), int(g), t)}
                others = [clocks.get(w, 0) for w in live]
            else:
                others = [int(k) for (k,) in c.execute("SELECT clock FROM arrivals WHERE job=? AND name=?",
                                                        (job, barrier))]
            clock = max([clocks.get(worker, 0), *others])
            c.execute("INSERT INTO clocks VALUES (?,?,?) ON CONFLICT (job, worker) DO UPDATE SET clock=excluded.clock",
                      (job, worker, clock))
            c.execute("INSERT INTO members(job, worker, host, pid, heartbeat_ns) VALUES (?,?,?,?,?)"
                      " ON CONFLICT (job, worker) DO UPDATE SET host=excluded.host, pid=excluded.pid,"
                      " heartbeat_ns=excluded.heartbeat_ns, parked=NULL, gone=0", (job, worker, host, pid, t))
            return clock

    def member_beat(self, job: int, worker: int, epoch: int | None = None) -> bool:
        """A heartbeat of ``worker`` in job ``job`` (and the epoch it began, when given).
        False when it is not a live member (never joined, left, or its heartbeats lapsed and
        the others went on without it): the caller then joins again (:meth:`member_join`)."""
        with self._tx() as c:
            t = now()
            row = c.execute("SELECT heartbeat_ns, gone FROM members WHERE job=? AND worker=?", (job, worker)).fetchone()
            if row is None or int(row[1]) or int(row[0]) < t - int(MEMBER_EXPIRY_S * 1e9):
                return False
            if epoch is None:
                c.execute("UPDATE members SET heartbeat_ns=? WHERE job=? AND worker=?", (t, job, worker))
            else:
                c.execute("UPDATE members SET heartbeat_ns=?, epoch=? WHERE job=? AND worker=?", (t, epoch, job, worker))
            return True

    def member_leave(self, job: int, worker: int) -> None:
        """``worker`` finished with job ``job``: no wait counts it any more."""
        with self._tx() as c:
            c.execute("UPDATE members SET gone=1, parked=NULL WHERE job=? AND worker=?", (job, worker))

    def member_park(self, job: int, worker: int, name: str, arrived: bool = True) -> None:
        """``worker`` arrived at job barrier ``name``: recorded with its clock now (for good: a
        member that comes to it later finds the arrivals before it; arriving again keeps the
        first record) and parked there (elastic clock waits do not wait for a parked member)
        until it joins again. ``arrived=False`` takes the arrival back (a wait that gave up) and
        unparks it.

        Raises:
            InvalidArgument: a bad barrier name (see :func:`check_sync_name`)."""
        check_sync_name(name)
        with self._tx() as c:
            if arrived:
                row = c.execute("SELECT clock FROM clocks WHERE job=? AND worker=?", (job, worker)).fetchone()
                c.execute("INSERT INTO arrivals(job, name, worker, clock) VALUES (?,?,?,?)"
                          " ON CONFLICT (job, name, worker) DO NOTHING", (job, name, worker, int(row[0]) if row else 0))
            else:
                c.execute("DELETE FROM arrivals WHERE job=? AND name=? AND worker=?", (job, name, worker))
            c.execute("UPDATE members SET parked=? WHERE job=? AND worker=?", (name if arrived else None, job, worker))

    def arrivals(self, job: int, name: str) -> list[int]:
        """The workers that arrived at job barrier ``name`` of job ``job``."""
        return sorted(int(w) for (w,) in self._db.execute("SELECT worker FROM arrivals WHERE job=? AND name=?",
                                                          (job, name)))
