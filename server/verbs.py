"""The shard side of the verbs transport.

The shard registers its memory region and its version table once, at start, for local access
only: no peer can reach that registration. Each client that sends VERBS_CONNECT (on its TCP
control connection, after the handshake proved the cluster key) gets a queue pair of its own,
a staging buffer, and registrations of the region and of the version table of its own (the
same memory registered again: rkeys of its own); the shard answers with their descriptors
(address, length, rkey). When the client's control connection ends, its registrations are
deregistered, so its rkeys stop working (the device refuses them) even if it kept them. Pulls are then one-sided RDMA READs the shard never sees;
control frames (LOCATE, REMOTE_WRITE, STAT, FREE, PUNCH) arrive as SENDs and are answered with
SENDs. See :mod:`irdma.transport.verbs` for the whole picture.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

import trio

from irdma._errors import IrdmaError, ShardUnavailable
from irdma.transport.verbs_device import LOCAL_ACCESS, REMOTE_ACCESS, VerbsDevice, view_of
from irdma.transport.verbs_endpoint import RECV_SLOTS, SLOT_SIZE, Endpoint
from irdma.transport.verbs_lending import POOL_BUFFER_SIZE, STAGING_SLOTS
from irdma.wire import protocol as P

from .dispatch import ThreadWork
from .shard import PAGE, Region, Shard
from .store import ShardStore, address_of

if TYPE_CHECKING:
    from .serve import ShardServer

log = logging.getLogger("irdma.server")


class VerbsShard:
    """A shard whose region and version table are registered with an RDMA device.

    Args:
        shard_id: the shard's id.
        capacity: bytes of the region, a multiple of 4096.
        device: RDMA device name (default: the first one).

    Raises:
        TransportUnavailable: no device, the memlock limit is too low, or the device refused
            the registration (the message says which and what to do).
    """

    def __init__(self, shard_id: int, capacity: int, device: str | None = None, store: ShardStore | None = None) -> None:
        self.dev = VerbsDevice(device)
        if store is None:
            self.region_mr = self.dev.register(capacity, LOCAL_ACCESS, "shard memory region")
            self.versions_mr = self.dev.register(8 * (capacity // PAGE), LOCAL_ACCESS, "chunk version table")
        else:  # the data directory's mappings, registered where they are
            store.punch = False  # see ShardStore.punch
            self.region_mr = self.dev.register(capacity, LOCAL_ACCESS, "shard memory region",
                                               address=address_of(store.region))
            self.versions_mr = self.dev.register(8 * (capacity // PAGE), LOCAL_ACCESS, "chunk version table",
                                                 address=address_of(store.versions))
        self.shard = Shard(shard_id, Region(capacity, buffer=view_of(self.region_mr)), versions=view_of(self.versions_mr),
                           store=store)
        log.info("shard %d: %d bytes registered on RDMA device %s (local access; each client gets its own rkeys)",
                 shard_id, capacity, self.dev.name)

    async def serve_connection(
        self, request: P.VerbsConnect, server: ShardServer, reply_box: list[P.Reply], ready: trio.Event
    ) -> None:
        """Make a queue pair for one client, put the reply in ``reply_box``, set ``ready``, and
        serve the client's SENDs until cancelled (when its TCP control connection closes)."""
        staging_mr = None
        windows: list[Any] = []  # this client's registrations of the region and version table
        ep = None
        try:
            for mr, what in ((self.region_mr, "memory region"), (self.versions_mr, "chunk version table")):
                # a page walk of the whole region: off the event loop, which serves the others
                windows.append(await trio.to_thread.run_sync(functools.partial(
                    self.dev.register, mr.length, REMOTE_ACCESS, f"a client's view of the shard's {what}",
                    keep=False, address=mr.buf)))
            region, versions = windows
            staging_mr = self.dev.register(STAGING_SLOTS * POOL_BUFFER_SIZE, REMOTE_ACCESS, "staging buffer", keep=False)
            staging = view_of(staging_mr)
            send_in, recv_out = trio.open_memory_channel[tuple[int, int]](RECV_SLOTS)

            def on_recv(slot: int, length: int) -> None:
                send_in.send_nowait((slot, length))  # at most RECV_SLOTS are posted: never full

            # a broken queue pair ends the loop below even when no request is waiting
            ep = Endpoint(self.dev, on_recv, on_fail=lambda err: send_in.close())
            ep.connect(request.qp_num, request.psn, request.gid)
            qpn, psn, gid = ep.local_info()
            reply_box.append(
                P.VerbsConnectReply(
                    qpn, psn, gid,
                    region.buf, region.length, region.rkey,
                    versions.buf, versions.rkey,
                    staging_mr.buf, staging_mr.length, staging_mr.rkey,
                    RECV_SLOTS, SLOT_SIZE,
                )
            )
        except BaseException as exc:  # cancelled too: nothing made here may outlive the setup
            if staging_mr is not None:
                staging_mr.close()
            if ep is not None:
                ep.close()
            for mr in windows:
                mr.close()
            if not isinstance(exc, Exception):
                raise
            if not isinstance(exc, IrdmaError):  # a bug: this client is told, the shard goes on
                log.error("setting up a verbs connection failed", exc_info=exc)
            reply_box.append(P.ErrorReply(P.Status.INTERNAL, str(exc)))
            ready.set()
            return
        ready.set()
        try:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ep.poll_forever)
                    await self._serve_requests(ep, server, staging, recv_out)
                    nursery.cancel_scope.cancel()
            except* IrdmaError as group:  # the queue pair broke: this connection ends, the shard goes on
                log.warning("verbs connection ended: %s", group.exceptions[0])
        finally:
            ep.close()
            staging_mr.close()
            for mr in windows:  # its rkeys end with its connection
                mr.close()

    @staticmethod
    async def _serve_requests(ep: Endpoint, server: ShardServer, staging: memoryview,
                              recv_out: trio.MemoryReceiveChannel[tuple[int, int]]) -> None:
        """Apply each request in the order it arrived, until the queue pair breaks; answer it
        at once, or once its replication chain has it."""
        async with trio.open_nursery() as later:
            await VerbsShard._serve_in_order(ep, server, staging, recv_out, later)
            later.cancel_scope.cancel()

    @staticmethod
    async def _serve_in_order(ep: Endpoint, server: ShardServer, staging: memoryview,
                              recv_out: trio.MemoryReceiveChannel[tuple[int, int]], later: trio.Nursery) -> None:
        async def reply_later(opcode: int, request_id: int, reply: Any) -> None:
            out = await reply
            with contextlib.suppress(IrdmaError):  # a broken queue pair ends the loop anyway
                await ep.send_frame(P.encode_reply(opcode, request_id, out))

        async for slot, length in recv_out:
            off = slot * SLOT_SIZE
            raw = bytes(ep.recv_view[off : off + length])
            ep.repost(slot)
            reply: Any
            try:
                frame = P.parse_header(raw, SLOT_SIZE)
                frame.body = memoryview(raw)[P.HEADER_SIZE : P.HEADER_SIZE + frame.body_len]
                if frame.opcode in (P.Opcode.READ, P.Opcode.GATHER):  # reads go one-sided: refused unread
                    reply = P.ErrorReply(P.Status.BAD_REQUEST, "READ and GATHER over SEND are not served: use RDMA READ")
                else:
                    reply = server.handle(frame, staging, transport="verbs")
            except IrdmaError as exc:
                log.warning("verbs client sent a bad frame: %s", exc)
                reply = P.ErrorReply(P.Status.BAD_FRAME, str(exc))
                frame = P.Frame(0, 0, 0, 0)
            while isinstance(reply, ThreadWork):  # SYNC, a new chunk: disk I/O in a worker thread, as over TCP
                reply = await reply
            if inspect.isawaitable(reply):
                later.start_soon(reply_later, frame.opcode, frame.request_id, reply)
                continue
            try:
                await ep.send_frame(P.encode_reply(frame.opcode, frame.request_id, reply))
            except ShardUnavailable as exc:  # the client closed its queue pair while we answered
                log.info("verbs connection ended while replying: %s", exc)
                return

    def close(self) -> None:
        self.dev.close()


__all__ = ["VerbsShard"]
