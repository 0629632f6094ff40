"""The shard's dispatcher: a request frame in, its reply out, with no sockets (issue 21).

:meth:`Dispatcher.handle` decodes a frame, applies it to the :class:`~irdma.server.shard.Shard`
synchronously (so update ops are atomic per chunk) with the handler of its message class (the
table :attr:`Dispatcher._HANDLERS`; :mod:`irdma.server.request_kinds` tells what a request is)
and gives the reply: at once, as an awaitable when the update goes down a replication chain
(answered once the chain has it), or as a :class:`ThreadWork` when the request needs disk I/O
first (SYNC; a new chunk's zeroing and chunk-index record on a shard with a data directory),
which runs in a worker thread so the event loop never waits for the disk. A malformed or refused request gets an
error reply and changes nothing; an exception the request meets becomes its error reply through
the one status table (:data:`irdma.wire.protocol.STATUS_ERRORS`), a bug is logged with its
traceback and answered INTERNAL. Every request is counted in the shard's metrics
(:mod:`irdma.metrics`).

The front ends only move frames: :mod:`irdma.server.tcp` (pipelined TCP connections) and
:mod:`irdma.server.verbs` (queue pairs); both take a connection's handshake from
:meth:`Dispatcher.handshake` (:class:`irdma.wire.framing.ServerHandshake`).
"""

from __future__ import annotations

import errno
import inspect
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import trio

from irdma._errors import BadRequest, NoSpace, RemoteProtocolError
from irdma.metrics import shard_metrics
from irdma.wire import auth, optimizers
from irdma.wire import protocol as P
from irdma.wire.framing import ServerHandshake

from .replicate import Replicator
from .request_kinds import (
    PARTED,
    READ_ONLY,
    UPDATES,
    detached,
    file_of,
    forward_key,
    is_forward,
    op_of,
    opcode_name,
    push_of,
    status_name,
)
from .rounds import Rounds
from .shard import ChunksPending, Shard, split_extents

if TYPE_CHECKING:
    from .verbs import VerbsShard

log = logging.getLogger("irdma.server")


class ThreadWork:
    """What :meth:`Dispatcher.handle` gives for a request that needs disk I/O before it is
    applied (SYNC; a new chunk on a shard with a data directory): an awaitable that does the
    I/O in a worker thread, so the event loop serves the other connections meanwhile, then
    applies the request. A front end (TCP, verbs) awaits it in the connection's own task
    before it reads that connection's next request, so one connection's requests are applied
    in the order they came; it gives what :meth:`Dispatcher.handle` gives (a reply, an
    awaitable of one, or another ThreadWork).
    """

    def __init__(self, work: Coroutine[Any, Any, Any], unstarted: Callable[[], None] | None = None) -> None:
        self._work = work
        self._unstarted = unstarted

    def __await__(self) -> Generator[Any, None, P.Reply | Awaitable[P.Reply] | ThreadWork]:
        self._unstarted = None
        return self._work.__await__()

    def close(self) -> None:
        """Drop it without awaiting: nothing is applied, and what it reserved is given back."""
        self._work.close()
        if self._unstarted is not None:
            self._unstarted()
            self._unstarted = None


