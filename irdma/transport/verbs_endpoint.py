"""One RC queue pair with its completion queue and control-frame slots (verbs client and shard).

:class:`Endpoint` is shared by the client's connection (:mod:`irdma.transport.verbs`) and the
verbs shard (:mod:`irdma.server.verbs`): it connects its queue pair to the peer's, posts RDMA
work requests and SENDs (taking every slot they need first), dispatches completions from the
completion channel's file descriptor, and declares the queue pair broken on any failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from irdma._errors import BadRequest, IrdmaError, ShardUnavailable, TransportUnavailable, message_of

from ._pyverbs import (
    CQ,
    GID,
    MR,
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
)
from .verbs_device import REMOTE_ACCESS, VerbsDevice, _fix, _gid_bytes, _gid_str, view_of
from .verbs_lending import _Hold, _Lender

SEND_DEPTH = 128  # work requests in flight per queue pair
RECV_SLOTS = 32  # requests a peer may have outstanding (credits)
SLOT_SIZE = 8192  # largest control frame carried by SEND, bytes
_RECV_BIT = 1 << 62


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
            raise ShardUnavailable(message_of(self.error))
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
            raise ShardUnavailable(message_of(self.error))
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
            raise ShardUnavailable(message_of(self.error or "a work request failed"))

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
