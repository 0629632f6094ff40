"""Chain replication at one shard: apply an update once, forward it in order, answer when the
rest of the chain has it.

The scheme is chain replication (van Renesse & Schneider, OSDI 2004) with CRAQ's clean reads
(Terrace & Freedman, USENIX ATC 2009), as 3FS uses it for its chunks:

* A client sends an update op to the chunk's *head* replica with the rest of the chain and a
  request id (:class:`irdma.wire.protocol.Chain`). Each replica applies it synchronously (so every
  replica applies the updates of a chunk in the order its head did), records the request id,
  puts a copy on the ordered stream to its successor, and answers only once the successor did.
* Forwards to one successor travel on one :class:`Link`: one connection, one sender task, sent
  in the order they were applied. The successor applies a forward only if it follows: its
  version of the chunk plus one must equal the version the sender reached (``chain.expect``).
  Otherwise it answers STALE and the sender sends its whole chunk (a REPLACE, ordered after
  everything it applied), so a replica that missed updates, or lost the chunk, catches up on
  the chunks it is written to; ``irdma`` resyncs the rest (RESYNC, one chunk at a time).
* A request id seen before is not applied again; the version it reached is answered, and the
  update is still forwarded along the chain the retry names (the client retries the same id
  after a lost reply or a failed successor): exactly once on every replica.
* A request names the shard-map epoch (*view*) its client acts on; a shard refuses a view older
  than one it has seen (FENCED), so a head that was demoted (stopped past its deadline) cannot
  push its copy over the new chain's. A resync names its view in every CHECKSUM it sends, so no
  update from an older view (one that skipped the shard being resynced) lands after the
  comparison. Chains are built from the view alone (a shard back from the dead is only their
  tail until resynced), so a predecessor is never behind its successor.
* CRAQ clean reads: a chunk with forwards not yet acknowledged is *dirty* here; a READ asking for
  a clean copy gets DIRTY and the client reads the chain's tail, which is always clean.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Awaitable
from typing import Any

import numpy as np
import trio

from irdma._errors import (
    BadRequest,
    DataLost,
    Dirty,
    Fenced,
    IrdmaError,
    NoSpace,
    ReplicaFailed,
    ReplicaStale,
    ShardUnavailable,
)
from irdma.metrics import error_kind
from irdma.transport.tcp import TcpConnection, TcpTransport
from irdma.wire import auth, optimizers
from irdma.wire import protocol as P
from irdma.wire.extents import move, positions

from .shard import Shard, split_extents

log = logging.getLogger("irdma.server.replicate")

#: Request ids remembered for deduplication (a retry comes within one client deadline).
DEDUP_ENTRIES = 1 << 17
#: The largest step a shard-map epoch may take between two requests a shard sees.
MAX_VIEW_STEP = 1 << 32
#: Seconds a connect to a successor may take (a stopped one accepts but never answers).
CONNECT_TIMEOUT_S = 2.0


@dataclasses.dataclass(eq=False)
class _Forward:
    msg: P.Write | P.Scatter
    seq: int
    sent: trio.Event = dataclasses.field(default_factory=trio.Event)
    conn: TcpConnection | None = None
    pend: Any = None
    error: IrdmaError | None = None
    abandoned: bool = False  # its waiter gave up: not sent


class Link:
    """The ordered stream of forwards from this shard to one successor shard.

    :meth:`submit` is synchronous, so forwards are queued in the order the updates were applied;
    one task sends them in that order on one connection. A forward that misses its deadline
    breaks the connection (the successor is stopped or overloaded); later ones reconnect.
    """

    def __init__(self, address: str, successor_id: int, nursery: trio.Nursery, name: str,
                 keys: auth.KeySource | None) -> None:
        self.address = address
        self.successor_id = successor_id
        self._nursery = nursery
        self._name = name
        self._keys = keys
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self._conn: TcpConnection | None = None
        self._seq = 0
        self.replaced: dict[tuple[int, int], _Forward] = {}  # the last REPLACE queued per chunk
        nursery.start_soon(self._run, name=f"irdma-forward {address}")

    def submit(self, msg: P.Write | P.Scatter) -> _Forward:
        self._seq += 1
        fw = _Forward(msg, self._seq)
        self._send.send_nowait(fw)
        return fw

    async def _connection(self) -> TcpConnection:
        if self._conn is not None and not self._conn.broken:
            return self._conn
        self._conn = await TcpTransport().connect(self.address, self._nursery, client_name=self._name,
                                                  key=self._keys.ring() if self._keys is not None else None,
                                                  timeout=CONNECT_TIMEOUT_S)
        return self._conn

    async def _run(self) -> None:
        async for fw in self._recv:
            if fw.abandoned:
                fw.sent.set()
                continue
            try:
                fw.conn = await self._connection()
                msg = fw.msg
                if isinstance(msg, P.Write) and msg.replace and len(msg.data) < msg.chunk_size and \
                        fw.conn.info.version < P.SHORT_COPIES:  # it takes a whole chunk only
                    msg = dataclasses.replace(msg, data=bytes(msg.data) + bytes(msg.chunk_size - len(msg.data)))
                fw.pend = await fw.conn.start(msg)
            except IrdmaError as exc:
                fw.error = exc
            fw.sent.set()

    async def result(self, fw: _Forward, deadline: float) -> int:
        """The successor's answer to a forward: the version it reached.

        Raises:
            ReplicaStale: it does not follow (answered STALE or CHUNK_LOST).
            ReplicaFailed: it failed, deeper or here, or missed ``deadline`` (trio time).
            Fenced: it has seen a newer view than the request's.
        """
        with trio.move_on_at(deadline):
            try:
                await fw.sent.wait()
                if fw.error is not None:
                    raise fw.error
                assert fw.conn is not None
                reply = await fw.conn.finish(fw.pend)
                return P.expect_reply(reply, P.VersionReply, P._REQUEST_OPCODE[type(fw.msg)].name,
                                      f"replica {self.successor_id} at {self.address}").version
            except (ReplicaFailed, Fenced, NoSpace, BadRequest):
                raise  # a full replica is not a failed one: the client hears ENOSPC
            except (ReplicaStale, DataLost) as exc:
                raise ReplicaStale(exc.args[0], self.successor_id) from None
            except P.UnexpectedReply as exc:  # it mixes up replies: not trusted with the next forward
                if fw.conn is not None:
                    await fw.conn.aclose()  # later forwards reconnect
                raise ReplicaFailed(f"replica {self.successor_id} at {self.address} failed: {exc.args[0]}",
                                    self.successor_id) from None
            except IrdmaError as exc:
                why = exc.args[0] if exc.args else repr(exc)
                raise ReplicaFailed(f"replica {self.successor_id} at {self.address} failed: {why}",
                                    self.successor_id) from None
        fw.abandoned = True
        if fw.conn is not None:
            await fw.conn.aclose()  # a stopped successor: later forwards reconnect
        raise ReplicaFailed(f"replica {self.successor_id} at {self.address} did not answer a forward in time",
                            self.successor_id)


class Replicator:
    """The chain-replication state of one shard: request ids applied, the newest view seen,
    chunks with forwards in flight, and the links to successors.

    Args:
        shard: the shard's chunks.
        nursery: where the links' sender tasks live.
        keys: the cluster key this shard proves to its successors (None: no authentication).
    """

    def __init__(self, shard: Shard, nursery: trio.Nursery | None, keys: auth.KeySource | None = None) -> None:
        self.shard = shard
        self.nursery = nursery
        self.keys = keys
        self.view = 0
        # request id -> version reached; (request id, chunk index) for a SCATTER's chunks
        self._applied: collections.OrderedDict[int | tuple[int, int], int] = collections.OrderedDict()
        self._dirty: collections.Counter[tuple[int, int]] = collections.Counter()
        self._links: dict[str, Link] = {}
        #: Where forwards are timed (:class:`irdma.metrics.ShardMetrics`; the server sets it).
        self.metrics: Any = None

    # ------------------------------------------------------------ synchronous part
    def seen(self, request_id: int) -> int | None:
        """The version a request id already reached here, or None (0: no id)."""
        return self._applied.get(request_id) if request_id else None

    def check_read(self, msg: P.Read) -> None:
        """Raise Dirty for a clean read of a chunk with forwards in flight."""
        if msg.clean and self._dirty[(msg.file_id, msg.chunk_index)]:
            raise Dirty(f"shard {self.shard.shard_id}: chunk ({msg.file_id}, {msg.chunk_index}) has an update"
                        " not yet on every replica: read the chain's tail")

    def check_gather(self, file_id: int, chunks: Any) -> None:
        """Raise Dirty for a clean GATHER that names a chunk with forwards in flight."""
        if self._dirty:
            for index in set(chunks.tolist()):
                if self._dirty[(file_id, index)]:
                    raise Dirty(f"shard {self.shard.shard_id}: chunk ({file_id}, {index}) has an update not yet on"
                                " every replica: read the chain's tail")

    def note_view(self, view: int) -> None:
        """Fence shard-map epochs older than ``view`` from now on (0: none named).

        Raises:
            Fenced: this shard has seen a newer epoch than ``view``.
        """
        if view > self.view + MAX_VIEW_STEP:
            # epochs move by one per change of the shard map: a jump this large is a bug or a
            # misbehaving peer, and taking it would fence every honest client from now on
            raise BadRequest(f"shard {self.shard.shard_id}: shard-map epoch {view} is implausibly far past {self.view}")
        if view < self.view:
            raise Fenced(f"shard {self.shard.shard_id} has seen shard-map epoch {self.view}, the request acts on"
                         f" {view}: read the shard map again")
        self.view = view

    def _check_view(self, chain: P.Chain) -> None:
        self.note_view(chain.view)

    def _remember(self, request_id: int | tuple[int, int], version: int) -> None:
        if request_id:
            self._applied[request_id] = version
            if len(self._applied) > DEDUP_ENTRIES:
                self._applied.popitem(last=False)

    def write(self, msg: P.Write, data: memoryview | bytes, applied: int | None = None) -> int | Awaitable[int]:
        """Apply a chained update (``msg.chain`` set) once and start forwarding it.

        ``applied``: the update is already applied here (an assign a client wrote in place by
        RDMA WRITE) and reached this version; only forward it.

        Returns:
            The chunk's version when this shard is the chain's tail, else an awaitable that
            gives it once every successor has the update.

        Raises:
            Fenced, ReplicaStale (this shard does not follow its predecessor), and what
            :meth:`Shard.write` raises. Nothing changed.
        """
        chain = msg.chain
        assert chain is not None
        self._check_view(chain)
        shard = self.shard
        version = self._applied.get(chain.request_id) if chain.request_id else None
        if version is None and applied is not None:
            version = applied  # applied in place already: only remember and forward it
            self._remember(chain.request_id, applied)
        if version is None:
            if msg.replace:
                version = shard.replace(msg.file_id, msg.chunk_index, msg.chunk_size, data, chain.expect)
            elif chain.expect:
                have = shard.version_of(msg.file_id, msg.chunk_index)
                if have + 1 != chain.expect:
                    raise ReplicaStale(
                        f"shard {shard.shard_id}: chunk ({msg.file_id}, {msg.chunk_index}) is at version {have},"
                        f" the update follows version {chain.expect - 1}", shard.shard_id)
                version = shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data)
            else:
                version = shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data,
                                      msg.existing)
            self._remember(chain.request_id, version)
        if not chain.successors:
            return version
        fwd = dataclasses.replace(msg, data=data, existing=False, chain=self._next(chain, version))
        return self._forward(msg.file_id, msg.chunk_index, fwd, chain, version)

    def scatter(self, msg: P.Scatter, data: memoryview | bytes) -> int | Awaitable[int]:
        """Apply a chained SCATTER once per (request id, chunk) and forward each chunk's part
        down the chain as a SCATTER of that chunk alone (so a successor's ``expect`` check and a
        stale replica's whole-chunk REPLACE work per chunk, as for :meth:`write`).

        Returns:
            The highest chunk version reached, or an awaitable of it (see :meth:`write`).

        Raises:
            Fenced, ReplicaStale, and what :meth:`Shard.scatter` raises.
        """
        chain = msg.chain
        assert chain is not None
        self._check_view(chain)
        shard = self.shard
        parts = split_extents(msg.extents, msg.chunk_size, msg.op, len(data))
        if chain.expect and len(parts) != 1:
            raise BadRequest("a forwarded SCATTER names extents of one chunk")
        src = np.frombuffer(data, dtype=np.uint8)
        keys = [(chain.request_id, index) if chain.request_id else 0 for index, _, _, _ in parts]
        versions = [self._applied.get(k) if k else None for k in keys]
        todo = [i for i, v in enumerate(versions) if v is None]  # chunks this request id has not reached yet
        if todo:
            if chain.expect:
                index = parts[0][0]
                have = shard.version_of(msg.file_id, index)
                if have + 1 != chain.expect:
                    raise ReplicaStale(
                        f"shard {shard.shard_id}: chunk ({msg.file_id}, {index}) is at version {have},"
                        f" the update follows version {chain.expect - 1}", shard.shard_id)
            done = shard.scatter(msg.file_id, msg.chunk_size, [parts[i] for i in todo], msg.op, data,
                                 msg.existing and not chain.expect)
            for i, v in zip(todo, done, strict=True):
                versions[i] = v
                self._remember(keys[i], v)
        if not chain.successors:
            return max(v for v in versions if v is not None)
        # every forward is built before any is queued: nothing can fail between queueing them
        forwards = []
        for (index, offs, lens, at), version in zip(parts, versions, strict=True):
            assert version is not None
            packed = np.empty(int(lens.sum()), dtype=np.uint8)
            move(packed, positions(lens)[:-1], src, at, lens)
            forwards.append((index, version, P.Scatter(msg.file_id, msg.chunk_size,
                                                       P.extents(np.full(len(offs), index), offs, lens), msg.op,
                                                       packed.tobytes(), chain=self._next(chain, version))))
        outs: list[int | Awaitable[int]] = [self._forward(msg.file_id, index, fwd, chain, version)
                                            for index, version, fwd in forwards]

        async def all_of() -> int:
            # every chunk's wait runs (and ends: its chunk stops being dirty), cancelled or not
            results: list[int] = [o for o in outs if isinstance(o, int)]
            errors: list[Exception] = []

            async def one(aw: Awaitable[int]) -> None:
                try:
                    results.append(await aw)
                except Exception as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for o in outs:
                    if not isinstance(o, int):
                        nursery.start_soon(one, o)
            if errors:
                raise errors[0]
            return max(results)

        return all_of()

    def resync(self, msg: P.Resync) -> int | Awaitable[int]:
        """Send this shard's copy of a chunk down the chain (RESYNC); see :meth:`write`."""
        self._check_view(msg.chain)
        snap = self.shard.copy_of(msg.file_id, msg.chunk_index)
        if snap is None:
            raise DataLost(f"shard {self.shard.shard_id} has no chunk ({msg.file_id}, {msg.chunk_index})")
        version, chunk_size, data = snap
        if not msg.chain.successors:
            return version
        link = self._link(msg.chain)
        fw = self._submit_replace(link, msg.file_id, msg.chunk_index, chunk_size, data, version, msg.chain)
        return self._await_replace(link, (msg.file_id, msg.chunk_index), fw, version,
                                   trio.current_time() + msg.chain.timeout_ms / 1000)

    @staticmethod
    def _next(chain: P.Chain, version: int) -> P.Chain:
        return P.Chain(chain.request_id, chain.view, version, max(1, chain.timeout_ms // 2), chain.successors[1:])

    def _link(self, chain: P.Chain) -> Link:
        sid, address = chain.successors[0]
        link = self._links.get(address)
        if link is None:
            if self.nursery is None:
                raise ShardUnavailable(f"shard {self.shard.shard_id} is not serving: it cannot forward")
            link = self._links[address] = Link(address, sid, self.nursery, f"shard {self.shard.shard_id} forwarder",
                                               self.keys)
        return link

    def _submit_replace(self, link: Link, file_id: int, chunk_index: int, chunk_size: int, data: bytes,
                        version: int, chain: P.Chain) -> _Forward:
        """Queue a whole-chunk copy (REPLACE: ``data``, the bytes the chunk's extent holds, zeros
        after them; padded to the whole chunk for a successor older than protocol 12), its
        optimizer state right behind it."""
        msg = P.Write(file_id, chunk_index, chunk_size, 0, P.UpdateOp.ASSIGN, data,
                      chain=P.Chain(0, chain.view, version, max(1, chain.timeout_ms // 2), chain.successors[1:]),
                      replace=True)
        fw = link.submit(msg)
        link.replaced[(file_id, chunk_index)] = fw
        state = self.shard.copy_of(file_id, optimizers.state_index(chunk_index))
        if state is not None:  # the chunk's optimizer state goes with it, right behind it
            sv, ssize, sdata = state
            smsg = P.Write(file_id, optimizers.state_index(chunk_index), ssize, 0, P.UpdateOp.ASSIGN, sdata,
                           chain=P.Chain(0, chain.view, max(sv, 1), max(1, chain.timeout_ms // 2),
                                         chain.successors[1:]), replace=True)
            sfw = link.submit(smsg)
            if self.nursery is not None:
                self.nursery.start_soon(self._watch_state_copy, link, sfw, (file_id, chunk_index),
                                        trio.current_time() + chain.timeout_ms / 1000)
        return fw

    async def _watch_state_copy(self, link: Link, fw: _Forward, key: tuple[int, int], deadline: float) -> None:
        try:
            await link.result(fw, deadline)
        except IrdmaError as exc:
            log.warning("shard %d could not copy the optimizer state of chunk %s to replica %d: %s",
                        self.shard.shard_id, key, link.successor_id, exc)

    # ------------------------------------------------------------ the wait for the chain
    def _forward(self, file_id: int, chunk_index: int, fwd: P.Write | P.Scatter, chain: P.Chain,
                 version: int) -> Awaitable[int]:
        link = self._link(chain)
        key = (file_id, chunk_index)
        fw = link.submit(fwd)
        self._dirty[key] += 1
        # one deadline for the whole wait, a REPLACE after STALE included: the client's own
        # deadline is twice the forward's, so a head waiting on a failed successor still answers
        # FORWARD_FAILED in time instead of being taken for failed itself
        deadline = trio.current_time() + chain.timeout_ms / 1000

        async def finish() -> int:
            t0 = trio.current_time()
            status = "cancelled"
            try:
                try:
                    await link.result(fw, deadline)
                except ReplicaStale:
                    # the successor missed updates (or lost the chunk): send it ours, ordered
                    # after everything applied here; one REPLACE covers every forward before it
                    last = link.replaced.get(key)
                    if last is None or last.seq < fw.seq:
                        snap = self.shard.copy_of(file_id, chunk_index)
                        if snap is None:  # freed here since: nothing left to bring it
                            status = "ok"
                            return version
                        last = self._submit_replace(link, file_id, chunk_index, snap[1], snap[2], snap[0], chain)
                    await self._await_replace(link, key, last, version, deadline)
                status = "ok"
                return version
            except Exception as exc:
                status = error_kind(exc)
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.forwarded(trio.current_time() - t0, status)
                self._dirty[key] -= 1
                if not self._dirty[key]:
                    del self._dirty[key]

        return finish()

    async def _await_replace(self, link: Link, key: tuple[int, int], fw: _Forward, version: int,
                             deadline: float) -> int:
        try:
            await link.result(fw, deadline)
        except ReplicaStale as exc:  # a REPLACE always follows: only a bug gets here
            raise ReplicaFailed(f"replica {link.successor_id} refused a whole-chunk copy: {exc}",
                                link.successor_id) from None
        finally:
            if link.replaced.get(key) is fw:
                del link.replaced[key]
        log.info("shard %d brought replica %d up to date on chunk %s (version %d)", self.shard.shard_id,
                 link.successor_id, key, version)
        return version
