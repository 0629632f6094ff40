"""TCP transport: the irdma protocol over trio sockets.

Bytes are received with ``recv_into`` straight into the caller's buffer (a pull lands in the
destination array with no intermediate copy) and payloads are sent as views, never joined.
Many requests are pipelined on one connection; replies are matched to requests by
``request_id`` and read by the waiting callers themselves, one at a time (leader/followers).

Cancellation follows the rule of :mod:`irdma.transport.base`: no send is shielded. A call
cancelled while its frame is being sent, while its reply is being received into its buffer,
or while it reads another call's reply, breaks the connection (the socket is closed, every
pending call fails); a call cancelled while it waits for the send lock or for a reply that has
not started had no effect on the stream (a late reply is read into a scratch buffer and
dropped).
"""

from __future__ import annotations

import itertools
import logging
import socket as stdlib_socket
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import trio

from irdma._errors import (
    IrdmaError,
    ShardUnavailable,
    message_of,
)
from irdma.wire import auth
from irdma.wire import protocol as P
from irdma.wire.framing import (  # noqa: F401 - re-exported: the names this module had before irdma.wire.framing
    SOCKET_BUFFER,
    Macs,
    Receiver,
    handshake,
    read_frame,
    recv_exactly,
    send_parts,
    tune_socket,
    write_now,
)
from irdma.wire.protocol import Update, UpdateOp

from ..units import parse_address
from .base import ShardConnection, ShardInfo, Transport

log = logging.getLogger("irdma.transport.tcp")

#: Seconds a TCP connect plus HELLO may take before the shard counts as unreachable.
CONNECT_TIMEOUT = 10.0

#: Seconds without a reply after which :attr:`TcpConnection.broken` asks the socket whether the
#: shard hung up (one system call; a busy connection is not asked).
IDLE_CHECK_S = 1e-3

_R = TypeVar("_R")


#: Turn an error reply into its exception: the one table of :mod:`irdma.wire.protocol`.
raise_for_error = P.raise_for_error


@dataclass
class _Pending:
    opcode: int
    into: memoryview | None = None
    receiving: bool = False  # a reader is filling ``into`` now
    done: bool = False
    reply: P.Reply | None = None
    error: IrdmaError | None = None
    rid: int = 0
    abandoned: bool = False  # its caller returned (cancelled) while the reply was arriving
    task: Any = None  # its caller, parked in :meth:`TcpConnection.finish` while another task reads

    def is_abandoned(self) -> bool:
        return self.abandoned


