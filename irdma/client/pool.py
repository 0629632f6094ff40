"""The shard connections of one client: opened on first use, one window of requests in
flight per shard and direction, a deadline on every request, shards that missed one held out.

:class:`ShardPool` is the layer under the client's data path and moves; it reads and updates the
client's :class:`~irdma.client.view.ShardView` (the shard map, health, the shards held out):
``run(shard_id, fn)`` runs ``fn(connection)`` against one shard within the client's deadline,
``call(shard_id, ShardConnection.method, *args)`` one of the connection's methods (typed: mypy
checks the arguments against the method and sees its result type). The fast path of nearly every request (an open
TCP connection with room in its window) has no cancel scope of its own: a watchdog closes a
connection on which a request outlived its deadline. A connection that fails on its first use
since it last worked is opened again once (the shard may have restarted); calls are safe to
repeat (updates carry request ids that shards apply once). A shard that missed a deadline fails
data calls at once for the next deadline (probes still try it) and is marked down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar, TypeVarTuple

import trio

from .._errors import Dirty, Fenced, ReplicaError, ShardUnavailable
from ..meta import ShardRecord
from ..transport import ShardConnection, Transport
from ..transport.metered import MeteredConnection
from ..transport.tcp import TcpConnection
from ..wire import auth
from . import comm
from .view import ShardView

log = logging.getLogger("irdma.client")
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")
_SHARD_HINT = "is the shard process stopped or overloaded? `irdma shard list` shows its state"


class _Deadline:
    """One request on the watchdog's fast path (:meth:`ShardPool.run`): when it must be
    answered (trio time), on which connection, and whether the watchdog found it late."""

    __slots__ = ("at", "conn", "expired")

    def __init__(self, at: float, conn: ShardConnection) -> None:
        self.at = at
        self.conn = conn
        self.expired = False


class ShardPool:
    """A client's connections to the shards of ``view`` (whose shard map and health records
    they read and update).

    Args:
        view: the client's view of the shard map.
        transport: how to reach shards. nursery: where connection tasks and the watchdog live.
        keys: the cluster key to prove to shards (None: connect without one).
        name: the client's name in HELLO. window: requests in flight per shard and direction.
        The deadline of each request (connecting included) is ``view.timeout``. A request
        queued behind this client's own in the shard's window waits as long as the shard keeps
        answering (one of its requests ended within the last ``view.timeout`` seconds): a large
        write is many requests in one window, and the last of them must not miss a deadline
        for the time the first took (the shard is slow, not gone); its own deadline starts once
        it is admitted.
    """

    def __init__(self, view: ShardView, transport: Transport, nursery: trio.Nursery, keys: auth.KeySource | None,
                 name: str, window: int) -> None:
        self.view = view
        self.transport = transport
        self.nursery = nursery
        self.keys = keys
        self.name = name
        self.window = window
        self.conns: dict[int, ShardConnection] = {}
        # requests in flight per shard, admitted by priority (P3): one window for pulls and one for
        # everything else, since they load the link in opposite directions (a slice's pull never
        # queues behind the pushes it follows)
        self.limits: dict[int, comm.PriorityWindow] = {}
        self.pull_limits: dict[int, comm.PriorityWindow] = {}
        self.connect_locks: dict[int, trio.Lock] = {}
        #: trio time at which a request to each shard last ended (answered or failed): a
        #: request waiting for room in that shard's window waits while this stays recent
        self.progress: dict[int, float] = {}
        # requests on the fast path of run: no cancel scope each, one watchdog for all
        self.deadlines: set[_Deadline] = set()
        self._watchdog = False
        # snapshot connections (FREEZE, ADMIT, CLONE, THAW): TCP, one per shard, kept
        # open across snapshots (:meth:`snapshot_connection`)
        self.snapshot_conns: dict[int, ShardConnection] = {}
        self.snapshot_lock = trio.Lock()  # one snapshot's cut at a time on them
        self._snapshot_transport: Transport | None = None

    @property
    def down_until(self) -> dict[int, float]:
        """Shards that missed a deadline: data calls fail at once until then (trio time), so a
        stopped shard costs each caller one deadline, not one per request; probes still try.
        The view's (:attr:`ShardView.down_until`: reads consult it too)."""
        return self.view.down_until

    @property
    def timeout(self) -> float:
        """Seconds each request may take: the view's (the client may change it)."""
        return self.view.timeout

    async def aclose(self) -> None:
        """Close every shard connection. Safe to call twice."""
        conns, self.conns = self.conns, {}
        snaps, self.snapshot_conns = self.snapshot_conns, {}
        for conn in [*conns.values(), *snaps.values()]:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def connection(self, shard_id: int) -> ShardConnection:
        """The connection to shard ``shard_id``, opened on first use and again once broken.

        A new connection's incarnation is checked against the shard map: a shard that restarted
        on fresh memory is logged as having lost its chunks (reads of them raise DataLost).

        Raises:
            ShardUnavailable: the shard is not in the shard map or does not answer in time.
        """
        conn = self.conns.get(shard_id)
        if conn is not None and not conn.broken:
            return conn
        lock = self.connect_locks.setdefault(shard_id, trio.Lock())
        async with lock:
            conn = self.conns.get(shard_id)
            if conn is not None and conn.broken:
                await self.drop(shard_id, conn)
                conn = None
            if conn is None:
                if shard_id not in self.view.shard_map:
                    self.view.shard_map = {r.shard_id: r for r in await self.view.meta.shards()}
                rec = self.view.shard_map.get(shard_id)
                if rec is None:
                    raise ShardUnavailable(f"shard {shard_id} is not in the shard map of {self.view.meta.url}")
                try:
                    conn = await self.transport.connect(
                        rec.address, self.nursery, client_name=self.name,
                        key=self.keys.ring() if self.keys is not None else None,
                        timeout=self.timeout,
                    )
                except ShardUnavailable as exc:
                    if self.view.in_view(shard_id):
                        log.warning("cannot connect to shard %d: %s; marked down", shard_id, exc.args[0])
                    await self.view.note_health(shard_id, "down")
                    raise
                try:
                    await self._check_incarnation(rec, conn)
                except BaseException:
                    await conn.aclose()
                    raise
                self.view.shard_map[shard_id] = dataclasses.replace(rec, incarnation=conn.info.incarnation)
                conn = MeteredConnection(conn, self.transport.name)  # irdma_client_* (irdma.metrics)
                self.conns[shard_id] = conn
                # aging at a quarter of the deadline: a request never starves behind urgent ones
                self.limits[shard_id] = comm.PriorityWindow(self.window, max_wait=self.timeout / 4)
                self.pull_limits[shard_id] = comm.PriorityWindow(self.window, max_wait=self.timeout / 4)
                await self.view.note_health(shard_id, "up")
        return conn

    async def snapshot_connection(self, shard_id: int) -> ShardConnection:
        """This client's snapshot connection to shard ``shard_id`` (FREEZE, ADMIT,
        CLONE, THAW; :mod:`irdma.client.snapshots`): TCP whatever the data transport, apart
        from the data connection (there a freeze's requests would queue behind this client's own
        pushes that the freeze holds, and the freeze would outlive its lease). Opened on first
        use and kept open, so a snapshot every second does not pay a connect and a handshake
        per shard each time; opened again once broken or dropped (:meth:`drop_snapshot_connection`).

        Raises:
            ShardUnavailable: the shard is not in the shard map or does not answer in time.
        """
        conn = self.snapshot_conns.get(shard_id)
        if conn is not None and not conn.broken:
            return conn
        lock = self.connect_locks.setdefault(-1 - shard_id, trio.Lock())  # negative: apart from the data lock
        async with lock:
            conn = self.snapshot_conns.get(shard_id)
            if conn is not None and conn.broken:
                await self.drop_snapshot_connection(shard_id)
                conn = None
            if conn is None:
                rec = self.view.shard_map.get(shard_id)
                if rec is None:
                    raise ShardUnavailable(f"shard {shard_id} is not in the shard map of {self.view.meta.url}")
                if self._snapshot_transport is None:
                    from ..transport import make_transport

                    self._snapshot_transport = make_transport("tcp")
                conn = await self._snapshot_transport.connect(
                    rec.address, self.nursery, client_name=f"{self.name} (snapshot)",
                    key=self.keys.ring() if self.keys is not None else None, timeout=self.timeout)
                self.snapshot_conns[shard_id] = conn
        return conn

    async def drop_snapshot_connection(self, shard_id: int) -> None:
        """Close the snapshot connection to ``shard_id`` (a snapshot that failed on it: its
        requests may be half done); the next :meth:`snapshot_connection` opens a new one."""
        conn = self.snapshot_conns.pop(shard_id, None)
        if conn is not None:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    async def _check_incarnation(self, rec: ShardRecord, conn: ShardConnection) -> None:
        new = conn.info.incarnation
        if not new or rec.incarnation == new:
            # the shard map has it already (a reconnect to the same memory): no metadata write,
            # so a reconnect never waits on the metadata engine's lock
            return
        old = await self.view.meta.note_incarnation(rec.shard_id, new)
        if old and old != new:
            await self.view.refresh()  # it is out of its chains until resynced
            log.error(
                "shard %d at %s lost its memory (incarnation %016x -> %016x): every chunk it held is gone;"
                " reads of them fail with EIO, `irdma status` lists the damaged files",
                rec.shard_id, rec.address, old, new,
            )

    async def drop(self, shard_id: int, conn: ShardConnection) -> None:
        if self.conns.get(shard_id) is conn:
            del self.conns[shard_id]
        with trio.CancelScope(shield=True):  # closing only releases local resources
            await conn.aclose()

    async def run(self, shard_id: int, fn: Callable[[ShardConnection], Awaitable[_T]], probe: bool = False,
                  pull: bool = False) -> _T:
        """Run ``fn(connection)`` against a shard within the client's deadline.

        A shard that missed a deadline fails data calls at once for the next ``timeout``
        seconds (``probe`` calls, such as the heartbeat's STAT, still try it).

        Raises:
            ShardUnavailable: the shard failed or missed the deadline (its connection is then
                closed: a late reply can never land in a buffer whose call has returned).
        """
        if not probe and self.down_until and trio.current_time() < self.down_until.get(shard_id, 0.0):
            raise ShardUnavailable(f"{self.view.where(shard_id)} missed its last deadline of {self.timeout:g} s;"
                                   " not retried yet", _SHARD_HINT)
        # The fast path, that of nearly every request (a 4 KiB read through the mount is little
        # else): an open TCP connection and room in the window. No cancel scope per request:
        # the watchdog (_watch_deadlines) closes a connection on which a request outlived its
        # deadline, which fails that request (and the others on it) at once. No strings built
        # unless it fails, no wait for the window (the send in ``fn`` is the checkpoint).
        conn = self.conns.get(shard_id)
        if conn is not None and type(conn) is MeteredConnection and type(conn.conn) is TcpConnection \
                and not conn.broken:
            limit = (self.pull_limits if pull else self.limits)[shard_id]
            try:
                limit.acquire_nowait()
            except trio.WouldBlock:
                pass
            else:
                if not self._watchdog:
                    self._watchdog = True
                    self.nursery.start_soon(self._watch_deadlines, name="irdma-client deadlines")
                d = _Deadline(trio.current_time() + self.timeout, conn)
                self.deadlines.add(d)
                try:
                    result = await fn(conn)
                except (Dirty, Fenced, ReplicaError):
                    raise  # answers about the chain, not failures of this connection
                except ShardUnavailable:
                    if d.expired:
                        return await self._missed_deadline(shard_id, conn)
                    await self.drop(shard_id, conn)
                    # as a reused connection's first failure below: once more on a fresh one,
                    # within what is left of this request's deadline
                    return await self._run_scoped(shard_id, fn, pull, d.at, retry=True)
                finally:
                    self.deadlines.discard(d)
                    limit.release()
                    self.progress[shard_id] = trio.current_time()
                if self.down_until:
                    self.down_until.pop(shard_id, None)
                return result
        return await self._run_scoped(shard_id, fn, pull, trio.current_time() + self.timeout)

    async def call(self, shard_id: int, method: Callable[[ShardConnection, *_Ts], Awaitable[_T]], *args: *_Ts,
                   probe: bool = False) -> _T:
        """``connection.method(*args)`` against a shard within the deadline (:meth:`run`).

        ``method`` is a method of :class:`ShardConnection` (``ShardConnection.checksum``): the
        connection's own implementation of it is called (a transport's, or the metrics wrapper's),
        and mypy checks ``args`` against it and types the result. The arguments are taken as
        they are now, once: a retry on a fresh connection sends the same ones.

        Raises:
            ShardUnavailable: as :meth:`run`; and whatever the method raises.
        """
        name = method.__name__

        async def fn(conn: ShardConnection) -> _T:
            result: _T = await getattr(conn, name)(*args)
            return result

        return await self.run(shard_id, fn, probe)

    async def incarnation(self, shard_id: int) -> int:
        """The incarnation of a shard's memory (connecting to it if this client has not yet; the
        shard map's when it cannot be reached)."""
        conn = self.conns.get(shard_id)
        if conn is None:
            with contextlib.suppress(ShardUnavailable), trio.move_on_after(self.timeout):
                conn = await self.connection(shard_id)
        return conn.info.incarnation if conn is not None else self.view.shard_map[shard_id].incarnation

    async def _watch_deadlines(self) -> None:
        """The watchdog of the fast path of :meth:`run`: every eighth of the deadline (at
        most a second), the connections with a request past its deadline are closed, which
        fails their requests at once (ShardUnavailable; the request found late then takes the
        missed-deadline path). Runs in the client's nursery while it is open."""
        tick = max(0.01, min(1.0, self.timeout / 8))
        while True:
            await trio.sleep(tick)
            if not self.deadlines:
                continue
            now = trio.current_time()
            late: dict[int, ShardConnection] = {}
            for d in self.deadlines:
                if d.at <= now and not d.expired:
                    d.expired = True
                    late[id(d.conn)] = d.conn
            for conn in late.values():
                with trio.CancelScope(shield=True):  # closing only releases local resources
                    await conn.aclose()

    async def _run_scoped(self, shard_id: int, fn: Callable[[ShardConnection], Awaitable[_T]], pull: bool,
                               deadline: float, retry: bool = False) -> _T:
        """:meth:`run` under a cancel scope with ``deadline`` (trio time): when a connection
        must be opened, or the window waited for. ``retry``: the fast path's connection just
        failed; this is the once-more on a fresh one."""
        conn: ShardConnection | None = None
        sent = False
        with trio.move_on_at(deadline) as scope:
            for attempt in ((2,) if retry else (1, 2)):
                conn = self.conns.get(shard_id)
                reused = conn is not None and not conn.broken
                if not reused:
                    try:
                        conn = await self.connection(shard_id)
                    except ShardUnavailable:
                        self.down_until[shard_id] = trio.current_time() + self.timeout
                        raise
                assert conn is not None
                limit = (self.pull_limits if pull else self.limits)[shard_id]
                try:
                    limit.acquire_nowait()
                except trio.WouldBlock:
                    await self._admit(shard_id, limit, scope)
                try:
                    sent = True
                    try:
                        result = await fn(conn)
                    except (Dirty, Fenced, ReplicaError):
                        raise  # answers about the chain, not failures of this connection
                    except ShardUnavailable:
                        await self.drop(shard_id, conn)
                        if attempt == 2 or not reused:
                            raise
                        # a connection that failed on its first use since it last worked: the
                        # shard may have restarted since (its old process reset it). Once more
                        # on a fresh one, within the same deadline: calls are safe to repeat
                        # (updates carry request ids that shards apply once)
                        continue
                finally:
                    limit.release()
                    self.progress[shard_id] = trio.current_time()
                if self.down_until:
                    self.down_until.pop(shard_id, None)
                return result
        return await self._missed_deadline(shard_id, conn if sent else None)

    async def _admit(self, shard_id: int, limit: comm.PriorityWindow, scope: trio.CancelScope) -> None:
        """Wait for room in ``limit``, shard ``shard_id``'s window, for as long as the shard
        keeps answering (a request to it ended within the last deadline); once admitted, the
        request's deadline (``scope``'s) starts anew. A shard that answered nothing for a
        whole deadline while the window stayed full: ``scope`` is cancelled (missed)."""
        scope.deadline = math.inf  # the requests ahead in the window each have their own deadline
        while True:
            with trio.move_on_after(self.timeout):
                await limit.acquire()
                scope.deadline = trio.current_time() + self.timeout
                return
            if trio.current_time() - self.progress.get(shard_id, -math.inf) >= self.timeout:
                scope.cancel()  # nothing ended for a whole deadline: the caller reports it missed
                await trio.lowlevel.checkpoint()

    async def _missed_deadline(self, shard_id: int, conn: ShardConnection | None) -> NoReturn:
        """A request to ``shard_id`` missed its deadline: the shard is held out of data calls for
        a deadline, ``conn`` (the request's, if it was sent) closed, the shard marked down.

        Raises:
            ShardUnavailable: always, naming the shard and the deadline.
        """
        where, hint = self.view.where(shard_id), _SHARD_HINT
        self.down_until[shard_id] = trio.current_time() + self.timeout
        if conn is not None:
            await self.drop(shard_id, conn)
        if self.view.in_view(shard_id):  # once per failure: every request in flight lands here
            log.warning("%s did not answer within %g s: marked down (%s)", where, self.timeout, hint)
        await self.view.note_health(shard_id, "down")
        raise ShardUnavailable(f"{where} did not answer within {self.timeout:g} s", hint)

    def forget_file(self, file_id: int) -> None:
        """Drop what the connections cache of a file (called when a mount opens it: close-to-open)."""
        for conn in self.conns.values():
            conn.forget_file(file_id)
