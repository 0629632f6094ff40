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
* STAT, FREE, PUNCH, LIST and LOCATE: protocol frames carried in ``SEND``/``RECV`` messages.

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

References: iRDMA (HPCC 2017) for one-sided pulls; ``ibv_post_send(3)``, ``ibv_req_notify_cq(3)``
and ``ibv_get_cq_event(3)`` for the verbs used.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import itertools
import logging
import os
import random
import resource
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import trio

from irdma._errors import BadRequest, DataLost, IrdmaError, ShardUnavailable, TransportUnavailable
from irdma.wire import protocol as P
from irdma.wire.auth import AuthFailed, KeyRing
from irdma.wire.extents import move, positions
from irdma.wire.framing import Macs, handshake, read_frame, recv_exactly, send_parts, tune_socket
from irdma.wire.protocol import ChunkEntry, StatReply, UpdateOp, raise_for_error

from ..units import parse_address
from .base import ShardConnection, ShardInfo, Transport

# pyverbs.base calls logging.basicConfig(level=INFO) when imported: that would configure the
# application's root logger behind its back (every INFO line of every library on stderr, as
# "[INFO] ... transport auto: picked tcp" at each irdma.connect). Undo it: the root logger is
# the application's to configure.
_root = logging.getLogger()
_root_state = (list(_root.handlers), _root.level)
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

_root.handlers[:], _root.level = _root_state[0], _root_state[1]
del _root, _root_state

