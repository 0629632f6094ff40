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
* **push with assign**: a one-sided ``RDMA WRITE`` into the chunk, followed on the same queue
  pair by a REMOTE_WRITE request (a ``SEND``) that makes the shard bump the chunk's version.
  RC queue pairs deliver in order, so the bytes are in place when the shard reads it.
* **push with add** (and any other update op): an ``RDMA WRITE`` of the payload into this
  connection's staging buffer on the shard, then a REMOTE_WRITE ``SEND`` that asks the shard to
  apply it from there (SoftMemoryBox II's accumulate from staging buffers), bump the version
  and reply.
* STAT, FREE, PUNCH and LOCATE: protocol frames carried in ``SEND``/``RECV`` messages.

Client buffers are registered once (a pool) and reused; requests larger than the device's
``max_msg_sz`` or the pool's buffers are split; up to ``SEND_DEPTH`` work requests are kept in
flight per queue pair. Completions are awaited on the completion channel's file descriptor with
``trio.lowlevel.wait_readable``, never by polling in a loop.

References: iRDMA (HPCC 2017) for one-sided pulls; ``ibv_post_send(3)``, ``ibv_req_notify_cq(3)``
and ``ibv_get_cq_event(3)`` for the verbs used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import random
import resource
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from irdma import protocol as P
from irdma._errors import BadRequest, DataLost, IrdmaError, ShardUnavailable, TransportUnavailable
from irdma.protocol import ChunkEntry, StatReply, UpdateOp

from .base import ShardConnection, ShardInfo, Transport, parse_address
from .tcp import handshake, raise_for_error, recv_exactly, send_parts, tune_socket

try:  # Debian installs pyverbs for the system python3; let any python3.11 find it
    import pyverbs  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    import sys

    if os.path.isdir("/usr/lib/python3/dist-packages/pyverbs"):
        sys.path.append("/usr/lib/python3/dist-packages")

import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ, CompChannel  # noqa: E402
from pyverbs.device import Context, get_device_list  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

REMOTE_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
SEND_DEPTH = 128  # work requests in flight per queue pair
RECV_SLOTS = 32  # requests a peer may have outstanding (credits)
SLOT_SIZE = 8192  # largest control frame carried by SEND, bytes
POOL_BUFFERS = 8  # registered client buffers
POOL_BUFFER_SIZE = 4 << 20  # bytes each; also the largest piece a request moves
STAGING_SLOTS = 4  # staging buffers per connection on the shard, POOL_BUFFER_SIZE each
_RECV_BIT = 1 << 62


def _fix(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def device_status(name: str | None = None) -> tuple[bool, str]:
    """Whether an RDMA device is usable here, and which (or why not)."""
    try:
        devs = get_device_list()
    except (PyverbsError, PyverbsRDMAError) as exc:
        return False, f"no RDMA device: the kernel has no RDMA subsystem or no device is up ({_fix(exc)})"
    names = [d.name.decode() for d in devs]
    if not names:
        return False, "no RDMA device found (`ibv_devices` lists none; for Soft-RoCE: rdma link add rxe0 type rxe netdev IFACE)"
    if name is not None and name not in names:
        return False, f"RDMA device {name} not found; devices here: {', '.join(names)}"
    return True, f"RDMA device {name or names[0]}"


def view_of(mr: MR) -> memoryview:
    """A writable memoryview of a memory region's buffer (no copy)."""
    return memoryview((ctypes.c_char * mr.length).from_address(mr.buf)).cast("B")


def _gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _gid_index(dev: str, port: int = 1) -> int:
    """The RoCE v2 GID that maps an IPv4 address (``::ffff:a.b.c.d``), else index 0 (InfiniBand)."""
    base = f"/sys/class/infiniband/{dev}/ports/{port}"
    try:
        indices = sorted(int(x) for x in os.listdir(f"{base}/gids"))
    except OSError:
        return 0
    for idx in indices:
        try:
            with open(f"{base}/gid_attrs/types/{idx}") as f:
                typ = f.read().strip()
            with open(f"{base}/gids/{idx}") as f:
                gid = f.read().strip()
        except OSError:
            continue
        if typ == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff"):
            return idx
    return 0


class VerbsDevice:
    """An opened RDMA device: context, protection domain, port 1 and its GID.

    Raises:
        TransportUnavailable: no device, or it cannot be opened.
    """

    def __init__(self, name: str | None = None) -> None:
        ok, why = device_status(name)
        if not ok:
            raise TransportUnavailable(why, "use --transport tcp, or load an RDMA driver")
        if name is None:
            name = get_device_list()[0].name.decode()
        self.name = name
        try:
            self.ctx = Context(name=name)
            self.pd = PD(self.ctx)
            self.port_attr = self.ctx.query_port(1)
            self.dev_attr = self.ctx.query_device()
        except PyverbsRDMAError as exc:
            raise TransportUnavailable(f"cannot open RDMA device {name}: {_fix(exc)}") from None
        self.gid_index = _gid_index(name)
        self.gid = self.ctx.query_gid(1, self.gid_index).gid
        self.max_msg = int(self.port_attr.max_msg_sz) or (1 << 31)
        self.max_rd_atomic = max(1, min(16, int(self.dev_attr.max_qp_rd_atom or 1)))
        self._mrs: list[MR] = []

    def register(self, length: int, access: int, what: str, keep: bool = True) -> MR:
        """Allocate and register ``length`` bytes.

        Raises:
            TransportUnavailable: the memlock limit is too low, or the device refused.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < length:
            raise TransportUnavailable(
                f"cannot register the {what} of {length} bytes: the memlock limit is {soft} bytes",
                "raise it: `ulimit -l unlimited` (or LimitMEMLOCK=infinity for a systemd unit), or use --transport tcp",
            )
        try:
            mr = MR(self.pd, length, access)
        except PyverbsRDMAError as exc:
            hint = "use --transport tcp"
            if getattr(exc, "error_code", None) in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                hint = "raise the memlock limit (`ulimit -l unlimited`) or register less (--capacity)"
            raise TransportUnavailable(
                f"RDMA device {self.name} refused to register the {what}: length {length}, access flags {access:#x}:"
                f" {_fix(exc)}",
                hint,
            ) from None
        if keep:  # closed with the device; others are closed by their owner
            self._mrs.append(mr)
        return mr

    def close(self) -> None:
        """Close the memory regions, the PD and the context (children first). Safe twice."""
        for mr in reversed(self._mrs):
            mr.close()
        self._mrs.clear()
        self.pd.close()
        self.ctx.close()


def _fd_links() -> dict[int, str]:
    links = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            links[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the descriptor of the listing itself
    return links


def _open_comp_channel(ctx: Context) -> tuple[CompChannel, int]:
    """Create a completion channel and find its file descriptor.

    pyverbs 44 does not expose ``ibv_comp_channel.fd``: the channel's descriptor is the one
    ``anon_inode:`` descriptor that appears (or replaces another) while the channel is made.
    """
    before = _fd_links()
    channel = CompChannel(ctx)
    new = [fd for fd, link in _fd_links().items() if link.startswith("anon_inode:") and before.get(fd) != link]
    if len(new) != 1:
        channel.close()
        raise TransportUnavailable(f"cannot find the completion channel's file descriptor (candidates {new})")
    return channel, new[0]


@dataclass
class _Waiter:
    done: trio.Event
    status: int = 0
    vendor_err: int = 0
    opcode: int = 0


class Endpoint:
    """One RC queue pair with its CQ, completion channel, and SEND/RECV slots for control frames.

    ``on_recv(slot, length)`` is called from the poller for each message received; the slot's
    bytes are ``recv_view[slot * SLOT_SIZE : slot * SLOT_SIZE + length]``, and the caller
    gives the slot back with :meth:`repost`.
    """

    def __init__(self, dev: VerbsDevice, on_recv: Callable[[int, int], None]) -> None:
        self.dev = dev
        self._on_recv = on_recv
        self._closed = False
        self.channel, self.channel_fd = _open_comp_channel(dev.ctx)
        self.cq = CQ(dev.ctx, SEND_DEPTH + RECV_SLOTS + 16, None, self.channel, 0)
        self.cq.req_notify()
        cap = QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = REMOTE_ACCESS
        self.qp = QP(dev.pd, init, attr)  # -> INIT
        self.psn = random.randrange(1 << 24)
        self.recv_mr = MR(dev.pd, RECV_SLOTS * SLOT_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self.send_mr = MR(dev.pd, RECV_SLOTS * SLOT_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_view = view_of(self.recv_mr)
        self.send_view = view_of(self.send_mr)
        self._send_free = list(range(RECV_SLOTS))
        self._send_slots = trio.Semaphore(RECV_SLOTS)
        self._wr_slots = trio.Semaphore(SEND_DEPTH - RECV_SLOTS)
        self._waiters: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self.error: IrdmaError | None = None
        for slot in range(RECV_SLOTS):  # before connecting, or the first message meets RNR
            self.repost(slot)

    def repost(self, slot: int) -> None:
        sge = SGE(self.recv_mr.buf + slot * SLOT_SIZE, SLOT_SIZE, self.recv_mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=_RECV_BIT | slot, num_sge=1, sg=[sge]))

    def local_info(self) -> tuple[int, int, bytes]:
        return self.qp.qp_num, self.psn, _gid_bytes(self.dev.gid)

    def connect(self, qp_num: int, psn: int, gid: bytes) -> None:
        """INIT -> RTR -> RTS against the peer's queue pair."""
        a = QPAttr(port_num=1)
        a.path_mtu = min(int(self.dev.port_attr.active_mtu), e.IBV_MTU_4096)
        a.dest_qp_num, a.rq_psn, a.sq_psn = qp_num, psn, self.psn
        a.max_dest_rd_atomic = a.max_rd_atomic = self.dev.max_rd_atomic
        a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
        gr = GlobalRoute(dgid=GID(_gid_str(gid)), sgid_index=self.dev.gid_index, hop_limit=64)
        a.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr)
        try:
            self.qp.to_rts(a)
        except PyverbsRDMAError as exc:
            raise TransportUnavailable(f"cannot connect queue pair {self.qp.qp_num} to {qp_num}: {_fix(exc)}") from None

    # ------------------------------------------------------------ completions
    async def poll_forever(self) -> None:
        """Dispatch completions until cancelled; sleeps on the completion channel's fd."""
        try:
            while True:
                self._drain()
                await trio.lowlevel.wait_readable(self.channel_fd)
                self.channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
                self.cq.req_notify()  # then drain again: nothing that arrived in between is lost
        finally:
            self._fail(ShardUnavailable("the queue pair was closed"))

    def _drain(self) -> None:
        while True:
            n, wcs = self.cq.poll(32)
            if not n:
                return
            for wc in wcs:
                if wc.wr_id & _RECV_BIT:
                    if wc.status != e.IBV_WC_SUCCESS:
                        self._fail(ShardUnavailable(f"receive failed: status {wc.status} ({_wc_name(wc.status)})"))
                        continue
                    self._on_recv(wc.wr_id & ~_RECV_BIT, wc.byte_len)
                    continue
                w = self._waiters.pop(wc.wr_id, None)
                if w is not None:
                    w.status, w.vendor_err, w.opcode = wc.status, wc.vendor_err, wc.opcode
                    w.done.set()

    def _fail(self, err: IrdmaError) -> None:
        if self.error is None:
            self.error = err
        for w in self._waiters.values():
            w.status = -1
            w.done.set()
        self._waiters.clear()

    async def post(self, wrs: list[tuple[int, int, int, int, int, int]]) -> None:
        """Post RDMA work requests and wait for all of them.

        Each entry is ``(opcode, local_addr, length, lkey, remote_addr, rkey)``; pieces
        longer than the device's ``max_msg_sz`` are split.

        Raises:
            ShardUnavailable: a work request completed with an error.
        """
        split: list[tuple[int, int, int, int, int, int]] = []
        for op, laddr, n, lkey, raddr, rkey in wrs:
            for k in range(0, n, self.dev.max_msg):
                m = min(self.dev.max_msg, n - k)
                split.append((op, laddr + k, m, lkey, raddr + k, rkey))
        waiters = []
        for op, laddr, n, lkey, raddr, rkey in split:
            await self._wr_slots.acquire()
            w = self._post_one(op, laddr, n, lkey, raddr, rkey)
            waiters.append(w)
        try:
            for w in waiters:
                await w.done.wait()
        finally:
            for _ in waiters:
                self._wr_slots.release()
        for w in waiters:
            self._check(w)

    def _post_one(self, op: int, laddr: int, n: int, lkey: int, raddr: int = 0, rkey: int = 0) -> _Waiter:
        if self.error is not None:
            raise ShardUnavailable(str(self.error))
        wr_id = next(self._ids)
        wr = SendWR(wr_id=wr_id, opcode=op, num_sge=1, sg=[SGE(laddr, n, lkey)], send_flags=e.IBV_SEND_SIGNALED)
        if op != e.IBV_WR_SEND:
            wr.set_wr_rdma(rkey, raddr)
        w = _Waiter(trio.Event())
        self._waiters[wr_id] = w
        try:
            self.qp.post_send(wr)
        except PyverbsRDMAError as exc:
            del self._waiters[wr_id]
            raise ShardUnavailable(f"the device refused a work request: opcode {op}, {n} bytes: {_fix(exc)}") from None
        return w

    def _check(self, w: _Waiter) -> None:
        if w.status != e.IBV_WC_SUCCESS:
            if w.status == -1:
                raise ShardUnavailable(str(self.error or "the queue pair was closed"))
            err = ShardUnavailable(f"work request failed: status {w.status} ({_wc_name(w.status)}), vendor error {w.vendor_err}")
            self._fail(err)
            raise err

    async def send_frame(self, parts: list[bytes | memoryview]) -> None:
        """SEND one control frame from a send slot and wait for its completion."""
        data = b"".join(parts)
        if len(data) > SLOT_SIZE:
            raise BadRequest(f"control frame of {len(data)} bytes exceeds the {SLOT_SIZE}-byte slot")
        await self._send_slots.acquire()
        slot = self._send_free.pop()
        try:
            off = slot * SLOT_SIZE
            self.send_view[off : off + len(data)] = data
            async with self._wr_slot():
                w = self._post_one(e.IBV_WR_SEND, self.send_mr.buf + off, len(data), self.send_mr.lkey)
                await w.done.wait()
            self._check(w)
        finally:
            self._send_free.append(slot)
            self._send_slots.release()

    @contextlib.asynccontextmanager
    async def _wr_slot(self) -> AsyncIterator[None]:
        await self._wr_slots.acquire()
        try:
            yield
        finally:
            self._wr_slots.release()

    def close(self) -> None:
        """Destroy the QP, CQ, channel and slot buffers (children first). Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._fail(ShardUnavailable("the queue pair was closed"))
        self.qp.close()
        self.recv_mr.close()
        self.send_mr.close()
        self.cq.close()
        self.channel.close()


def _wc_name(status: int) -> str:
    for name in dir(e):
        if name.startswith("IBV_WC_") and getattr(e, name) == status and "SUCCESS" not in name:
            return name
    return "unknown"


class _Pool:
    """Registered buffers, allocated once and lent out per request."""

    def __init__(self, dev: VerbsDevice, count: int, size: int) -> None:
        self.size = size
        self.stride = size + 64  # room after each buffer for an 8-byte version read
        self.mr = dev.register(count * self.stride, e.IBV_ACCESS_LOCAL_WRITE, "client buffer pool")
        self.view = view_of(self.mr)
        self._free = list(range(count))
        self._sem = trio.Semaphore(count)

    @contextlib.asynccontextmanager
    async def buffer(self) -> AsyncIterator[int]:
        await self._sem.acquire()
        i = self._free.pop()
        try:
            yield i * self.stride
        finally:
            self._free.append(i)
            self._sem.release()


class VerbsConnection(ShardConnection):
    """A client's verbs connection to one shard. Create with :meth:`VerbsTransport.connect`."""

    def __init__(self, sock: Any, address: str, hello: P.HelloReply, dev: VerbsDevice, nursery: trio.Nursery) -> None:
        self._sock = sock
        self.address = address
        self.dev = dev
        self._ep = Endpoint(dev, self._on_recv)
        self._pool = _Pool(dev, POOL_BUFFERS, POOL_BUFFER_SIZE)
        self.info = ShardInfo(hello.shard_id, hello.capacity, min(hello.max_payload, POOL_BUFFER_SIZE), hello.incarnation)
        self._pending: dict[int, tuple[trio.Event, list[P.Reply]]] = {}
        self._ids = itertools.count(1)
        self._locs: dict[tuple[int, int], P.LocateReply] = {}
        self._nursery = nursery
        self.remote: P.VerbsConnectReply | None = None
        self._credits = trio.Semaphore(RECV_SLOTS)
        self._staging_free: list[int] = []
        self._staging_sem = trio.Semaphore(0)
        self._closed = False

    async def _setup(self) -> None:
        qpn, psn, gid = self._ep.local_info()
        await send_parts(self._sock, P.encode_request(P.VerbsConnect(qpn, psn, gid), 1))
        dec = P.FrameDecoder(max_body=1 << 16)
        while (frame := dec.next_frame()) is None:
            data = await self._sock.recv(65536)
            if not data:
                raise ShardUnavailable(f"shard at {self.address} closed the connection during VERBS_CONNECT")
            dec.feed(data)
        reply = P.decode_reply(frame)
        if isinstance(reply, P.ErrorReply):
            raise TransportUnavailable(f"shard at {self.address} cannot serve verbs: {reply.message}",
                                       "start the shard with --transport verbs, or use --transport tcp")
        assert isinstance(reply, P.VerbsConnectReply)
        self._ep.connect(reply.qp_num, reply.psn, reply.gid)
        self.remote = reply
        self._credits = trio.Semaphore(min(RECV_SLOTS, reply.recv_slots))
        n_staging = reply.staging_len // POOL_BUFFER_SIZE
        self._staging_free = [i * POOL_BUFFER_SIZE for i in range(n_staging)]
        self._staging_sem = trio.Semaphore(n_staging)
        self._nursery.start_soon(self._run, name=f"irdma-verbs-poller {self.address}")

    async def _run(self) -> None:
        # The poller lives in the client's nursery; the TCP control socket is watched too, so
        # a shard that goes away fails every pending call.
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._ep.poll_forever)
                buf = bytearray(1)
                try:
                    await recv_exactly(self._sock, memoryview(buf))
                except (OSError, IrdmaError, trio.ClosedResourceError):
                    pass
                self._ep._fail(ShardUnavailable(f"shard at {self.address} closed the control connection"))
                self._fail_pending()
                n.cancel_scope.cancel()
        finally:
            self._fail_pending()
            self._close_resources()

    def _on_recv(self, slot: int, length: int) -> None:
        off = slot * SLOT_SIZE
        raw = bytes(self._ep.recv_view[off : off + length])
        self._ep.repost(slot)
        try:
            frame = P.parse_header(raw, SLOT_SIZE)
            frame.body = memoryview(raw)[P.HEADER_SIZE : P.HEADER_SIZE + frame.body_len]
            reply = P.decode_reply(frame)
        except IrdmaError as exc:
            self._ep._fail(ShardUnavailable(f"bad reply from shard at {self.address}: {exc}"))
            self._fail_pending()
            return
        pend = self._pending.pop(frame.request_id, None)
        if pend is not None:
            pend[1].append(reply)
            pend[0].set()

    def _fail_pending(self) -> None:
        for ev, _ in self._pending.values():
            ev.set()
        self._pending.clear()

    async def _rpc(self, msg: P.Request) -> P.Reply:
        if self._ep.error is not None:
            raise ShardUnavailable(str(self._ep.error))
        async with self._credits:
            rid = next(self._ids) & 0xFFFFFFFF
            ev, box = trio.Event(), []  # type: ignore[var-annotated]
            self._pending[rid] = (ev, box)
            try:
                await self._ep.send_frame(P.encode_request(msg, rid))
                await ev.wait()
            finally:
                self._pending.pop(rid, None)
        if not box:
            raise ShardUnavailable(str(self._ep.error or f"connection to shard at {self.address} failed"))
        reply = box[0]
        raise_for_error(reply, self.address)
        return reply

    async def _locate(self, file_id: int, chunk_index: int, create_size: int) -> P.LocateReply | None:
        loc = self._locs.get((file_id, chunk_index))
        if loc is None:
            reply = await self._rpc(P.Locate(file_id, chunk_index, create_size))
            assert isinstance(reply, P.LocateReply)
            if not reply.exists:
                return None
            loc = self._locs[(file_id, chunk_index)] = reply
        if create_size and loc.chunk_size != create_size:
            raise BadRequest(f"chunk ({file_id}, {chunk_index}) has size {loc.chunk_size}, request says {create_size}")
        return loc

    def forget_file(self, file_id: int) -> None:
        for key in [k for k in self._locs if k[0] == file_id]:
            del self._locs[key]

    # ------------------------------------------------------------ the data path
    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview) -> int:
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
            async with pool.buffer() as boff:
                laddr = pool.mr.buf + boff
                wrs = []
                if start == 0:  # the version first: it is at most the version of the bytes read
                    wrs.append((e.IBV_WR_RDMA_READ, laddr + pool.size, 8, pool.mr.lkey,
                                r.versions_addr + 8 * loc.version_slot, r.versions_rkey))
                wrs.append((e.IBV_WR_RDMA_READ, laddr, n, pool.mr.lkey,
                            r.region_addr + loc.region_offset + offset + start, r.region_rkey))
                await self._ep.post(wrs)
                if start == 0:
                    version = int.from_bytes(pool.view[boff + pool.size : boff + pool.size + 8], "little")
                into[start : start + n] = pool.view[boff : boff + n]
        return version

    async def write(
        self,
        file_id: int,
        chunk_index: int,
        chunk_size: int,
        offset: int,
        op: UpdateOp,
        data: memoryview | bytes,
        existing: bool = False,
    ) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if offset < 0 or offset + n > chunk_size:
            raise BadRequest(f"range [{offset}, {offset + n}) leaves the {chunk_size}-byte chunk")
        if n > self._pool.size:
            version = 0
            for start in range(0, n, self._pool.size):
                version = await self.write(file_id, chunk_index, chunk_size, offset + start, op,
                                           view[start : start + self._pool.size], existing or start > 0)
            return version
        assert self.remote is not None
        r = self.remote
        pool = self._pool
        if op == UpdateOp.ASSIGN:
            loc = await self._locate(file_id, chunk_index, 0 if existing else chunk_size)
            if loc is None:
                raise DataLost(f"shard at {self.address}: chunk ({file_id}, {chunk_index}) is gone")
            if loc.chunk_size != chunk_size:
                raise BadRequest(f"chunk ({file_id}, {chunk_index}) has size {loc.chunk_size}, request says {chunk_size}")
            async with pool.buffer() as boff:
                pool.view[boff : boff + n] = view
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ep.post, [(e.IBV_WR_RDMA_WRITE, pool.mr.buf + boff, n, pool.mr.lkey,
                                                        r.region_addr + loc.region_offset + offset, r.region_rkey)])
                    box: list[P.Reply] = []

                    async def commit() -> None:
                        box.append(await self._rpc(P.RemoteWrite(file_id, chunk_index, chunk_size, offset, op, True, n,
                                                                 0, loc.region_offset)))

                    nursery.start_soon(commit)
            reply = box[0]
        else:
            await self._staging_sem.acquire()
            soff = self._staging_free.pop()
            try:
                async with pool.buffer() as boff:
                    pool.view[boff : boff + n] = view
                    await self._ep.post([(e.IBV_WR_RDMA_WRITE, pool.mr.buf + boff, n, pool.mr.lkey,
                                          r.staging_addr + soff, r.staging_rkey)])
                reply = await self._rpc(P.RemoteWrite(file_id, chunk_index, chunk_size, offset, op, False, n, soff,
                                                      existing=existing))
            finally:
                self._staging_free.append(soff)
                self._staging_sem.release()
        assert isinstance(reply, P.VersionReply)
        return reply.version

    async def stat(self) -> StatReply:
        reply = await self._rpc(P.Stat())
        assert isinstance(reply, StatReply)
        return reply

    async def free(self, file_id: int, first_chunk: int) -> int:
        for key in [k for k in self._locs if k[0] == file_id and k[1] >= first_chunk]:
            del self._locs[key]
        reply = await self._rpc(P.Free(file_id, first_chunk))
        assert isinstance(reply, P.FreeReply)
        return reply.freed

    async def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        if offset == 0:
            self._locs.pop((file_id, chunk_index), None)
        reply = await self._rpc(P.Punch(file_id, chunk_index, offset))
        assert isinstance(reply, P.VersionReply)
        return reply.version

    async def list_chunks(self, after_file: int = 0, after_chunk: int = 0) -> list[ChunkEntry]:
        reply = await self._rpc(P.List(after_file, after_chunk))
        assert isinstance(reply, P.ListReply)
        return reply.entries

    async def aclose(self) -> None:
        if not self._closed:
            self._ep._fail(ShardUnavailable(f"connection to shard at {self.address} was closed"))
            self._fail_pending()
            self._sock.close()  # the poller task sees it and releases the verbs resources

    def _close_resources(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        self._ep.close()
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
        self, address: str, nursery: trio.Nursery, *, client_name: str = "", credentials: bytes = b"",
        timeout: float = 10.0,
    ) -> VerbsConnection:
        host, port = parse_address(address)
        sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        try:
            await sock.connect((host, port))
            tune_socket(sock)
            hello = await handshake(sock, address, client_name, credentials)
            conn = VerbsConnection(sock, address, hello, self.device, nursery)
        except OSError as exc:
            sock.close()
            raise ShardUnavailable(f"cannot connect to shard at {address}: {exc.strerror or exc}",
                                   "is the shard running? `irdma shard list` shows its state") from None
        except BaseException:
            sock.close()
            raise
        try:
            await conn._setup()
        except BaseException:
            conn._close_resources()
            raise
        return conn
