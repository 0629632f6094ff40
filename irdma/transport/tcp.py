"""TCP transport: the irdma protocol over trio sockets.

Bytes are received with ``recv_into`` straight into the caller's buffer (a pull lands in the
destination array with no intermediate copy) and payloads are sent as views, never joined.
Many requests are pipelined on one connection; a reader task matches replies to requests by
``request_id``.

Cancellation follows the rule of :mod:`irdma.transport.base`: no send is shielded. A call
cancelled while its frame is being sent, or while the reader is receiving its reply into the
caller's buffer, breaks the connection (the socket is closed, every pending call fails);
a call cancelled while it waits for the send lock or for a reply that has not started had no
effect on the stream (a late reply is read into a scratch buffer and dropped).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
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

_R = TypeVar("_R")


#: Turn an error reply into its exception: the one table of :mod:`irdma.wire.protocol`.
raise_for_error = P.raise_for_error


@dataclass
class _Pending:
    opcode: int
    into: memoryview | None = None
    receiving: bool = False  # the reader is filling ``into`` now
    done: trio.Event = field(default_factory=trio.Event)
    reply: P.Reply | None = None
    error: IrdmaError | None = None
    rid: int = 0
    abandoned: bool = False  # its caller returned (cancelled) while the reply was arriving

    def is_abandoned(self) -> bool:
        return self.abandoned


class TcpConnection(ShardConnection):
    """One pipelined TCP connection to a shard. Create with :meth:`TcpTransport.connect`."""

    def __init__(self, sock: Any, address: str, info: ShardInfo, nursery: trio.Nursery,
                 macs: Macs | None = None) -> None:
        self._sock = sock
        self._macs = macs
        self._nursery = nursery
        self.address = address
        self.info = info
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._send_lock = trio.Lock()
        self._broken: IrdmaError | None = None
        self._max_body = info.max_payload + P.BODY_SLACK
        # The reader lives in the client's nursery and owns the socket: when the nursery is
        # cancelled or the peer goes away, it fails every pending call and closes the socket.
        nursery.start_soon(self._reader, name=f"irdma-tcp-reader {address}")

    async def _reader(self) -> None:
        hdr = bytearray(P.HEADER_SIZE)
        hview = memoryview(hdr)
        fixed = bytearray(P.READ_REPLY_FIXED)
        macs = self._macs
        tag = bytearray(macs.trailer if macs is not None else 0)
        fview, tview = memoryview(fixed), memoryview(tag)
        pend: _Pending | None = None
        rx = Receiver(self._sock)
        try:
            while True:
                if not await rx.exactly(hview):
                    raise ShardUnavailable(f"shard at {self.address} closed the connection")
                frame = P.parse_header(hdr, self._max_body)
                pend = self._pending.pop(frame.request_id, None)
                direct = (
                    pend is not None
                    and pend.into is not None
                    and frame.status == P.Status.OK
                    and not frame.flags & P.FLAG_HOLE
                    and frame.body_len == P.READ_REPLY_FIXED + len(pend.into)
                    and pend.opcode == P.Opcode.READ
                )
                whole = (  # a GATHER reply: its whole body into the caller's buffer (not zeroed first)
                    pend is not None
                    and pend.into is not None
                    and frame.status == P.Status.OK
                    and pend.opcode == P.Opcode.GATHER
                    and frame.body_len == len(pend.into)
                )
                if whole:
                    assert pend is not None and pend.into is not None
                    pend.receiving = True
                    await rx.exactly(pend.into, pend.is_abandoned)
                    if macs is not None:
                        await rx.exactly(tview)
                        macs.open([hdr, pend.into], tag)
                    pend.receiving = False
                    frame.body = pend.into
                    pend.reply = P.decode_reply(frame)
                elif direct:
                    assert pend is not None and pend.into is not None
                    # the caller may be cancelled while we fill its buffer: it then breaks the
                    # connection (see _call), which stops us before the next byte lands
                    pend.receiving = True
                    if rx.buffered >= frame.body_len + len(tag):  # a small reply, whole: no wait
                        rx.take(fview)
                        rx.take(pend.into)
                        rx.take(tview)
                    else:
                        await rx.exactly(fview)
                        await rx.exactly(pend.into, pend.is_abandoned)
                        await rx.exactly(tview)
                    if macs is not None:  # checked before the caller sees the bytes
                        macs.open([hdr, fixed, pend.into], tag)
                    pend.receiving = False
                    pend.reply = P.ReadReply(int.from_bytes(fixed, "big"), pend.into)
                else:
                    body = bytearray(frame.body_len)
                    if frame.body_len:
                        await rx.exactly(memoryview(body))
                    if macs is not None:
                        await rx.exactly(tview)
                        macs.open([hdr, body], tag)
                    frame.body = memoryview(body)
                    if pend is None:
                        continue  # its caller was cancelled
                    pend.reply = P.decode_reply(frame)
                pend.done.set()
        except (IrdmaError, OSError, trio.ClosedResourceError) as exc:
            if isinstance(exc, auth.AuthFailed):
                log.error("shard at %s: %s", self.address, exc)
            err = exc if isinstance(exc, ShardUnavailable) else ShardUnavailable(
                f"connection to shard at {self.address} failed: {exc}"
            )
            if pend is not None and not pend.done.is_set():  # its reply was arriving: out of _pending
                pend.error = err
                pend.done.set()
            self._fail_all(err)
        finally:
            self._sock.close()

    def _fail_all(self, err: IrdmaError) -> None:
        if self._broken is None:
            self._broken = err
        for pend in self._pending.values():
            pend.error = err
            pend.done.set()
        self._pending.clear()

    def _break(self, why: str) -> None:
        """Declare the connection broken: fail every pending call and close the socket (the
        reader stops at once, so no byte lands in a buffer whose call has returned)."""
        self._fail_all(ShardUnavailable(f"connection to shard at {self.address} closed: {why}"))
        self._sock.close()

    @property
    def broken(self) -> bool:
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
        pend = _Pending(P._REQUEST_OPCODE[type(msg)], into)
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
        pend.rid = rid
        return pend

    async def finish(self, pend: _Pending) -> P.Reply:
        """Wait for the reply of a request :meth:`start` sent; raise its error as an exception."""
        try:
            await pend.done.wait()
        except BaseException:
            self._pending.pop(pend.rid, None)
            if pend.receiving:
                pend.abandoned = True  # the reader copies nothing more into its buffer
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
        sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET, trio.socket.SOCK_STREAM)
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
        return TcpConnection(sock, address, info, nursery, macs)