REMOTE_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
LOCAL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE  # memory no peer may reach (a shard's own registration)
SEND_DEPTH = 128  # work requests in flight per queue pair
RECV_SLOTS = 32  # requests a peer may have outstanding (credits)
SLOT_SIZE = 8192  # largest control frame carried by SEND, bytes
POOL_BUFFERS = 8  # registered client buffers
POOL_BUFFER_SIZE = 4 << 20  # bytes each; also the largest piece a request moves
STAGING_SLOTS = 4  # staging buffers per connection on the shard, POOL_BUFFER_SIZE each
CONNECT_TIMEOUT = 10.0  # seconds for TCP connect, HELLO and VERBS_CONNECT together
RELEASE_TIMEOUT = 10.0  # seconds aclose waits for the poller to release the verbs resources
_RECV_BIT = 1 << 62
#: RDMA READs of one gather batch (at most half the send queue, so two batches fit in flight).
GATHER_WRS = SEND_DEPTH // 2
#: Extents of one staged SCATTER: its control frame (16 bytes each) must fit a SEND slot.
SCATTER_EXTENTS = 384
_R = TypeVar("_R")


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

    def register(self, length: int, access: int, what: str, keep: bool = True, address: int | None = None) -> MR:
        """Allocate and register ``length`` bytes (or register the memory at ``address``).

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
            mr = MR(self.pd, length, access) if address is None else MR(self.pd, length, access, address=address)
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


Wr = tuple[int, int, int, int, int, int]  # (opcode, local address, length, lkey, remote address, rkey)


class _Lender:
    """A fixed set of numbered resources (send-queue slots, SEND slots, pool buffers, credits,
    staging slots), lent first come first served.

    What a call takes goes back with :meth:`give`, called by whoever sees the completion or the
    reply that frees it: never by a cancelled call that posted work using it. After
    :meth:`close` every waiting and later :meth:`take` raises ShardUnavailable, and what was
    lent at that moment is never lent again (the device may have been using it).
    """

    def __init__(self, items: Iterable[int], what: str) -> None:
        self._free = list(items)
        self.size = len(self._free)
        self.what = what
        self._sem = trio.Semaphore(self.size)
        self._many = trio.Lock()
        self.error: IrdmaError | None = None

    @property
    def available(self) -> int:
        """How many are free now."""
        return len(self._free)

    async def take(self) -> int:
        """Wait for one and take it. Cancelled while waiting: nothing was taken.

        Raises:
            ShardUnavailable: the lender was closed (the connection broke).
        """
        await self._sem.acquire()  # atomic: cancelled before it took one, or took one and returns
        if self.error is not None:
            self._sem.release()  # wake the next waiter: it fails the same way
            raise ShardUnavailable(str(self.error))
        return self._free.pop()

    async def take_many(self, n: int) -> list[int]:
        """Take ``n`` at once: one caller at a time gathers, so two callers never each hold part
        of what both need. Cancelled: nothing was taken.

        Raises:
            ShardUnavailable: the lender was closed.
        """
        assert n <= self.size, f"{n} {self.what}s asked of {self.size}"
        taken: list[int] = []
        try:
            async with self._many:
                for _ in range(n):
                    taken.append(await self.take())
        except BaseException:
            for item in taken:
                self.give(item)
            raise
        return taken

    def give(self, item: int) -> None:
        """Give one back (ignored once closed: it stays lent forever)."""
        if self.error is None:
            self._free.append(item)
            self._sem.release()

    def close(self, err: IrdmaError) -> None:
        """Fail every waiting and later :meth:`take` with ``err``. Safe twice."""
        if self.error is None:
            self.error = err
            self._sem.release()


class _Hold:
    """A pool buffer lent to one call and to the work requests it posted: it goes back to the
    pool when the call and every one of them are done with it (a reference count)."""

    def __init__(self, lender: _Lender, index: int, offset: int) -> None:
        self._lender, self._index, self.offset = lender, index, offset
        self.refs = 1  # the call's own

    def drop(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self._lender.give(self._index)


@dataclass
class _Waiter:
    done: trio.Event
    status: int = 0
    release: Callable[[], None] | None = None  # gives back what the work request used (on success)


class Endpoint:
    """One RC queue pair with its CQ, completion channel, and SEND/RECV slots for control frames.

    ``on_recv(slot, length)`` is called from the poller for each message received; the slot's
    bytes are ``recv_view[slot * SLOT_SIZE : slot * SLOT_SIZE + length]``, and the caller
    gives the slot back with :meth:`repost`. ``on_fail(error)`` is called once when the queue
    pair is declared broken (:meth:`fail`).

    Every resource a work request uses (its send-queue slot, its SEND slot, a registered
    buffer) is given back only when its completion arrives; when the queue pair breaks,
    nothing lent is given back and every waiter fails.
    """

    def __init__(
        self, dev: VerbsDevice, on_recv: Callable[[int, int], None],
        on_fail: Callable[[IrdmaError], None] | None = None,
    ) -> None:
        self.dev = dev
        self._on_recv = on_recv
        self._on_fail = on_fail
        self._closed = False
        self.error: IrdmaError | None = None
        self.channel, self.channel_fd = _open_comp_channel(dev.ctx)
        made: list[Any] = [self.channel]
        try:
            self.cq = CQ(dev.ctx, SEND_DEPTH + RECV_SLOTS + 16, None, self.channel, 0)
            made.append(self.cq)
            self.cq.req_notify()
            cap = QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            attr = QPAttr(port_num=1)
            attr.qp_access_flags = REMOTE_ACCESS
            self.qp = QP(dev.pd, init, attr)  # -> INIT
            made.append(self.qp)
            self.recv_mr = MR(dev.pd, RECV_SLOTS * SLOT_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
            made.append(self.recv_mr)
            self.send_mr = MR(dev.pd, RECV_SLOTS * SLOT_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        except PyverbsError as exc:
            for obj in reversed(made):
                obj.close()
            raise TransportUnavailable(f"cannot create a queue pair on RDMA device {dev.name}: {_fix(exc)}") from None
        self.psn = random.randrange(1 << 24)
        self.recv_view = view_of(self.recv_mr)
        self.send_view = view_of(self.send_mr)
        self._send_slots = _Lender(range(RECV_SLOTS), "SEND slot")
        self._wr_slots = _Lender(range(SEND_DEPTH - RECV_SLOTS), "send-queue slot")
        self._waiters: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        for slot in range(RECV_SLOTS):  # before connecting, or the first message meets RNR
            self.repost(slot)

    @property
    def idle(self) -> bool:
        """No work request in flight (every send-queue and SEND slot is back)."""
        return self._wr_slots.available == self._wr_slots.size and self._send_slots.available == self._send_slots.size

    def repost(self, slot: int) -> None:
        if self.error is not None:
            return
        sge = SGE(self.recv_mr.buf + slot * SLOT_SIZE, SLOT_SIZE, self.recv_mr.lkey)
        try:
            self.qp.post_recv(RecvWR(wr_id=_RECV_BIT | slot, num_sge=1, sg=[sge]))
        except PyverbsRDMAError as exc:
            self.fail(ShardUnavailable(f"the device refused a receive: {_fix(exc)}"))

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
        """Dispatch completions until cancelled or the queue pair breaks; sleeps on the
        completion channel's fd."""
        try:
            while self.error is None:
                self._drain()
                await trio.lowlevel.wait_readable(self.channel_fd)
                self.channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
                self.cq.req_notify()  # then drain again: nothing that arrived in between is lost
        except (PyverbsError, OSError) as exc:
            self.fail(ShardUnavailable(f"polling the completion queue failed: {_fix(exc)}"))
        finally:
            self.fail(ShardUnavailable("the queue pair was closed"))

    def _drain(self) -> None:
        while self.error is None:
            n, wcs = self.cq.poll(32)
            if not n:
                return
            for wc in wcs:
                if self.error is not None:
                    return  # what is left was flushed with the queue pair
                if wc.status != e.IBV_WC_SUCCESS:
                    # an RC queue pair in error flushes everything after: it is broken
                    what = "receive" if wc.wr_id & _RECV_BIT else "work request"
                    self.fail(ShardUnavailable(f"{what} failed: status {wc.status} ({_wc_name(wc.status)}),"
                                               f" vendor error {wc.vendor_err}"))
                    return
                if wc.wr_id & _RECV_BIT:
                    self._on_recv(wc.wr_id & ~_RECV_BIT, wc.byte_len)
                    continue
                w = self._waiters.pop(wc.wr_id, None)
                if w is not None:
                    if w.release is not None:
                        w.release()
                    w.done.set()

    def fail(self, err: IrdmaError) -> None:
        """Declare the queue pair broken: destroy it (the device stops touching registered
        memory), fail every waiter and every wait for a slot, and tell ``on_fail``. What was
        lent to work in flight is never given back. Safe twice."""
        if self.error is not None:
            return
        self.error = err
        with contextlib.suppress(PyverbsError):
            self.qp.close()
        self._wr_slots.close(err)
        self._send_slots.close(err)
        waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            w.status = -1
            w.done.set()
        if self._on_fail is not None:
            self._on_fail(err)

    # ------------------------------------------------------------ posting
    async def post(self, wrs: list[Wr], frame: list[bytes | memoryview] | None = None,
                   hold: _Hold | None = None) -> list[_Waiter]:
        """Post RDMA work requests and then, behind them, ``frame`` as a SEND; returns their
        waiters (see :meth:`wait`).

        Each entry of ``wrs`` is ``(opcode, local_addr, length, lkey, remote_addr, rkey)``;
        pieces longer than the device's ``max_msg_sz`` are split. Every slot needed is taken
        first (cancelled then: nothing was posted), then everything is posted with no
        checkpoint in between, in order (an RC queue pair executes it in that order). Each
        slot goes back when its completion arrives; ``hold`` (the pool buffer ``wrs`` use) is
        dropped once when all of ``wrs`` have completed.

        Raises:
            BadRequest: ``frame`` is larger than a SEND slot.
            ShardUnavailable: the queue pair is broken, or the device refused a work request
                (which breaks it).
        """
        if self.error is not None:
            raise ShardUnavailable(str(self.error))
        data = b"".join(frame) if frame is not None else None
        if data is not None and len(data) > SLOT_SIZE:
            raise BadRequest(f"control frame of {len(data)} bytes exceeds the {SLOT_SIZE}-byte slot")
        split: list[Wr] = []
        for op, laddr, n, lkey, raddr, rkey in wrs:
            for k in range(0, n, self.dev.max_msg):
                split.append((op, laddr + k, min(self.dev.max_msg, n - k), lkey, raddr + k, rkey))
        slots = await self._wr_slots.take_many(len(split) + (data is not None))
        send_slot = -1
        if data is not None:
            try:
                send_slot = await self._send_slots.take()
            except BaseException:
                for s in slots:
                    self._wr_slots.give(s)
                raise
        # ---- no checkpoint from here on: all of it is posted, or the queue pair breaks
        left = len(split)

        def rdma_done(slot: int) -> Callable[[], None]:
            def release() -> None:
                nonlocal left
                self._wr_slots.give(slot)
                left -= 1
                if left == 0 and hold is not None:
                    hold.drop()
            return release

        if split and hold is not None:
            hold.refs += 1
        waiters = [self._post_one(wr, rdma_done(slot)) for wr, slot in zip(split, slots[: len(split)], strict=True)]
        if data is not None:
            off = send_slot * SLOT_SIZE
            self.send_view[off : off + len(data)] = data
            wr_slot = slots[-1]

            def send_done() -> None:
                self._wr_slots.give(wr_slot)
                self._send_slots.give(send_slot)

            waiters.append(self._post_one((e.IBV_WR_SEND, self.send_mr.buf + off, len(data), self.send_mr.lkey, 0, 0),
                                          send_done))
        return waiters

    def _post_one(self, wr: Wr, release: Callable[[], None]) -> _Waiter:
        op, laddr, n, lkey, raddr, rkey = wr
        if self.error is not None:
            raise ShardUnavailable(str(self.error))
        wr_id = next(self._ids)
        swr = SendWR(wr_id=wr_id, opcode=op, num_sge=1, sg=[SGE(laddr, n, lkey)], send_flags=e.IBV_SEND_SIGNALED)
        if op != e.IBV_WR_SEND:
            swr.set_wr_rdma(rkey, raddr)
        w = _Waiter(trio.Event(), release=release)
        self._waiters[wr_id] = w
        try:
            self.qp.post_send(swr)
        except PyverbsError as exc:
            del self._waiters[wr_id]
            err = ShardUnavailable(f"the device refused a work request: opcode {op}, {n} bytes: {_fix(exc)}")
            self.fail(err)  # what was posted before it may be in flight: nothing is reused
            raise err from None
        return w

    async def wait(self, waiters: list[_Waiter]) -> None:
        """Wait for the completions of ``waiters``. Cancelled: the work goes on, and what it
        uses goes back when it completes.

        Raises:
            ShardUnavailable: a work request failed or the queue pair broke meanwhile (then
                registered memory may be gone: the caller must not touch it).
        """
        for w in waiters:
            await w.done.wait()
        if self.error is not None or any(w.status != e.IBV_WC_SUCCESS for w in waiters):
            raise ShardUnavailable(str(self.error or "a work request failed"))

    async def send_frame(self, parts: list[bytes | memoryview]) -> None:
        """SEND one control frame from a SEND slot and wait for its completion.

        Raises:
            BadRequest: the frame is larger than a SEND slot.
            ShardUnavailable: the queue pair is broken.
        """
        await self.wait(await self.post([], parts))

    def close(self) -> None:
        """Destroy the QP, CQ, channel and slot buffers (children first). Safe twice; call it
        from trio (the channel's fd is announced closed first)."""
        if self._closed:
            return
        self._closed = True
        self.fail(ShardUnavailable("the queue pair was closed"))
        self.qp.close()
        self.recv_mr.close()
        self.send_mr.close()
        self.cq.close()
        trio.lowlevel.notify_closing(self.channel_fd)
        self.channel.close()