class Dispatcher:
    """Applies requests to one :class:`Shard` and gives their replies.

    Args:
        shard: the shard's memory and chunks.
        max_payload: largest READ/WRITE payload accepted, bytes.
        keys: the cluster's key file; every connection must prove the key (:mod:`irdma.wire.auth`).
            None: no authentication (``irdma server --no-auth``, for a trusted test bed only).
    """

    def __init__(self, shard: Shard, max_payload: int = P.DEFAULT_MAX_PAYLOAD,
                 keys: auth.KeySource | None = None) -> None:
        self.shard = shard
        self.max_payload = max_payload
        self.keys = keys
        self.verbs: VerbsShard | None = None  # set when the shard's region is registered for RDMA
        self.replicator = Replicator(shard, None, keys)  # its nursery is set when serving
        self.metrics = shard_metrics()
        self.metrics.watch(self)
        self.replicator.metrics = self.metrics
        #: Synchronous rounds being summed (:mod:`.rounds`).
        self.rounds = Rounds(shard.shard_id, shard.version_of)
        #: ``HOST:PORT`` of this shard's metrics exporter, if it has one (told in STAT replies).
        self.metrics_address = ""
        #: Snapshot freezes in force, by token, and the frozen files (:meth:`_freeze`).
        self._freezes: dict[int, _Freeze] = {}
        self._frozen: dict[int, _Freeze] = {}
        #: The push parts clients' updates applied here of late (:meth:`_note_part`).
        self._parts: OrderedDict[int, _PushParts] = OrderedDict()
        #: Chunks being made (see :meth:`_make_then_apply`), each with the event set when done.
        self._making: dict[tuple[int, int], trio.Event] = {}
        # a new chunk's disk I/O goes to a worker thread (ThreadWork), not the event loop
        shard.defer_creation = shard.store is not None

    def handshake(self) -> ServerHandshake:
        """The handshake state of a new connection (:mod:`irdma.wire.auth`)."""
        return ServerHandshake(self.keys, self._identity)

    def _identity(self, proof: bytes) -> P.HelloReply:
        shard = self.shard
        return P.HelloReply(P.PROTOCOL_VERSION, shard.shard_id, shard.capacity, self.max_payload, shard.incarnation,
                            proof=proof)

    def handle(self, frame: P.Frame, staging: memoryview | None = None,
               transport: str = "tcp", zero_copy: bool = False) -> P.Reply | Awaitable[P.Reply] | ThreadWork:
        """Apply one request frame and return the reply. Never raises for bad input.

        ``staging`` is the connection's staging buffer (verbs transport), if it has one. An
        update this shard forwards along a replication chain is applied now and answered later:
        the reply is then an awaitable, and the request's buffers must stay untouched until it
        is done (the forward reads them). ``transport`` (``tcp`` or ``verbs``) labels the
        request's metrics (:mod:`irdma.metrics`).

        ``zero_copy``: a READ's reply data is a view of the shard's memory, valid only until
        this task next yields (an update applied after may change it): the caller sends it at
        once or copies it (:meth:`_reply`). Otherwise it is a copy.

        A request that needs disk I/O before it can be applied (SYNC, or a new chunk on a
        shard with a data directory) gets a :class:`ThreadWork`: the front end awaits it
        before it reads the connection's next request, and gets what this method gives.
        """
        metrics = self.metrics
        t0 = metrics.begin()
        try:
            msg = P.decode_request(frame)
        except P.UnknownOpcode as exc:
            metrics.end(t0, "unknown", transport, "unknown_opcode")
            return P.ErrorReply(P.Status.UNKNOWN_OPCODE, str(exc))
        except RemoteProtocolError as exc:
            metrics.end(t0, opcode_name(frame.opcode), transport, "bad_request")
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        if isinstance(msg, P.Scatter) and msg.staged_extents:  # verbs: its extents out of the staging buffer (copied)
            try:
                msg = msg.unstaged(staging)
            except RemoteProtocolError as exc:
                metrics.end(t0, op_of(msg), transport, "bad_request")
                return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        if not isinstance(msg, READ_ONLY):
            self.shard.note_update()
        if isinstance(msg, P.Sync) and self.shard.store is not None:
            return ThreadWork(self._sync(msg, t0, transport))
        if isinstance(msg, P.Clone):
            return ThreadWork(self._clone(msg, t0, transport))
        if isinstance(msg, P.Admit):
            return ThreadWork(self._admit(msg, t0, transport))
        if self._frozen and _held(msg, self._frozen):
            return self._hold(msg, staging, t0, transport)
        return self._handle(msg, staging, t0, transport, zero_copy)

    # ------------------------------------------------------------ snapshots: the cut
    def _freeze(self, msg: P.Freeze) -> P.ListReply:
        """FREEZE: hold updates to the files (clients', and forwarded ones until the clone) until
        CLONE or THAW, or until the lease ends."""
        self._expire()
        if msg.token == 0 or msg.token in self._freezes:
            raise BadRequest(f"freeze token {msg.token} is 0 or in use")
        busy = [f for f in msg.file_ids if f in self._frozen]
        if busy:
            raise BadRequest(f"file {busy[0]} is being snapshotted by another request: wait for that snapshot,"
                             " then take the snapshot again")
        lease = min(max(msg.lease_ms, 1), FREEZE_MAX_MS) / 1000
        cut = _Freeze(msg.token, trio.current_time() + lease, frozenset(msg.file_ids))
        self._freezes[msg.token] = cut
        for f in cut.files:
            self._frozen[f] = cut
        self._forget_parts()
        since = trio.current_time() - P.PART_MEMORY_S / 2
        parts = [P.Part(pid, i, rec.count) for pid, rec in self._parts.items()
                 if rec.file_id in cut.files and rec.last >= since for i in sorted(rec.indices)]
        return P.FreezeReply([P.ChunkEntry(*e) for f in sorted(cut.files) for e in self.shard.file_chunks(f)], parts)

    def _release(self, cut: _Freeze) -> None:
        """End a freeze: its held updates are applied now, in the order they came (one event
        loop step: an update that comes after finds the files free and the queue empty)."""
        if self._freezes.get(cut.token) is cut:
            del self._freezes[cut.token]
        for f in cut.files:
            if self._frozen.get(f) is cut:
                del self._frozen[f]
        queue, cut.queue = cut.queue, []
        for held in queue:
            self._apply_held(held)
        cut.released.set()

    def _apply_held(self, held: _Held) -> None:
        if not held.gone:
            held.result = self._handle(held.msg, None, held.t0, held.transport)
        held.done.set()

    def _hold(self, msg: P.Request, staging: memoryview | None, t0: float,
              transport: str) -> P.Reply | Awaitable[P.Reply] | ThreadWork:
        """An update to a frozen file: a client's is applied when the freeze ends (CLONE, THAW,
        its lease), or at once when its push was admitted into the cut (:meth:`_admit`); a
        forwarded one (a replica's) at CLONE, before the clone when the cut has it (its version
        is not past the cut's), after it otherwise (:meth:`_cloned`). Each is answered then.
        The connection goes on meanwhile (its next requests are read and applied: another
        file's, or queued behind this one if they are this freeze's), so a push's other parts
        sent on it reach the shard."""
        cut = self._frozen[file_of(msg)]
        chain = getattr(msg, "chain", None)
        part = chain.part if chain is not None else None
        if part is not None and part.push_id in cut.admitted:
            return self._handle(msg, staging, t0, transport)
        if is_forward(msg) and chain is not None:  # held well within its sender's deadline (half of it)
            cut.forward_deadline = min(cut.forward_deadline, trio.current_time() + chain.timeout_ms / 2000)
        held = _Held(detached(msg, staging), t0, transport)
        cut.queue.append(held)
        cut.arrived.set()
        return self._held_reply(cut, held)

    async def _held_reply(self, cut: _Freeze, held: _Held) -> P.Reply:
        until = min(cut.deadline, cut.forward_deadline) if is_forward(held.msg) else cut.deadline
        try:
            while not held.done.is_set():
                with trio.move_on_at(until):
                    await held.done.wait()
                self._expire()
        except BaseException:
            if not held.done.is_set():  # never applied: the connection went away
                held.gone = True
                self.metrics.end(held.t0, op_of(held.msg), held.transport, "cancelled")
            else:  # applied; its answer will not be awaited (a forward goes on in the replicator)
                _close(held.result)
            raise
        result = held.result
        while isinstance(result, ThreadWork):
            result = await result
        if inspect.isawaitable(result):
            result = await result
        assert result is not None
        return result

    def _note_part(self, msg: P.Request) -> None:
        """Remember a client update that was one part of a push (FLAG_PART), applied here."""
        chain = getattr(msg, "chain", None)
        if chain is None or chain.part is None or chain.expect:
            return
        part = chain.part
        rec = self._parts.get(part.push_id)
        if rec is None:
            if len(self._parts) >= MAX_PUSHES_REMEMBERED:
                self._parts.popitem(last=False)
            rec = self._parts[part.push_id] = _PushParts(file_of(msg), part.count)
        else:
            self._parts.move_to_end(part.push_id)
        rec.indices.add(part.index)
        rec.last = trio.current_time()

    def _forget_parts(self) -> None:
        old = trio.current_time() - P.PART_MEMORY_S
        while self._parts:
            pid, rec = next(iter(self._parts.items()))
            if rec.last >= old:
                break
            del self._parts[pid]

    async def _admit(self, msg: P.Admit, t0: float, transport: str) -> P.Reply:
        """ADMIT: apply the held parts of the pushes the cut must take whole (see
        :class:`irdma.wire.protocol.Admit`); wait up to ``wait_ms`` for one if none is held."""
        reply: P.Reply
        try:
            self._expire()
            cut = self._freezes.get(msg.token)
            if cut is None:
                raise BadRequest(f"shard {self.shard.shard_id}: freeze {msg.token} is over (its lease ended):"
                                 " take the snapshot again")
            wanted = set(msg.push_ids)
            cut.admitted |= wanted
            if not self._admit_held(cut) and msg.wait_ms:
                with trio.move_on_at(min(cut.deadline, trio.current_time() + msg.wait_ms / 1000)):
                    while True:
                        cut.arrived = trio.Event()
                        await cut.arrived.wait()
                        if self._admit_held(cut):
                            break
            files = sorted({rec.file_id for pid, rec in self._parts.items() if pid in wanted})
            reply = P.FreezeReply([P.ChunkEntry(*e) for f in files for e in self.shard.file_chunks(f)],
                                  [P.Part(pid, i, self._parts[pid].count) for pid in sorted(wanted)
                                   if pid in self._parts for i in sorted(self._parts[pid].indices)])
        except Exception as exc:
            reply = self._error(exc, msg)
        except BaseException:
            self.metrics.end(t0, "admit", transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    def _admit_held(self, cut: _Freeze) -> int:
        """Apply the held updates of ``cut``'s admitted pushes, in the order they came."""
        take = [h for h in cut.queue if push_of(h.msg) in cut.admitted]
        if take:
            cut.queue = [h for h in cut.queue if push_of(h.msg) not in cut.admitted]
            for held in take:
                self._apply_held(held)
        return len(take)

    def _expire(self) -> None:
        now = trio.current_time()
        for cut in [c for c in self._freezes.values() if c.deadline <= now]:
            log.warning("shard %d: a snapshot's freeze %d ended at its lease, not cloned", self.shard.shard_id, cut.token)
            self._release(cut)
        for cut in [c for c in self._freezes.values() if c.hold_forwards and c.forward_deadline <= now]:
            # a chain's forwards wait no longer (their sender's deadline): the clone, if it
            # comes, finds the chunks past the cut and refuses ("take the snapshot again")
            log.warning("shard %d: a snapshot's freeze %d was not cloned before its held forwards' deadline"
                        " (%.1f s at most): forwarded updates go on", self.shard.shard_id, cut.token, FORWARD_HOLD_S)
            cut.hold_forwards = False
            self._apply_forwards(cut, lambda key, version: True, in_order=False)

    def _being_made(self, key: tuple[int, int]) -> bool:
        """The chunk or its optimizer state chunk is being made (in a worker thread)."""
        return key in self._making or (key[0], optimizers.state_index(key[1])) in self._making

    def _apply_forwards(self, cut: _Freeze, before_cut: Callable[[tuple[int, int], int], bool],
                        in_order: bool = True) -> int:
        """Apply, in the order they came, the forwarded updates ``cut`` holds for which
        ``before_cut(chunk key, version the sender reached)`` is true; returns how many.
        ``in_order``: a forward of a chunk being made (in a worker thread: a forward before it
        made it) waits for the next call, so it finds the chunk at the version it follows;
        without, every forward taken is applied at once (a later one of a chunk being made
        may then be answered STALE, and its sender sends the whole chunk)."""
        applied, keep = 0, []  # type: int, list[_Held]
        blocked: set[tuple[int, int]] = set()  # chunks being made: their next forwards wait (in order)
        queue, cut.queue = cut.queue, keep
        for held in queue:
            key = forward_key(held.msg)
            chain = getattr(held.msg, "chain", None)
            if key is None or chain is None or not before_cut(key, chain.expect) or key in blocked \
                    or (in_order and self._being_made(key)):
                if key is not None:
                    blocked.add(key)  # a later forward of this chunk never overtakes one kept
                keep.append(held)
                continue
            self._apply_held(held)
            applied += 1
            if in_order and self._being_made(key):  # made in a worker thread meanwhile: the next waits for it
                blocked.add(key)
        return applied

    async def _clone(self, msg: P.Clone, t0: float, transport: str) -> P.Reply:
        """CLONE: bring this replica to the cut's versions, clone, end the freeze."""
        reply: P.Reply
        try:
            reply = P.FreeReply(await self._cloned(msg))
        except Exception as exc:
            reply = self._error(exc, msg)
        except BaseException:
            self.metrics.end(t0, "clone", transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    async def _cloned(self, msg: P.Clone) -> int:
        """Clone at the cut, then end the freeze here (protocol 10; THAW ends one that is not
        cloned). Ending it here is safe before the other shards cloned: a post-cut update this
        shard then applies and forwards reaches a successor that is frozen too, which holds it
        until its own clone is made (:func:`_held`: forwards are held while frozen), and the
        pre-cut forwards it holds (its version not past the cut's) it applies first, here."""
        shard = self.shard
        if msg.token == 0:  # a clone of read-only files (a snapshot's): no cut to wait for
            if msg.expect or any(d in {s for s, _ in msg.pairs} or shard.has_file(d) for _, d in msg.pairs):
                raise BadRequest("a clone without a freeze names versions, or a file id in use on this shard")
            return shard.clone_files(msg.pairs)
        self._expire()
        cut = self._freezes.get(msg.token)
        if cut is None:
            raise BadRequest(f"shard {shard.shard_id}: freeze {msg.token} is over (its lease ended): take the snapshot again")
        cut.admitted.clear()  # the cut is fixed: a late part of an admitted push waits for the release
        srcs = {s for s, _ in msg.pairs}
        if not srcs <= cut.files:
            raise BadRequest("a clone names a file its freeze did not hold")
        if any(d in srcs or shard.has_file(d) for _, d in msg.pairs):
            raise BadRequest("a clone's file id is in use on this shard")
        want = {(f, i): v for f, i, v in msg.expect}
        while True:  # a replica catches up on the forwards the cut has (held here, or on their way)
            self._apply_forwards(cut, lambda key, version: version <= want.get(key, 0))
            behind, ahead = 0, []
            for (f, i), v in want.items():
                have = shard.version_of(f, i)
                behind += have < v
                if have > v:
                    ahead.append(f"chunk {i} of file {f} at version {have} > {v}")
            if ahead:
                raise BadRequest(f"shard {shard.shard_id} is past the cut ({', '.join(ahead[:3])}): take the"
                                 " snapshot again")
            if not behind:
                break
            if trio.current_time() >= cut.deadline:
                raise BadRequest(f"shard {shard.shard_id} did not reach the cut's versions of {behind} chunks"
                                 " within the freeze's lease: take the snapshot again")
            await trio.sleep(0.001)
        made = shard.clone_files(msg.pairs)
        self._release(cut)
        return made

    def _handle(self, msg: P.Request, staging: memoryview | None, t0: float,
                transport: str, zero_copy: bool = False) -> P.Reply | Awaitable[P.Reply] | ThreadWork:
        try:
            reply = self._apply(msg, staging, zero_copy)
        except ChunksPending as pending:
            return self._make_then_apply(pending, msg, staging, t0, transport)
        except Exception as exc:
            reply = self._error(exc, msg)
        else:
            if isinstance(msg, PARTED):
                self._note_part(msg)
        if inspect.isawaitable(reply):
            return self._finish(reply, msg, t0, transport)
        self._observe(t0, msg, reply, transport)
        return reply

    async def _sync(self, msg: P.Sync, t0: float, transport: str) -> P.Reply:
        """SYNC (``msync`` of the region and the version table, a checkpoint of the chunk
        index): it may take a while, so off the event loop; the other connections go on."""
        reply: P.Reply
        try:
            await trio.to_thread.run_sync(self.shard.sync)
            self.shard.reclaim()  # the extents chunks grew out of before it: free before the reply
            reply = P.VersionReply(0)
        except Exception as exc:  # OSError, sqlite3.Error: this request fails, the shard goes on
            log.error("sync failed: %s", exc)
            reply = P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: sync failed: {exc}")
        except BaseException:
            self.metrics.end(t0, "sync", transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    def _make_then_apply(self, pending: ChunksPending, msg: P.Request, staging: memoryview | None, t0: float,
                         transport: str) -> ThreadWork:
        """Make the chunks ``msg`` reserved (zeroed and recorded by the data directory, in a
        worker thread), wait for those another request is making, then apply ``msg`` again.

        A chunk is reserved by one request only; a request that needs it meanwhile waits for
        it (``self._making``) and then applies as usual, so two requests that create the same
        chunk make it once, and a retried request id is still applied once (the replicator's
        record is checked when each is applied). Requests of one connection stay in order:
        the front end awaits this before the connection's next request.
        """
        done = trio.Event()
        for key, _ in pending.new:
            self._making[key] = done  # at once: a request that finds the chunk reserved waits on it

        def release(made: bool) -> None:
            (self.shard.install if made else self.shard.abandon)(pending.new)
            for key, _ in pending.new:
                if self._making.get(key) is done:
                    del self._making[key]
            done.set()

        async def work() -> P.Reply | Awaitable[P.Reply] | ThreadWork:
            try:
                if pending.new:
                    store = self.shard.store
                    assert store is not None  # only a shard with a data directory defers creation
                    made = False
                    try:
                        await trio.to_thread.run_sync(store.add_chunks,
                                                      [(f, i, c.offset, c.size, c.extent) for (f, i), c in pending.new])
                        made = True
                    finally:
                        release(made)
                for key in pending.waiting:
                    other = self._making.get(key)
                    if other is not None:
                        await other.wait()
                    else:
                        await trio.lowlevel.checkpoint()
            except Exception as exc:  # OSError, sqlite3.Error: this request fails, the shard goes on
                log.error("shard %d could not make a new chunk: %s", self.shard.shard_id, exc)
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    reply = self._error(NoSpace(f"shard {self.shard.shard_id} cannot make a new chunk: the disk of"
                                                " its data directory is full (other files on that disk count"
                                                " too)"), msg)
                else:
                    reply = P.ErrorReply(P.Status.INTERNAL,
                                         f"shard {self.shard.shard_id}: cannot make a new chunk: {exc}")
                self._observe(t0, msg, reply, transport)
                return reply
            except BaseException:
                self.metrics.end(t0, op_of(msg), transport, "cancelled")
                raise
            return self._handle(msg, staging, t0, transport)

        return ThreadWork(work(), lambda: release(False))

    async def _finish(self, version: Awaitable[int], msg: P.Request, t0: float, transport: str) -> P.Reply:
        reply: P.Reply
        try:
            reply = P.VersionReply(await version)
        except Exception as exc:
            reply = self._error(exc, msg)
        except BaseException:  # cancelled: the connection went away
            self.metrics.end(t0, op_of(msg), transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    def _observe(self, t0: float, msg: P.Request, reply: P.Reply, transport: str) -> None:
        """Record one answered request in the shard's metrics (never raises)."""
        try:
            status = "ok" if not isinstance(reply, P.ErrorReply) else status_name(reply.status)
            bytes_in = bytes_out = 0
            if status == "ok":
                if isinstance(msg, P.Write):
                    bytes_in = len(msg.data)
                elif isinstance(msg, P.Scatter):
                    bytes_in = msg.length
                elif isinstance(reply, P.GatherReply):
                    bytes_out = len(reply.data)
                elif isinstance(msg, P.RemoteWrite):
                    bytes_in = msg.length
                elif isinstance(reply, P.ReadReply) and not reply.hole:
                    bytes_out = len(reply.data)
            self.metrics.end(t0, op_of(msg), transport, status, bytes_in, bytes_out)
        except Exception:  # noqa: BLE001 - metrics never fail a request
            log.debug("recording a request's metrics failed", exc_info=True)

    def _error(self, exc: Exception, msg: P.Request) -> P.ErrorReply:
        """The error reply of a request that raised ``exc`` (:data:`irdma.wire.protocol.STATUS_ERRORS`)."""
        reply = P.error_reply(exc, self.shard.shard_id)
        if reply is not None:
            return reply
        # a bug: this request fails, the shard goes on
        log.error("request %s failed with an unexpected error", type(msg).__name__, exc_info=exc)
        return P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: internal error: {exc!r}")

    def _apply(self, msg: P.Request, staging: memoryview | None = None,
               zero_copy: bool = False) -> P.Reply | Awaitable[int]:
        """Apply a request at once with its handler (:attr:`_HANDLERS`, by message class)."""
        for cls in type(msg).__mro__:
            handler = self._HANDLERS.get(cls)
            if handler is not None:
                return handler(self, msg, staging, zero_copy)
        raise BadRequest(f"{type(msg).__name__} is not valid here")

    # ------------------------------------------------------------ one handler per request
    # (msg, the connection's staging buffer, zero_copy): see :meth:`handle`

    def _on_read(self, msg: P.Read, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        if msg.length > self.max_payload:
            raise BadRequest(f"read of {msg.length} bytes exceeds the payload limit {self.max_payload}")
        self.replicator.check_read(msg)
        version, view = self.shard.read(msg.file_id, msg.chunk_index, msg.offset, msg.length)
        if view is None:
            return P.ReadReply(version, hole=True)
        if zero_copy:  # sent before this task yields, or copied then (see handle)
            return P.ReadReply(version, view)
        # a copy: the reply may take a while to send, and an update applied meanwhile must
        # not tear it (a chunk's updates are atomic to readers; the frame tag covers it)
        return P.ReadReply(version, bytes(view))

    def _on_write(self, msg: P.Write, staging: memoryview | None, zero_copy: bool) -> P.Reply | Awaitable[int]:
        out = self._write(msg)
        return P.VersionReply(out) if isinstance(out, int) else out

    def _write(self, msg: P.Write) -> int | Awaitable[int]:
        """A WRITE applied: a contribution to a synchronous round summed (:mod:`.rounds`; its
        round's update applied by this method again when it is the last), else applied now and
        chained down the replicas."""
        if isinstance(msg.op, P.Update) and msg.op.round is not None:
            if msg.replace:
                raise BadRequest("a whole-chunk copy (FLAG_REPLACE) is never a round's contribution")
            if msg.op.round.close:  # an elastic job's member: every round of the run up to this one applied
                return self.rounds.close(msg.op.round.series, msg.op.round.round, self._write,
                                         lambda push: self._scatter(push, push.data))
            return self.rounds.contribute(msg, msg.data, self._write)
        if msg.chain is not None:
            return self.replicator.write(msg, msg.data)
        if msg.replace:
            raise BadRequest("a whole-chunk copy (FLAG_REPLACE) comes only with a chain")
        return self.shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, msg.data,
                                msg.existing)

    def _on_gather(self, msg: P.Gather, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        chunks = msg.extents["chunk"].astype(np.int64)
        lengths = msg.extents["length"].astype(np.int64)
        total = int(lengths.sum())
        if total + 8 * len(lengths) > self.max_payload:
            raise BadRequest(f"a gather of {total} bytes in {len(lengths)} extents exceeds the payload limit"
                             f" {self.max_payload} (8 bytes of version per extent count)")
        if msg.clean:
            self.replicator.check_gather(msg.file_id, chunks)
        into = memoryview(np.empty(total, dtype=np.uint8))  # type: ignore[arg-type]  # a copy (see READ), filled whole
        versions = self.shard.gather(msg.file_id, chunks, msg.extents["offset"].astype(np.int64), lengths, into)
        return P.GatherReply(versions, into)

    def _on_scatter(self, msg: P.Scatter, staging: memoryview | None, zero_copy: bool) -> P.Reply | Awaitable[int]:
        data: memoryview | bytes = msg.data
        if msg.staged:
            if staging is None:
                raise BadRequest("this connection has no staging buffer (a staged SCATTER needs the verbs transport)")
            n = msg.length
            if msg.staging_offset + n > len(staging):
                raise BadRequest(f"staged range leaves the {len(staging)}-byte staging buffer")
            data = bytes(staging[msg.staging_offset : msg.staging_offset + n])
        if isinstance(msg.op, P.Update) and msg.op.round is not None:  # summed now: the frame is reused
            out = self.rounds.contribute_rows(msg, data, lambda push: self._scatter(push, push.data))
        else:
            out = self._scatter(msg, data)
        return P.VersionReply(out) if isinstance(out, int) else out

    def _scatter(self, msg: P.Scatter, data: memoryview | bytes) -> int | Awaitable[int]:
        """A SCATTER applied now and chained down the replicas (a round's rows: when complete)."""
        if msg.chain is not None:
            return self.replicator.scatter(msg, data)
        parts = split_extents(msg.extents, msg.chunk_size, msg.op, len(data))
        return max(self.shard.scatter(msg.file_id, msg.chunk_size, parts, msg.op, data, msg.existing))

    def _on_resync(self, msg: P.Resync, staging: memoryview | None, zero_copy: bool) -> P.Reply | Awaitable[int]:
        out = self.replicator.resync(msg)
        return P.VersionReply(out) if isinstance(out, int) else out

    def _on_checksum(self, msg: P.Checksum, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        self.replicator.note_view(msg.view)
        return P.ChecksumReply(*self.shard.checksum(msg.file_id, msg.chunk_index))

    def _on_list(self, msg: P.List, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        limit = max(0, min(msg.max_entries, P.MAX_LIST_ENTRIES))
        return P.ListReply([P.ChunkEntry(*e) for e in self.shard.list_chunks(msg.after_file, msg.after_chunk, limit)])

    def _on_sync(self, msg: P.Sync, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        self.shard.sync()
        self.shard.reclaim()
        return P.VersionReply(0)

    def _on_freeze(self, msg: P.Freeze, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        return self._freeze(msg)

    def _on_usage(self, msg: P.Usage, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        return P.UsageReply([(f, *self.shard.exclusive_bytes(f)) for f in msg.file_ids])

    def _on_thaw(self, msg: P.Thaw, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        cut = self._freezes.get(msg.token)
        if cut is not None:
            self._release(cut)
        return P.VersionReply(0)

    def _on_stat(self, msg: P.Stat, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        shard = self.shard
        return P.StatReply(shard.shard_id, shard.capacity, shard.used, shard.chunk_count, self.metrics_address)

    def _on_free(self, msg: P.Free, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        return P.FreeReply(self.shard.free(msg.file_id, msg.first_chunk))

    def _on_free_files(self, msg: P.FreeFiles, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        return P.FreeReply(self.shard.free_files(msg.file_ids))

    def _on_punch(self, msg: P.Punch, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        return P.VersionReply(self.shard.punch(msg.file_id, msg.chunk_index, msg.offset))

    def _on_locate(self, msg: P.Locate, staging: memoryview | None, zero_copy: bool) -> P.Reply:
        chunk = self.shard.locate(msg.file_id, msg.chunk_index, msg.create_size)
        if chunk is None:
            return P.LocateReply(False)
        return P.LocateReply(True, chunk.offset, chunk.size, chunk.slot, self.shard.is_shared(chunk))

    def _on_remote_write(self, msg: P.RemoteWrite, staging: memoryview | None,
                         zero_copy: bool) -> P.Reply | Awaitable[int]:
        shard = self.shard
        if msg.in_place:
            if msg.op != P.UpdateOp.ASSIGN:
                raise BadRequest("only assign may be written in place; stage other update ops")
            done = self.replicator.seen(msg.chain.request_id) if msg.chain is not None else None
            version = done if done is not None else shard.commit_in_place(
                msg.file_id, msg.chunk_index, msg.region_offset, msg.offset, msg.length)
            if msg.chain is None or not msg.chain.successors:
                return P.VersionReply(version)
            # the bytes are in the chunk already: forward a copy of them (the region changes)
            snap = shard.read(msg.file_id, msg.chunk_index, msg.offset, msg.length)[1]
            assert snap is not None
            fwd = P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, bytes(snap),
                          chain=msg.chain)
            out = self.replicator.write(fwd, fwd.data, applied=version)
            return P.VersionReply(out) if isinstance(out, int) else out
        if staging is None:
            raise BadRequest("this connection has no staging buffer (REMOTE_WRITE needs the verbs transport)")
        if msg.staging_offset + msg.length > len(staging):
            raise BadRequest(f"staged range leaves the {len(staging)}-byte staging buffer")
        data = staging[msg.staging_offset : msg.staging_offset + msg.length]
        if isinstance(msg.op, P.Update) and msg.op.round is not None:  # summed now: the staging buffer is reused
            out = self._write(P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data,
                                      msg.existing, msg.chain))
            return P.VersionReply(out) if isinstance(out, int) else out
        if msg.chain is not None:
            fwd = P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, bytes(data),
                          msg.existing, msg.chain)
            out = self.replicator.write(fwd, fwd.data)
            return P.VersionReply(out) if isinstance(out, int) else out
        return P.VersionReply(shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data,
                                          msg.existing))

    #: The handler of each request :meth:`Dispatcher._apply` applies at once, by message class
    #: (CLONE and ADMIT go through :meth:`Dispatcher.handle` only; any other message is refused).
    _HANDLERS: ClassVar[dict[type, Callable[[Dispatcher, Any, memoryview | None, bool],
                                            P.Reply | Awaitable[int]]]] = {
        P.Read: _on_read, P.Write: _on_write, P.Gather: _on_gather,
        P.Scatter: _on_scatter, P.Resync: _on_resync, P.Checksum: _on_checksum,
        P.List: _on_list, P.Sync: _on_sync, P.Freeze: _on_freeze,
        P.Usage: _on_usage, P.Thaw: _on_thaw, P.Stat: _on_stat,
        P.Free: _on_free, P.FreeFiles: _on_free_files, P.Punch: _on_punch,
        P.Locate: _on_locate, P.RemoteWrite: _on_remote_write,
    }


#: Longest lease a FREEZE may ask, milliseconds.
FREEZE_MAX_MS = 30_000
#: Seconds a frozen shard holds forwarded updates at most, and never past half the deadline of
#: any forward it holds (:attr:`irdma.wire.protocol.Chain.timeout_ms`, halved at each hop down a
#: chain): a freeze not cloned by then lets them go on, and its clone is refused if a post-cut
#: update reached a chunk by then.
FORWARD_HOLD_S = 1.0


#: Most pushes a shard remembers the parts of (the oldest are forgotten first).
MAX_PUSHES_REMEMBERED = 65536


class _Freeze:
    """One snapshot's freeze on this shard: the files whose updates wait, the updates held
    (clients' and forwarded ones, in the order they came) and the pushes admitted into the cut."""

    def __init__(self, token: int, deadline: float, files: frozenset[int]) -> None:
        self.token, self.deadline, self.files = token, deadline, files
        self.forward_deadline = min(deadline, trio.current_time() + FORWARD_HOLD_S)
        self.hold_forwards = True  # forwarded updates are held too, until the clone (FORWARD_HOLD_S)
        self.released = trio.Event()
        self.queue: list[_Held] = []
        self.admitted: set[int] = set()
        self.arrived = trio.Event()  # set when an update is held (ADMIT waits for parts)


class _Held:
    """An update a freeze holds (a client's, or a forwarded one), and what applying it gave."""

    def __init__(self, msg: P.Request, t0: float, transport: str) -> None:
        self.msg, self.t0, self.transport = msg, t0, transport
        self.done = trio.Event()
        self.result: P.Reply | Awaitable[P.Reply] | ThreadWork | None = None
        self.gone = False  # its connection went away before it was applied: never applied


class _PushParts:
    """The parts of one push applied here: its file, its part count and the indices."""

    def __init__(self, file_id: int, count: int) -> None:
        self.file_id, self.count = file_id, count
        self.indices: set[int] = set()
        self.last = 0.0


def _close(result: object) -> None:
    """Drop a reply that will not be awaited: a ThreadWork gives back what it reserved; a
    coroutine is closed (no "never awaited" warning)."""
    if isinstance(result, ThreadWork) or inspect.iscoroutine(result):
        result.close()


def _held(msg: P.Request, frozen: dict[int, _Freeze]) -> bool:
    """An update to a frozen file: a client's, or a forwarded one while the freeze holds
    forwards (until its clone, :data:`FORWARD_HOLD_S` at most)."""
    if not isinstance(msg, UPDATES) or file_of(msg) not in frozen:
        return False
    return not is_forward(msg) or frozen[file_of(msg)].hold_forwards