class TcpConnection(ShardConnection):
    """One pipelined TCP connection to a shard. Create with :meth:`TcpTransport.connect`.

    Replies are read by the callers themselves, leader/follower style (Schmidt et al.,
    "Leader/Followers", PLoP 2000): the first caller waiting in :meth:`finish` reads frames off
    the socket and completes whichever call each answers, until its own reply came; then it
    hands the socket to another waiting caller. A lone request so costs one pass of the
    scheduler (its caller wakes on the socket itself), not the two of a reader task that wakes
    and then reschedules the caller.
    """

    def __init__(self, sock: Any, address: str, info: ShardInfo, nursery: trio.Nursery,
                 macs: Macs | None = None, raw: stdlib_socket.socket | None = None) -> None:
        self._sock = sock
        self._raw = raw  # the stdlib socket under ``sock``, to see that an idle peer hung up
        self._heard = time.monotonic()  # when a frame last arrived
        self._macs = macs
        self._nursery = nursery
        self.address = address
        self.info = info
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._send_lock = trio.Lock()
        self._broken: IrdmaError | None = None
        self._max_body = info.max_payload + P.BODY_SLACK
        self._rx = Receiver(sock)
        self._hdr = bytearray(P.HEADER_SIZE)
        self._fixed = bytearray(P.READ_REPLY_FIXED)
        self._tag = bytearray(macs.trailer if macs is not None else 0)
        self._leading = False  # a caller reads the socket now
        self._arriving: _Pending | None = None  # the call whose reply is being read (out of _pending)
        self._mid_frame = False  # a frame's header was read and the rest of it not yet
        self._followers: dict[int, _Pending] = {}  # callers parked in finish, by request id, oldest first
        # the socket lives as long as the client's nursery: when it is cancelled, this closes it
        # and fails every pending call (no task reads it between requests); it ends with the socket
        self._keeper_scope = trio.CancelScope()
        nursery.start_soon(self._keeper, name=f"irdma-tcp {address}")

    async def _keeper(self) -> None:
        try:
            with self._keeper_scope:
                await trio.sleep_forever()
        finally:
            self._fail_all(ShardUnavailable(f"connection to shard at {self.address} was closed"))
            self._sock.close()

    async def _read_frame(self) -> None:
        """Read one frame and complete the call it answers (a reply whose caller was cancelled
        is read and dropped). Cancellation before its first byte has no effect (the bytes
        that came stay buffered); after it, the caller breaks the connection."""
        rx, hdr, macs, tag = self._rx, self._hdr, self._macs, self._tag
        if not await rx.fill(P.HEADER_SIZE):
            raise ShardUnavailable(f"shard at {self.address} closed the connection")
        self._mid_frame = True
        rx.take(memoryview(hdr))
        frame = P.parse_header(hdr, self._max_body)
        pend = self._arriving = self._pending.pop(frame.request_id, None)
        if (pend is not None and pend.into is not None and frame.status == P.Status.OK
                and pend.opcode == P.Opcode.GATHER and frame.body_len == len(pend.into)):
            # a GATHER reply: its whole body into the caller's buffer (not zeroed first)
            pend.receiving = True
            await rx.exactly(pend.into, pend.is_abandoned)
            if macs is not None:
                await rx.exactly(memoryview(tag))
                macs.open([hdr, pend.into], tag)
            pend.receiving = False
            frame.body = pend.into
            pend.reply = P.decode_reply(frame)
        elif (pend is not None and pend.into is not None and frame.status == P.Status.OK
              and not frame.flags & P.FLAG_HOLE and frame.body_len == P.READ_REPLY_FIXED + len(pend.into)
              and pend.opcode == P.Opcode.READ):
            # a READ's bytes straight into the caller's buffer; the caller may be cancelled
            # while they land: it then breaks the connection, which stops us before the next byte
            fixed = self._fixed
            pend.receiving = True
            if rx.buffered >= frame.body_len + len(tag):  # a small reply, whole: no wait
                rx.take(memoryview(fixed))
                rx.take(pend.into)
                rx.take(memoryview(tag))
            else:
                await rx.exactly(memoryview(fixed))
                await rx.exactly(pend.into, pend.is_abandoned)
                await rx.exactly(memoryview(tag))
            if macs is not None:  # checked before the caller sees the bytes
                macs.open([hdr, fixed, pend.into], tag)
            pend.receiving = False
            pend.reply = P.ReadReply(int.from_bytes(fixed, "big"), pend.into)
        else:
            body = bytearray(frame.body_len)
            if frame.body_len:
                await rx.exactly(memoryview(body))
            if macs is not None:
                await rx.exactly(memoryview(tag))
                macs.open([hdr, body], tag)
            frame.body = memoryview(body)
            if pend is not None:
                pend.reply = P.decode_reply(frame)
        self._mid_frame = False
        self._arriving = None
        self._heard = time.monotonic()
        if pend is not None:
            self._complete(pend)

    def _complete(self, pend: _Pending) -> None:
        pend.done = True
        self._wake(pend)

    def _wake(self, pend: _Pending) -> None:
        """Reschedule ``pend``'s caller if it is parked in :meth:`finish`."""
        task, pend.task = pend.task, None
        if task is not None:
            self._followers.pop(pend.rid, None)
            trio.lowlevel.reschedule(task)

    async def _lead(self, pend: _Pending) -> None:
        """Read frames until ``pend`` is answered (or the connection fails), then hand the
        socket to the oldest parked caller."""
        self._leading = True
        try:
            while not pend.done:
                await self._read_frame()
        except (IrdmaError, OSError, trio.ClosedResourceError) as exc:
            if isinstance(exc, auth.AuthFailed):
                log.error("shard at %s: %s", self.address, exc)
            self._break_with(exc if isinstance(exc, ShardUnavailable) else ShardUnavailable(
                f"connection to shard at {self.address} failed: {exc}"))
        except BaseException:
            if self._mid_frame:  # cancelled with a frame half read: the stream cannot go on
                self._break("a call was cancelled while reading a reply")
            raise
        finally:
            self._leading = False
            if self._followers:
                self._wake(next(iter(self._followers.values())))

    def _break_with(self, err: IrdmaError) -> None:
        arriving, self._arriving = self._arriving, None
        if arriving is not None and not arriving.done:  # its reply was arriving: out of _pending
            arriving.error = err
            self._complete(arriving)
        self._fail_all(err)
        self._sock.close()
        self._keeper_scope.cancel()

    def _fail_all(self, err: IrdmaError) -> None:
        if self._broken is None:
            self._broken = err
        pending, self._pending = self._pending, {}
        for pend in pending.values():
            pend.error = err
            self._complete(pend)

    def _break(self, why: str) -> None:
        """Declare the connection broken: fail every pending call and close the socket (a
        caller reading it stops at once, so no byte lands in a buffer whose call has returned)."""
        self._break_with(ShardUnavailable(f"connection to shard at {self.address} closed: {why}"))

    @property
    def broken(self) -> bool:
        """Whether the connection failed. No task reads an idle connection, so one quiet for
        :data:`IDLE_CHECK_S` is asked whether the shard hung up since (a peek of the socket: a
        restarted shard's old connection is not used for a request it would fail)."""
        if self._broken is None and self._raw is not None and not self._pending and not self._leading \
                and time.monotonic() - self._heard > IDLE_CHECK_S:
            self._heard = time.monotonic()
            try:
                hung_up = not self._raw.recv(1, stdlib_socket.MSG_PEEK | stdlib_socket.MSG_DONTWAIT)
            except BlockingIOError:
                hung_up = False
            except OSError as exc:
                self._break_with(ShardUnavailable(f"connection to shard at {self.address} failed: {exc}"))
                return True
            if hung_up:
                self._break_with(ShardUnavailable(f"shard at {self.address} closed the connection"))
        return self._broken is not None

    async def _call(self, msg: P.Call[Any], into: memoryview | None = None) -> P.Reply:
        return await self.finish(await self.start(msg, into))

    async def call(self, request: P.Call[_R]) -> _R:
        """See :meth:`ShardConnection.call`."""
        return await self._call_for(request)

    async def _call_for(self, msg: P.Call[_R], into: memoryview | None = None) -> _R:
        """:meth:`_call`, and the reply must be the kind that answers ``msg`` (:func:`P.reply_kind`).

        Raises:
            UnexpectedReply: the shard answered with another kind of reply; the connection is
                broken (every pending call fails): a shard that mixes up replies is not trusted
                with the next one.
        """
        reply = await self._call(msg, into)
        try:
            return P.expect_reply(reply, P.reply_kind(msg), P._REQUEST_OPCODE[type(msg)].name, f"shard at {self.address}")
        except P.UnexpectedReply as exc:
            self._break(str(exc))
            raise

    async def start(self, msg: P.Call[Any], into: memoryview | None = None) -> _Pending:
        """Send a request; :meth:`finish` waits for its reply. Requests started one after the
        other from one task reach the shard in that order (a shard forwarding a chain's updates
        relies on it)."""
        if self._broken is not None:
            raise ShardUnavailable(message_of(self._broken))
        rid = next(self._ids) & 0xFFFFFFFF
        pend = _Pending(P._REQUEST_OPCODE[type(msg)], into, rid=rid)
        parts = P.encode_request(msg, rid)
        # one checkpoint a request (the wait for its reply): a free send lock is taken and a
        # frame the socket takes at once is written without a pass of the scheduler
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            if self._broken is not None:
                raise ShardUnavailable(message_of(self._broken))
            self._pending[rid] = pend
            if self._macs is not None:
                parts.append(self._macs.seal(parts))
            try:
                rest = write_now(self._sock, parts)
                if rest:
                    await send_parts(self._sock, rest)
            except (OSError, trio.ClosedResourceError) as exc:
                self._break(f"send failed: {exc}")
            except BaseException:
                # cancelled with part of the frame perhaps on the wire: nothing may follow it
                self._pending.pop(rid, None)
                self._break("a request was cancelled while being sent")
                raise
        finally:
            self._send_lock.release()
        return pend

    async def finish(self, pend: _Pending) -> P.Reply:
        """Wait for the reply of a request :meth:`start` sent; raise its error as an exception.
        The caller reads the socket itself when no other caller does (see the class)."""
        try:
            while not pend.done:
                if not self._leading:
                    await self._lead(pend)
                    continue
                pend.task = trio.lowlevel.current_task()
                self._followers[pend.rid] = pend

                def abort(_: Any, pend: _Pending = pend) -> trio.lowlevel.Abort:
                    pend.task = None
                    self._followers.pop(pend.rid, None)
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
        except BaseException:
            self._pending.pop(pend.rid, None)
            if pend.receiving:
                pend.abandoned = True  # no reader copies anything more into its buffer
                self._break("a read was cancelled while its reply was arriving")
            raise
        if pend.error is not None:
            raise ShardUnavailable(message_of(pend.error))
        assert pend.reply is not None
        raise_for_error(pend.reply, self.address)
        return pend.reply

    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview, clean: bool = False) -> int:
        reply = await self._call_for(P.Read(file_id, chunk_index, offset, len(into), clean), into)
        if reply.hole:
            into[:] = bytes(len(into))
        elif reply.data is not into:
            if len(reply.data) != len(into):
                raise ShardUnavailable(f"shard at {self.address} sent {len(reply.data)} bytes for {len(into)}")
            into[:] = reply.data
        return reply.version

    async def write(
        self,
        file_id: int,
        chunk_index: int,
        chunk_size: int,
        offset: int,
        op: UpdateOp | Update,
        data: memoryview | bytes,
        existing: bool = False,
        chain: P.Chain | None = None,
    ) -> int:
        reply = await self._call_for(P.Write(file_id, chunk_index, chunk_size, offset, op, data, existing, chain))
        return reply.version

    async def gather(self, file_id: int, extents: np.ndarray, clean: bool = False) -> tuple[np.ndarray, memoryview]:
        # the reply's body lands whole in one buffer (count, versions, bytes), not zeroed first
        n = int(extents["length"].sum(dtype=np.int64))
        body = memoryview(np.empty(P.GATHER_REPLY_FIXED + 8 * len(extents) + n, dtype=np.uint8))  # type: ignore[arg-type]
        reply = await self._call_for(P.Gather(file_id, extents, clean), body)
        if len(reply.versions) != len(extents) or len(reply.data) != n:
            raise ShardUnavailable(f"shard at {self.address} answered a gather of {len(extents)} extents,"
                                   f" {n} bytes, with {len(reply.versions)} and {len(reply.data)}")
        return reply.versions, memoryview(reply.data)

    async def scatter(self, file_id: int, chunk_size: int, extents: np.ndarray, op: UpdateOp | Update,
                      data: memoryview | bytes, existing: bool = False, chain: P.Chain | None = None) -> int:
        reply = await self._call_for(P.Scatter(file_id, chunk_size, extents, op, data, existing, chain))
        return reply.version

    async def aclose(self) -> None:
        if self._broken is None:
            self._fail_all(ShardUnavailable(f"connection to shard at {self.address} was closed"))
        self._sock.close()
        self._keeper_scope.cancel()


