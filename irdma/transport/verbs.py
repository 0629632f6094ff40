"""RDMA verbs transport (pyverbs, Debian's ``python3-pyverbs``).

How it works
------------
A verbs connection is a TCP control connection (HELLO, then VERBS_CONNECT exchanges RC queue
pair numbers, PSNs and GIDs, the way ``ib_write_bw`` does without rdma_cm) plus one RC queue
pair to the shard. After the exchange every request goes over the queue pair:

* **pull**: a one-sided ``RDMA READ`` of the chunk's bytes straight from the shard's memory
  region, and of its version from the shard's version table. No shard CPU is involved. The
  chunk's place comes from a LOCATE request the first time and is cached afterwards (chunks
  never move while they exist; the cache of a file is dropped when this client frees its
  chunks and when a mount opens the file, which gives close-to-open consistency).
* **push** (every update op): a one-sided ``RDMA WRITE`` into one of this connection's staging
  slots on the shard and, right behind it on the same queue pair, a REMOTE_WRITE request (a
  ``SEND``); the shard applies the update from there (SoftMemoryBox II's accumulate from staging
  buffers), bumps the version and replies. One task posts both, the WRITE first, with no
  checkpoint in between: RC queue pairs execute in order, so the bytes are in place when the
  shard reads the SEND. An ``assign`` used to go straight into the chunk (``in_place_assign``,
  off): a chunk a snapshot shares must be copied before it changes (copy-on-write), and only
  the shard, applying the update, can do that first; a byte written into the chunk by a client's
  cached one-sided location would change the snapshot. The cost is one copy on the shard.
* STAT, FREE, PUNCH, LIST, LOCATE and every other control request (:meth:`VerbsConnection.call`):
  protocol frames carried in ``SEND``/``RECV`` messages.

Client buffers are registered once (a pool) and reused; requests larger than the device's
``max_msg_sz`` or the pool's buffers are split; up to ``SEND_DEPTH`` work requests are kept in
flight per queue pair, and at most as many requests as the shard has receive slots (credits).
Completions are awaited on the completion channel's file descriptor with
``trio.lowlevel.wait_readable``, never by polling in a loop.

Cancellation and failure
------------------------
The rule of :mod:`irdma.transport.base`, where posting is synchronous. Every resource a call
needs (send-queue slots, a SEND slot, a pool buffer, a credit, a staging slot) is taken first;
a call cancelled then posted nothing and had no effect. Then all of its work requests are
posted at once. A call cancelled after that returns at once and its work goes on: each resource
goes back only when the completion or the reply that frees it arrives (the poller gives it
back), so no registered buffer is reused while the device may still read or write it, and no
byte reaches the caller's buffer after the call returned (pulls land in a pool buffer that only
the call itself copies out). Such a push may or may not be applied, as with TCP once the
request left; the connection goes on.

A failed work request, an unreadable reply, a refused post, the shard closing the control
connection, and :meth:`VerbsConnection.aclose` declare the connection broken: the queue pair
is destroyed, every pending and later call fails with ShardUnavailable (``broken`` is True),
and what was lent to work in flight at that moment is never lent again.

Where the parts live
--------------------
This module holds the client's connection and transport (:class:`VerbsConnection`,
:class:`VerbsTransport`). The opened device and its memory regions are in
:mod:`irdma.transport.verbs_device`; the queue pair the client and the shard share
(:class:`Endpoint`) in :mod:`irdma.transport.verbs_endpoint`; what is lent to transfers (slots,
credits, pool buffers) in :mod:`irdma.transport.verbs_lending`; pyverbs itself is imported in
:mod:`irdma.transport._pyverbs`. Their names are re-exported here.

References: iRDMA (HPCC 2017) for one-sided pulls; ``ibv_post_send(3)``, ``ibv_req_notify_cq(3)``
and ``ibv_get_cq_event(3)`` for the verbs used.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import trio

from irdma._errors import BadRequest, DataLost, IrdmaError, ShardUnavailable, TransportUnavailable, message_of
from irdma.wire import protocol as P
from irdma.wire.auth import AuthFailed, KeyRing
from irdma.wire.extents import move, positions
from irdma.wire.framing import Macs, handshake, read_frame, recv_exactly, send_parts, tune_socket
from irdma.wire.protocol import UpdateOp, raise_for_error

from ..units import parse_address
from ._pyverbs import (
    CQ,
    GID,
    MR,
    PD,
    QP,
    SGE,
    AHAttr,
    CompChannel,
    Context,
    GlobalRoute,
    PyverbsError,
    PyverbsRDMAError,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
    e,
    get_device_list,
)
from .base import ShardConnection, ShardInfo, Transport
from .verbs_device import (
    LOCAL_ACCESS,
    REMOTE_ACCESS,
    VerbsDevice,
    _fix,
    _gid_bytes,
    _gid_index,
    _gid_str,
    device_status,
    view_of,
)
from .verbs_endpoint import (
    _RECV_BIT,
    RECV_SLOTS,
    SEND_DEPTH,
    SLOT_SIZE,
    Endpoint,
    Wr,
    _fd_links,
    _open_comp_channel,
    _Waiter,
    _wc_name,
)
from .verbs_lending import POOL_BUFFER_SIZE, POOL_BUFFERS, STAGING_SLOTS, _Hold, _Lender, _Pool

CONNECT_TIMEOUT = 10.0  # seconds for TCP connect, HELLO and VERBS_CONNECT together
RELEASE_TIMEOUT = 10.0  # seconds aclose waits for the poller to release the verbs resources
#: RDMA READs of one gather batch (at most half the send queue, so two batches fit in flight).
GATHER_WRS = SEND_DEPTH // 2
#: Extents of one staged SCATTER: its control frame (16 bytes each) must fit a SEND slot.
SCATTER_EXTENTS = 384
_R = TypeVar("_R")


@dataclass
class _Call:
    """A request sent over SEND, waiting for its reply. Its credit (a receive slot of the
    shard) and its staging slot go back when the reply arrives, even if its caller was
    cancelled: only then is the shard done with them."""

    done: trio.Event
    credit: int
    staging: int | None = None
    reply: P.Reply | None = None


class VerbsConnection(ShardConnection):
    """A client's verbs connection to one shard. Create with :meth:`VerbsTransport.connect`."""

    def __init__(self, sock: Any, address: str, hello: P.HelloReply, dev: VerbsDevice, nursery: trio.Nursery,
                 macs: Macs | None = None) -> None:
        self._sock = sock
        self._macs = macs  # the control connection's frame tags (VERBS_CONNECT goes there)
        self.address = address
        self.dev = dev
        self.info = ShardInfo(hello.shard_id, hello.capacity, min(hello.max_payload, POOL_BUFFER_SIZE), hello.incarnation)
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._locs: dict[tuple[int, int], P.LocateReply] = {}
        self._nursery = nursery
        self.remote: P.VerbsConnectReply | None = None
        self._credits = _Lender((), "credit")  # sized by VERBS_CONNECT
        self._staging = _Lender((), "staging slot")
        self._closed = False
        self._released = trio.Event()
        self._pool = _Pool(dev, POOL_BUFFERS, POOL_BUFFER_SIZE)
        try:
            self._ep = Endpoint(dev, self._on_recv, self._on_fail)
        except BaseException:
            self._pool.mr.close()
            raise

    async def _setup(self) -> None:
        qpn, psn, gid = self._ep.local_info()
        parts = P.encode_request(P.VerbsConnect(qpn, psn, gid), 1)
        if self._macs is not None:
            parts.append(self._macs.seal(parts))
        await send_parts(self._sock, parts)
        frame = await read_frame(self._sock, self.address, 1 << 16, self._macs, "VERBS_CONNECT")
        reply = P.decode_reply(frame)
        if isinstance(reply, P.ErrorReply):
            raise TransportUnavailable(f"shard at {self.address} cannot serve verbs: {reply.message}",
                                       "start the shard with --transport verbs, or use --transport tcp")
        if not isinstance(reply, P.VerbsConnectReply):
            raise ShardUnavailable(f"shard at {self.address} answered VERBS_CONNECT with {type(reply).__name__}")
        # ---- no checkpoint from here on: the connection is whole, or connect closes it
        self._ep.connect(reply.qp_num, reply.psn, reply.gid)
        self.remote = reply
        self._credits = _Lender(range(min(RECV_SLOTS, reply.recv_slots)), "credit")
        self._staging = _Lender(range(0, reply.staging_len - POOL_BUFFER_SIZE + 1, POOL_BUFFER_SIZE), "staging slot")
        self._nursery.start_soon(self._run, name=f"irdma-verbs-poller {self.address}")

    async def _run(self) -> None:
        # The poller lives in the client's nursery; the TCP control socket is watched too, so
        # a shard that goes away fails every pending call.
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._ep.poll_forever)
                try:
                    await recv_exactly(self._sock, memoryview(bytearray(1)))
                except (OSError, IrdmaError, trio.ClosedResourceError):
                    pass
                self._break(f"shard at {self.address} closed the control connection")
                n.cancel_scope.cancel()
        finally:
            self._break(f"connection to shard at {self.address} was closed")
            self._close_resources()
            self._released.set()

    def _break(self, why: str) -> None:
        """Declare the connection broken (see :meth:`_on_fail`). Safe twice."""
        self._ep.fail(ShardUnavailable(why))

    def _on_fail(self, err: IrdmaError) -> None:
        # The queue pair is destroyed (Endpoint.fail); fail every pending call and every wait
        # for a credit, buffer or staging slot; close the control socket so that _run wakes and
        # releases the verbs resources.
        self._fail_pending()
        for lender in (self._credits, self._staging, self._pool.lender):
            lender.close(err)
        self._sock.close()

    @property
    def broken(self) -> bool:
        return self._ep.error is not None

    def _check(self) -> None:
        if self._ep.error is not None:
            raise ShardUnavailable(message_of(self._ep.error))

    def _on_recv(self, slot: int, length: int) -> None:
        off = slot * SLOT_SIZE
        raw = bytes(self._ep.recv_view[off : off + length])
        self._ep.repost(slot)
        try:
            frame = P.parse_header(raw, SLOT_SIZE)
            frame.body = memoryview(raw)[P.HEADER_SIZE : P.HEADER_SIZE + frame.body_len]
            reply = P.decode_reply(frame)
        except IrdmaError as exc:
            self._break(f"bad reply from shard at {self.address}: {exc}")
            return
        call = self._pending.pop(frame.request_id, None)
        if call is None:  # every request stays pending until answered: the counts are off
            self._break(f"shard at {self.address} answered request {frame.request_id}, which is not pending")
            return
        self._release(call)
        call.reply = reply
        call.done.set()

    def _release(self, call: _Call) -> None:
        self._credits.give(call.credit)
        if call.staging is not None:
            self._staging.give(call.staging)
            call.staging = None

    def _fail_pending(self) -> None:
        calls, self._pending = self._pending, {}
        for call in calls.values():
            call.done.set()  # no reply: ShardUnavailable

    async def _rpc(self, msg: P.Call[Any], wrs: list[Wr] | None = None, hold: _Hold | None = None,
                   staging: int | None = None) -> P.Reply:
        """Send ``msg`` (after the RDMA WRITEs ``wrs`` from ``hold``'s buffer, posted first) and
        wait for its reply. Takes over ``staging`` (a staging slot the request uses): it goes
        back when the reply arrives, or at once if nothing was posted.

        Cancelled once posted: the request goes on; its credit and staging slot go back when
        its reply arrives (the reply is dropped).
        """
        try:
            self._check()
            credit = await self._credits.take()
        except BaseException:
            if staging is not None:
                self._staging.give(staging)
            raise
        rid = next(self._ids) & 0xFFFFFFFF
        call = _Call(trio.Event(), credit, staging)
        self._pending[rid] = call
        try:
            await self._ep.post(wrs or [], P.encode_request(msg, rid), hold)
        except BaseException:
            if self._pending.pop(rid, None) is call:  # nothing was posted
                self._release(call)
            raise
        await call.done.wait()
        if call.reply is None:
            raise ShardUnavailable(message_of(self._ep.error or f"connection to shard at {self.address} failed"))
        raise_for_error(call.reply, self.address)
        return call.reply

    def _expect(self, reply: P.Reply, kind: type[_R], msg: P.Call[Any] | type[P.Call[Any]]) -> _R:
        """``reply`` when it is the ``kind`` that answers ``msg`` (a request or its class).

        Raises:
            UnexpectedReply: the shard answered with another kind of reply; the connection is
                broken (as for any bad reply: see :meth:`_on_recv`).
        """
        try:
            name = P._REQUEST_OPCODE[msg if isinstance(msg, type) else type(msg)].name
            return P.expect_reply(reply, kind, name, f"shard at {self.address}")
        except P.UnexpectedReply as exc:
            self._break(str(exc))
            raise

    async def _locate(self, file_id: int, chunk_index: int, create_size: int) -> P.LocateReply | None:
        loc = self._locs.get((file_id, chunk_index))
        if loc is None:
            msg = P.Locate(file_id, chunk_index, create_size)
            reply = self._expect(await self._rpc(msg), P.LocateReply, msg)
            if not reply.exists:
                return None
            loc = reply
            if not reply.shared:  # a shared chunk's place changes at copy-on-write: never cached
                self._locs[(file_id, chunk_index)] = reply
        if create_size and loc.chunk_size != create_size:
            raise BadRequest(f"chunk ({file_id}, {chunk_index}) has size {loc.chunk_size}, request says {create_size}")
        return loc

    def forget_file(self, file_id: int) -> None:
        for key in [k for k in self._locs if k[0] == file_id]:
            del self._locs[key]

    # ------------------------------------------------------------ the data path
    one_sided_reads = True
    #: Write an ``assign`` straight into the chunk by RDMA WRITE (then a commit) rather than
    #: through a staging slot. Off: it would bypass a snapshot's copy-on-write (module doc).
    in_place_assign = False

    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview, clean: bool = False) -> int:
        loc = await self._locate(file_id, chunk_index, 0)
        if loc is None:
            into[:] = bytes(len(into))
            return 0
        if offset + len(into) > loc.chunk_size:
            raise BadRequest(f"range [{offset}, {offset + len(into)}) leaves the {loc.chunk_size}-byte chunk")
        assert self.remote is not None
        r = self.remote
        version = 0
        pool = self._pool
        for start in range(0, len(into), pool.size):
            n = min(pool.size, len(into) - start)
            hold = await pool.take()
            try:
                laddr = pool.mr.buf + hold.offset
                wrs = []
                if start == 0:  # the version first: it is at most the version of the bytes read
                    wrs.append((e.IBV_WR_RDMA_READ, laddr + pool.size, 8, pool.mr.lkey,
                                r.versions_addr + 8 * loc.version_slot, r.versions_rkey))
                wrs.append((e.IBV_WR_RDMA_READ, laddr, n, pool.mr.lkey,
                            r.region_addr + loc.region_offset + offset + start, r.region_rkey))
                await self._ep.wait(await self._ep.post(wrs, hold=hold))
                # no checkpoint from here on: the device is done with the buffer, and it is alive
                if start == 0:
                    version = int.from_bytes(pool.view[hold.offset + pool.size : hold.offset + pool.size + 8], "little")
                into[start : start + n] = pool.view[hold.offset : hold.offset + n]
            finally:
                hold.drop()  # back to the pool once the READs are done too
        return version

    async def write(
        self,
        file_id: int,
        chunk_index: int,
        chunk_size: int,
        offset: int,
        op: UpdateOp | P.Update,
        data: memoryview | bytes,
        existing: bool = False,
        chain: P.Chain | None = None,
    ) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        encoded = bool(P.as_update(op).encoding)
        if encoded:
            # a compressed gradient (protocol 8): the shard checks the decoded range; a payload
            # is one update and cannot be cut (the client sizes pieces to fit a staging buffer)
            if n > self._pool.size:
                raise BadRequest(f"an encoded payload of {n} bytes exceeds the {self._pool.size}-byte staging buffer")
        elif offset < 0 or offset + n > chunk_size:
            raise BadRequest(f"range [{offset}, {offset + n}) leaves the {chunk_size}-byte chunk")
        if n > self._pool.size:
            version = 0
            for k, start in enumerate(range(0, n, self._pool.size)):
                # each part is its own update: its own request id (clients step ids by 256)
                sub = None if chain is None else dataclasses.replace(chain, request_id=chain.request_id + k)
                version = await self.write(file_id, chunk_index, chunk_size, offset + start, op,
                                           view[start : start + self._pool.size], existing or start > 0, sub)
            return version
        assert self.remote is not None
        r = self.remote
        if P.op_kind(op) == UpdateOp.ASSIGN and self.in_place_assign:
            op = UpdateOp.ASSIGN
            for attempt in (1, 2):
                loc = await self._locate(file_id, chunk_index, 0 if existing else chunk_size)
                if loc is None:
                    raise DataLost(f"shard at {self.address}: chunk ({file_id}, {chunk_index}) is gone")
                if loc.chunk_size != chunk_size:
                    raise BadRequest(f"chunk ({file_id}, {chunk_index}) has size {loc.chunk_size}, request says {chunk_size}")
                commit = P.RemoteWrite(file_id, chunk_index, chunk_size, offset, op, True, n, 0, loc.region_offset,
                                       chain=chain)
                try:
                    reply = await self._push(view, r.region_addr + loc.region_offset + offset, r.region_rkey, commit)
                    break
                except BadRequest:
                    # the chunk moved or was freed since we located it (another client freed it):
                    # drop the stale place and locate it afresh, once
                    if self._locs.get((file_id, chunk_index)) is loc:
                        del self._locs[(file_id, chunk_index)]
                    if attempt == 2:
                        raise
        else:
            soff = await self._staging.take()
            reply = await self._push(view, r.staging_addr + soff, r.staging_rkey,
                                     P.RemoteWrite(file_id, chunk_index, chunk_size, offset, op, False, n, soff,
                                                   existing=existing, chain=chain), staging=soff)
        return self._expect(reply, P.VersionReply, P.RemoteWrite).version

    async def gather(self, file_id: int, extents: np.ndarray, clean: bool = False) -> tuple[np.ndarray, memoryview]:
        """One-sided: each extent is an RDMA READ from the chunk's place in the region (located
        once, then cached), up to GATHER_WRS work requests posted at once into a pool buffer,
        each chunk's version slot read first (as :meth:`read` does: at most the version of the
        bytes read; 0 for a chunk freed since it was located)."""
        chunk = extents["chunk"].astype(np.int64)
        offset = extents["offset"].astype(np.int64)
        length = extents["length"].astype(np.int64)
        pos = positions(length)
        into = np.empty(int(pos[-1]), dtype=np.uint8)
        locs = {int(c): await self._locate(file_id, int(c), 0) for c in np.unique(chunk)}
        assert self.remote is not None
        r = self.remote
        pool = self._pool
        room = pool.size - 8 * GATHER_WRS  # the buffer's tail takes the version reads
        versions = np.zeros(len(chunk), dtype=np.uint64)
        n, i = len(chunk), 0
        while i < n:
            hold = await pool.take()
            try:
                base = pool.mr.buf + hold.offset
                wrs: list[Wr] = []
                items: list[tuple[int, int, int, int, int]] = []
                slots: dict[int, int] = {}
                fill = 0
                while i < n and len(wrs) + 2 <= GATHER_WRS:
                    c, o, k, p = int(chunk[i]), int(offset[i]), int(length[i]), int(pos[i])
                    if k > room:
                        raise BadRequest(f"an extent of {k} bytes exceeds the {room}-byte transfer buffer")
                    if fill + k > room:
                        break
                    loc = locs[c]
                    if loc is None:
                        into[p : p + k] = 0
                        i += 1
                        continue
                    if o + k > loc.chunk_size:
                        raise BadRequest(f"range [{o}, {o + k}) leaves the {loc.chunk_size}-byte chunk")
                    if c not in slots:
                        slots[c] = len(slots)
                        wrs.append((e.IBV_WR_RDMA_READ, base + room + 8 * slots[c], 8, pool.mr.lkey,
                                    r.versions_addr + 8 * loc.version_slot, r.versions_rkey))
                    if k:
                        wrs.append((e.IBV_WR_RDMA_READ, base + fill, k, pool.mr.lkey,
                                    r.region_addr + loc.region_offset + o, r.region_rkey))
                    items.append((i, p, fill, k, c))
                    fill += k
                    i += 1
                if wrs:
                    await self._ep.wait(await self._ep.post(wrs, hold=hold))
                    # no checkpoint from here on: the device is done with the buffer
                    at = hold.offset + room
                    seen = {c: int.from_bytes(pool.view[at + 8 * s : at + 8 * s + 8], "little")
                            for c, s in slots.items()}
                    for idx, p, f, k, c in items:
                        into[p : p + k] = pool.view[hold.offset + f : hold.offset + f + k]
                        versions[idx] = seen[c]
            finally:
                hold.drop()
        return versions, memoryview(into)  # type: ignore[arg-type]

    async def scatter(self, file_id: int, chunk_size: int, extents: np.ndarray, op: UpdateOp | P.Update,
                      data: memoryview | bytes, existing: bool = False, chain: P.Chain | None = None) -> int:
        """Staged: up to a pool buffer's worth of bytes (and SCATTER_EXTENTS extents) goes by RDMA
        WRITE into a staging slot, then a SCATTER naming it by SEND. Batches hold whole chunks
        (request id: the chain's); a chunk too large for one is cut in pieces, piece j with the
        chain's request id plus j. So a (request id, chunk) pair always names the same extents,
        however a retry groups the chunks, and the shard applies each exactly once.

        A round's rows (an ``op`` with a :class:`~irdma.wire.protocol.Round`) are never cut: the
        shard counts a member's contribution to a chunk once, so the call is one request (the
        client sizes it to fit a staging slot, :meth:`irdma.client.sparse.SparseRows.push_rows`);
        extents beyond what a SEND carries travel in the staging slot ahead of the rows
        (FLAG_STAGED_EXTENTS)."""
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        chunk = extents["chunk"].astype(np.int64)
        length = extents["length"].astype(np.int64)
        pos = positions(length)
        if pos[-1] != len(src):
            raise BadRequest(f"a scatter of {len(src)} bytes into extents of {pos[-1]}")
        if P.as_update(op).round is not None:
            return await self._scatter_round(file_id, chunk_size, extents, op, src, existing, chain)
        size = self._pool.size
        if len(length) and int(length.max()) > size:
            raise BadRequest(f"an extent of {int(length.max())} bytes exceeds the {size}-byte transfer buffer")
        # pieces of each chunk (in order of first appearance), then batches of whole-chunk pieces
        order = np.argsort(chunk, kind="stable")
        cuts = np.flatnonzero(np.diff(chunk[order])) + 1
        batches: list[tuple[int, np.ndarray]] = []  # (piece number, extent positions)
        whole: list[np.ndarray] = []
        whole_n = whole_bytes = 0

        def close_whole() -> None:
            nonlocal whole, whole_n, whole_bytes
            if whole:
                batches.append((0, np.concatenate(whole)))
            whole, whole_n, whole_bytes = [], 0, 0

        for sel in np.split(order, cuts):
            if not len(sel):
                continue
            cost = np.cumsum(length[sel])
            nbytes = int(cost[-1])
            if len(sel) <= SCATTER_EXTENTS and nbytes <= size:
                if whole_n + len(sel) > SCATTER_EXTENTS or whole_bytes + nbytes > size:
                    close_whole()
                whole.append(sel)
                whole_n, whole_bytes = whole_n + len(sel), whole_bytes + nbytes
                continue
            start, j, base = 0, 0, 0
            while start < len(sel):
                stop = min(int(np.searchsorted(cost, base + size, side="right")), start + SCATTER_EXTENTS)
                batches.append((j, sel[start:stop]))
                base, start, j = int(cost[stop - 1]), stop, j + 1
        close_whole()
        if chain is not None and max((j for j, _ in batches), default=0) >= 256:
            raise BadRequest("a chunk of more than 256 pieces in one scatter: send fewer extents per call")
        assert self.remote is not None
        r = self.remote
        version = 0
        for j, sel in batches:
            payload = np.empty(int(length[sel].sum()), dtype=np.uint8)
            move(payload, positions(length[sel])[:-1], src, pos[:-1][sel], length[sel])
            sub = None if chain is None else dataclasses.replace(chain, request_id=chain.request_id + j)
            soff = await self._staging.take()
            msg = P.Scatter(file_id, chunk_size, extents[sel], op, b"", existing, sub, True, soff)
            reply = await self._push(memoryview(payload), r.staging_addr + soff,  # type: ignore[arg-type]
                                     r.staging_rkey, msg, staging=soff)
            version = max(version, self._expect(reply, P.VersionReply, msg).version)
        return version

    async def _scatter_round(self, file_id: int, chunk_size: int, extents: np.ndarray, op: UpdateOp | P.Update,
                             src: np.ndarray, existing: bool, chain: P.Chain | None) -> int:
        """A round's rows as one staged SCATTER (see :meth:`scatter`), its extents in the staging
        slot when a SEND cannot carry them."""
        ext = np.ascontiguousarray(extents, dtype=P.EXTENT)
        staged = len(ext) > SCATTER_EXTENTS
        payload = np.concatenate([ext.view(np.uint8), src]) if staged else src
        if len(payload) > self._pool.size:
            raise BadRequest(f"a round's rows of {len(src)} bytes in {len(ext)} extents exceed the {self._pool.size}-byte"
                             " staging buffer: push fewer rows per step")
        assert self.remote is not None
        r = self.remote
        soff = await self._staging.take()
        msg = P.Scatter(file_id, chunk_size, ext[:0] if staged else ext, op, b"", existing, chain, True, soff,
                        len(ext) if staged else 0)
        reply = await self._push(memoryview(payload), r.staging_addr + soff, r.staging_rkey, msg,  # type: ignore[arg-type]
                                 staging=soff)
        return self._expect(reply, P.VersionReply, msg).version

    async def _push(self, view: memoryview, raddr: int, rkey: int, commit: P.RemoteWrite | P.Scatter,
                    staging: int | None = None) -> P.Reply:
        """RDMA WRITE ``view`` to ``raddr`` from a pool buffer, then SEND ``commit``: both posted
        together, in that order. Takes over ``staging`` (see :meth:`_rpc`)."""
        pool = self._pool
        try:
            hold = await pool.take()
        except BaseException:
            if staging is not None:
                self._staging.give(staging)
            raise
        try:
            n = len(view)
            pool.view[hold.offset : hold.offset + n] = view  # the caller's buffer is never read again
            wrs = [(e.IBV_WR_RDMA_WRITE, pool.mr.buf + hold.offset, n, pool.mr.lkey, raddr, rkey)] if n else []
            return await self._rpc(commit, wrs, hold, staging)
        finally:
            hold.drop()  # back to the pool once the WRITE is done too

    async def call(self, request: P.Call[_R]) -> _R:
        """See :meth:`ShardConnection.call`: a protocol frame carried in ``SEND``/``RECV``.
        FREE and PUNCH from offset 0 first drop the cached places of the chunks they free."""
        if isinstance(request, P.Free):
            for key in [k for k in self._locs if k[0] == request.file_id and k[1] >= request.first_chunk]:
                del self._locs[key]
        elif isinstance(request, P.Punch) and request.offset == 0:
            self._locs.pop((request.file_id, request.chunk_index), None)
        return self._expect(await self._rpc(request), P.reply_kind(request), request)

    async def aclose(self) -> None:
        """Close the connection: pending calls fail with ShardUnavailable at once; returns once
        the queue pair and registered memory are released (at most a few seconds, even when
        cancelled). Safe twice."""
        self._break(f"connection to shard at {self.address} was closed")
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + RELEASE_TIMEOUT
            await self._released.wait()

    def _close_resources(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        self._ep.close()  # the queue pair first: then nothing touches the pool any more
        self._pool.mr.close()


class VerbsTransport(Transport):
    """Shards reached over RDMA verbs (see the module docstring).

    Args:
        device: the RDMA device to use (default: the first one).

    Raises:
        TransportUnavailable: no usable device (the message names the cause and the fix).
    """

    name = "verbs"

    def __init__(self, device: str | None = None) -> None:
        self.device = VerbsDevice(device)

    async def connect(
        self, address: str, nursery: trio.Nursery, *, client_name: str = "", key: KeyRing | None = None,
        timeout: float = CONNECT_TIMEOUT,
    ) -> VerbsConnection:
        """See :meth:`Transport.connect`: the TCP connect, HELLO and VERBS_CONNECT together take
        at most ``timeout`` seconds (a stopped shard accepts connections but never answers).

        Raises:
            ShardUnavailable: nobody answers, no answer within ``timeout``, or the handshake failed.
            TransportUnavailable: the shard does not serve verbs, or the queue pair cannot be made.
        """
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise ShardUnavailable(str(exc), "fix the address in the shard map (`irdma shard list`)") from None
        sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        conn: VerbsConnection | None = None
        try:
            with trio.fail_after(timeout):
                await sock.connect((host, port))
                tune_socket(sock)
                hello, macs = await handshake(sock, address, client_name, key)
                conn = VerbsConnection(sock, address, hello, self.device, nursery, macs)
                await conn._setup()
        except BaseException as exc:
            if conn is not None:
                conn._close_resources()
            sock.close()
            if isinstance(exc, trio.TooSlowError):
                raise ShardUnavailable(
                    f"shard at {address} did not answer the handshake within {timeout:g} s",
                    "is the shard process stopped or overloaded? `irdma shard list` shows its state",
                ) from None
            if isinstance(exc, OSError):
                raise ShardUnavailable(f"cannot connect to shard at {address}: {exc.strerror or exc}",
                                       "is the shard running? `irdma shard list` shows its state") from None
            if isinstance(exc, IrdmaError) and not isinstance(exc, (ShardUnavailable, TransportUnavailable, AuthFailed)):
                raise ShardUnavailable(f"handshake with {address} failed: {exc}") from None
            raise
        return conn


# The names this module had before its device, endpoint and lending parts moved out: every
# ``from irdma.transport.verbs import ...`` keeps working.
__all__ = [
    "CONNECT_TIMEOUT", "RELEASE_TIMEOUT", "GATHER_WRS", "SCATTER_EXTENTS", "VerbsConnection", "VerbsTransport",
    # verbs_device
    "LOCAL_ACCESS", "REMOTE_ACCESS", "VerbsDevice", "device_status", "view_of", "_fix", "_gid_bytes", "_gid_index",
    "_gid_str",
    # verbs_endpoint
    "RECV_SLOTS", "SEND_DEPTH", "SLOT_SIZE", "Endpoint", "Wr", "_RECV_BIT", "_Waiter", "_fd_links",
    "_open_comp_channel", "_wc_name",
    # verbs_lending
    "POOL_BUFFERS", "POOL_BUFFER_SIZE", "STAGING_SLOTS", "_Hold", "_Lender", "_Pool",
    # pyverbs (through _pyverbs)
    "e", "GID", "AHAttr", "GlobalRoute", "CQ", "CompChannel", "Context", "get_device_list", "MR", "PD",
    "PyverbsError", "PyverbsRDMAError", "QP", "QPAttr", "QPCap", "QPInitAttr", "SGE", "RecvWR", "SendWR",
]