def _wc_name(status: int) -> str:
    for name in dir(e):
        if name.startswith("IBV_WC_") and getattr(e, name) == status and "SUCCESS" not in name:
            return name
    return "unknown"


class _Pool:
    """Registered client buffers, allocated once and lent per request (see :class:`_Hold`)."""

    def __init__(self, dev: VerbsDevice, count: int, size: int) -> None:
        self.size = size
        self.stride = size + 64  # room after each buffer for an 8-byte version read
        self.mr = dev.register(count * self.stride, e.IBV_ACCESS_LOCAL_WRITE, "client buffer pool", keep=False)
        self.view = view_of(self.mr)
        self.lender = _Lender(range(count), "client buffer")

    async def take(self) -> _Hold:
        i = await self.lender.take()
        return _Hold(self.lender, i, i * self.stride)


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
            raise ShardUnavailable(str(self._ep.error))

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

    async def _rpc(self, msg: P.Request, wrs: list[Wr] | None = None, hold: _Hold | None = None,
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
            raise ShardUnavailable(str(self._ep.error or f"connection to shard at {self.address} failed"))
        raise_for_error(call.reply, self.address)
        return call.reply

    def _expect(self, reply: P.Reply, kind: type[_R], msg: P.Request | type[P.Request]) -> _R:
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
        however a retry groups the chunks, and the shard applies each exactly once."""
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        chunk = extents["chunk"].astype(np.int64)
        length = extents["length"].astype(np.int64)
        pos = positions(length)
        if pos[-1] != len(src):
            raise BadRequest(f"a scatter of {len(src)} bytes into extents of {pos[-1]}")
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

    async def stat(self) -> StatReply:
        msg = P.Stat()
        return self._expect(await self._rpc(msg), StatReply, msg)

    async def free(self, file_id: int, first_chunk: int) -> int:
        for key in [k for k in self._locs if k[0] == file_id and k[1] >= first_chunk]:
            del self._locs[key]
        msg = P.Free(file_id, first_chunk)
        return self._expect(await self._rpc(msg), P.FreeReply, msg).freed

    async def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        if offset == 0:
            self._locs.pop((file_id, chunk_index), None)
        msg = P.Punch(file_id, chunk_index, offset)
        return self._expect(await self._rpc(msg), P.VersionReply, msg).version

    async def sync(self) -> None:
        msg = P.Sync()
        self._expect(await self._rpc(msg), P.VersionReply, msg)

    async def resync(self, file_id: int, chunk_index: int, chunk_size: int, chain: P.Chain) -> int:
        msg = P.Resync(file_id, chunk_index, chunk_size, chain)
        return self._expect(await self._rpc(msg), P.VersionReply, msg).version

    async def checksum(self, file_id: int, chunk_index: int, view: int = 0) -> tuple[int, int]:
        msg = P.Checksum(file_id, chunk_index, view)
        reply = self._expect(await self._rpc(msg), P.ChecksumReply, msg)
        return reply.version, reply.crc

    async def freeze(self, token: int, lease_ms: int, file_ids: Sequence[int]) -> P.FreezeReply:
        msg = P.Freeze(token, lease_ms, tuple(file_ids))
        return self._expect(await self._rpc(msg), P.FreezeReply, msg)

    async def admit(self, token: int, push_ids: Sequence[int], wait_ms: int = 0) -> P.FreezeReply:
        msg = P.Admit(token, wait_ms, tuple(push_ids))
        return self._expect(await self._rpc(msg), P.FreezeReply, msg)

    async def clone(self, token: int, pairs: Sequence[tuple[int, int]],
                    expect: Sequence[tuple[int, int, int]]) -> int:
        msg = P.Clone(token, tuple(pairs), tuple(expect))
        return self._expect(await self._rpc(msg), P.FreeReply, msg).freed

    async def usage(self, file_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        msg = P.Usage(tuple(file_ids))
        return self._expect(await self._rpc(msg), P.UsageReply, msg).entries

    async def free_files(self, file_ids: Sequence[int]) -> int:
        msg = P.FreeFiles(tuple(file_ids))
        return self._expect(await self._rpc(msg), P.FreeReply, msg).freed

    async def thaw(self, token: int) -> None:
        msg = P.Thaw(token)
        self._expect(await self._rpc(msg), P.VersionReply, msg)

    async def list_chunks(self, after_file: int = 0, after_chunk: int = 0) -> list[ChunkEntry]:
        msg = P.List(after_file, after_chunk)
        return self._expect(await self._rpc(msg), P.ListReply, msg).entries

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