class TcpTransport(Transport):
    """Shards reached over TCP (loopback or any IP network)."""

    name = "tcp"

    async def connect(
        self, address: str, nursery: trio.Nursery, *, client_name: str = "", key: auth.KeyRing | None = None,
        timeout: float = CONNECT_TIMEOUT,
    ) -> TcpConnection:
        """See :meth:`Transport.connect`; the TCP connect and the HELLO exchange together take at
        most ``timeout`` seconds (a stopped shard accepts connections but never answers)."""
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise ShardUnavailable(str(exc), "fix the address in the shard map (`irdma shard list`)") from None
        raw = stdlib_socket.socket(stdlib_socket.AF_INET6 if ":" in host else stdlib_socket.AF_INET,
                                   stdlib_socket.SOCK_STREAM)
        sock = trio.socket.from_stdlib_socket(raw)
        try:
            with trio.fail_after(timeout):
                await sock.connect((host, port))
                tune_socket(sock)
                hello, macs = await handshake(sock, address, client_name, key)
        except trio.TooSlowError:
            sock.close()
            raise ShardUnavailable(
                f"shard at {address} did not answer the handshake within {timeout:g} s",
                "is the shard process stopped or overloaded? `irdma shard list` shows its state",
            ) from None
        except (OSError, IrdmaError) as exc:
            sock.close()
            if isinstance(exc, (ShardUnavailable, auth.AuthFailed)):
                raise
            if isinstance(exc, OSError):
                raise ShardUnavailable(
                    f"cannot connect to shard at {address}: {exc.strerror or exc}",
                    "is the shard running? `irdma shard list` shows its state; `irdma up` starts a local cluster",
                ) from None
            raise ShardUnavailable(f"handshake with {address} failed: {exc}") from None
        except BaseException:
            sock.close()
            raise
        info = ShardInfo(hello.shard_id, hello.capacity, hello.max_payload, hello.incarnation, hello.version)
        return TcpConnection(sock, address, info, nursery, macs, raw)
