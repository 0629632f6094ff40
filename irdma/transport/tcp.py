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

import hmac
import itertools
import logging
import secrets
import socket as _stdsocket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio

from irdma import auth
from irdma import protocol as P
from irdma._errors import (
    IrdmaError,
    RemoteProtocolError,
    ShardUnavailable,
)
from irdma.protocol import ChunkEntry, StatReply, Update, UpdateOp

from .base import ShardConnection, ShardInfo, Transport, parse_address

log = logging.getLogger("irdma.transport.tcp")

SOCKET_BUFFER = 4 << 20
_JOIN_LIMIT = 64 << 10
#: Seconds a TCP connect plus HELLO may take before the shard counts as unreachable.
CONNECT_TIMEOUT = 10.0

_R = TypeVar("_R")


def tune_socket(sock: Any) -> None:
    """TCP_NODELAY and large socket buffers: requests are small, payloads large."""
    sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
    for opt in (_stdsocket.SO_SNDBUF, _stdsocket.SO_RCVBUF):
        try:
            sock.setsockopt(_stdsocket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:  # pragma: no cover - capped by the kernel, not fatal
            pass


async def recv_exactly(sock: Any, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``. Returns False on a clean EOF before the first byte.

    Raises:
        RemoteProtocolError: EOF in the middle of ``view``.
    """
    got, n = 0, len(view)
    while got < n:
        k = await sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise RemoteProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


class Receiver:
    """Exact-size reads from a trio socket through a buffer: one ``recv`` takes whatever has
    arrived (up to BUFFER bytes), so the header, fixed part, payload and tag of a small frame
    cost one system call and one pass of the scheduler, not four; what is left of a large
    payload goes straight into its own buffer. Use one per connection, and only it, once the
    connection is open.
    """

    BUFFER = 64 << 10
    #: Bytes still wanted from which a read skips the buffer.
    DIRECT = 16 << 10

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self._buf = memoryview(b"")  # allocated at the first buffered read
        self._lo = self._hi = 0

    @staticmethod
    def _check(abandoned: Callable[[], bool] | None) -> None:
        if abandoned is not None and abandoned():
            raise ShardUnavailable("the call whose buffer this reply was filling returned (cancelled)")

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return self._hi - self._lo

    async def exactly(self, view: memoryview, abandoned: Callable[[], bool] | None = None) -> bool:
        """Fill ``view``. Returns False on a clean EOF before its first byte.

        ``abandoned``: for a caller's buffer, whether its call has returned (cancelled): asked
        before every copy into ``view``, since each ``await`` here lets the caller run; once
        true, not one more byte lands there. (A ``recv_into`` straight into ``view`` follows a
        check with no checkpoint between; an abandoned call has closed the socket, so the
        system call after a wait fails.)

        Raises:
            RemoteProtocolError: EOF in the middle of ``view``.
            ShardUnavailable: ``abandoned`` became true.
        """
        n = len(view)
        got = min(self._hi - self._lo, n)
        if got:
            self._check(abandoned)
            view[:got] = self._buf[self._lo : self._lo + got]
            self._lo += got
        while got < n:
            need = n - got
            self._check(abandoned)
            if need >= self.DIRECT:
                k = await self.sock.recv_into(view[got:], need)
            else:  # the buffer is empty here: take what has arrived, keep the rest
                if not self._buf:
                    self._buf = memoryview(bytearray(self.BUFFER))
                k = await self.sock.recv_into(self._buf, self.BUFFER)
                self._lo, self._hi = min(k, need), k
                self._check(abandoned)  # the caller may have returned during that await
                view[got : got + self._lo] = self._buf[: self._lo]
                k = self._lo
            if k == 0:
                if got == 0:
                    return False
                raise RemoteProtocolError(f"connection closed after {got} of {n} bytes")
            got += k
        return True


async def send_parts(sock: Any, parts: list[bytes | memoryview]) -> None:
    """Send buffers in order; runs of small buffers are joined into one send, payloads go as
    views (never copied)."""
    bufs: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for p in parts:
        if len(p) <= _JOIN_LIMIT:
            small.append(p)
            continue
        if small:
            bufs.append(b"".join(small) if len(small) > 1 else small[0])
            small = []
        bufs.append(p)
    if small:
        bufs.append(b"".join(small) if len(small) > 1 else small[0])
    for buf in bufs:
        view = memoryview(buf).cast("B")
        while len(view):
            sent = await sock.send(view)
            view = view[sent:]


#: Turn an error reply into its exception: the one table of :mod:`irdma.protocol`.
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
                        await rx.exactly(memoryview(tag))
                        macs.open([hdr, pend.into], tag)
                    pend.receiving = False
                    frame.body = pend.into
                    pend.reply = P.decode_reply(frame)
                elif direct:
                    assert pend is not None and pend.into is not None
                    # the caller may be cancelled while we fill its buffer: it then breaks the
                    # connection (see _call), which stops us before the next byte lands
                    pend.receiving = True
                    await rx.exactly(memoryview(fixed))
                    await rx.exactly(pend.into, pend.is_abandoned)
                    if macs is not None:  # checked before the caller sees the bytes
                        await rx.exactly(memoryview(tag))
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

    async def _call(self, msg: P.Request, into: memoryview | None = None) -> P.Reply:
        return await self.finish(await self.start(msg, into))

    async def _call_for(self, msg: P.Request, kind: type[_R], into: memoryview | None = None) -> _R:
        """:meth:`_call`, and the reply must be a ``kind``.

        Raises:
            UnexpectedReply: the shard answered with another kind of reply; the connection is
                broken (every pending call fails): a shard that mixes up replies is not trusted
                with the next one.
        """
        reply = await self._call(msg, into)
        try:
            return P.expect_reply(reply, kind, P._REQUEST_OPCODE[type(msg)].name, f"shard at {self.address}")
        except P.UnexpectedReply as exc:
            self._break(str(exc))
            raise

    async def start(self, msg: P.Request, into: memoryview | None = None) -> _Pending:
        """Send a request; :meth:`finish` waits for its reply. Requests started one after the
        other from one task reach the shard in that order (a shard forwarding a chain's updates
        relies on it)."""
        if self._broken is not None:
            raise ShardUnavailable(str(self._broken))
        rid = next(self._ids) & 0xFFFFFFFF
        pend = _Pending(P._REQUEST_OPCODE[type(msg)], into)
        parts = P.encode_request(msg, rid)
        async with self._send_lock:
            if self._broken is not None:
                raise ShardUnavailable(str(self._broken))
            self._pending[rid] = pend
            if self._macs is not None:
                parts.append(self._macs.seal(parts))
            try:
                await send_parts(self._sock, parts)
            except (OSError, trio.ClosedResourceError) as exc:
                self._break(f"send failed: {exc}")
            except BaseException:
                # cancelled with part of the frame perhaps on the wire: nothing may follow it
                self._pending.pop(rid, None)
                self._break("a request was cancelled while being sent")
                raise
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
            raise ShardUnavailable(str(pend.error))
        assert pend.reply is not None
        raise_for_error(pend.reply, self.address)
        return pend.reply

    async def read(self, file_id: int, chunk_index: int, offset: int, into: memoryview, clean: bool = False) -> int:
        reply = await self._call_for(P.Read(file_id, chunk_index, offset, len(into), clean), P.ReadReply, into)
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
        reply = await self._call_for(P.Write(file_id, chunk_index, chunk_size, offset, op, data, existing, chain),
                                     P.VersionReply)
        return reply.version

    async def gather(self, file_id: int, extents: np.ndarray, clean: bool = False) -> tuple[np.ndarray, memoryview]:
        # the reply's body lands whole in one buffer (count, versions, bytes), not zeroed first
        n = int(extents["length"].sum(dtype=np.int64))
        body = memoryview(np.empty(P.GATHER_REPLY_FIXED + 8 * len(extents) + n, dtype=np.uint8))  # type: ignore[arg-type]
        reply = await self._call_for(P.Gather(file_id, extents, clean), P.GatherReply, body)
        if len(reply.versions) != len(extents) or len(reply.data) != n:
            raise ShardUnavailable(f"shard at {self.address} answered a gather of {len(extents)} extents,"
                                   f" {n} bytes, with {len(reply.versions)} and {len(reply.data)}")
        return reply.versions, memoryview(reply.data)

    async def scatter(self, file_id: int, chunk_size: int, extents: np.ndarray, op: UpdateOp | Update,
                      data: memoryview | bytes, existing: bool = False, chain: P.Chain | None = None) -> int:
        reply = await self._call_for(P.Scatter(file_id, chunk_size, extents, op, data, existing, chain), P.VersionReply)
        return reply.version

    async def resync(self, file_id: int, chunk_index: int, chunk_size: int, chain: P.Chain) -> int:
        reply = await self._call_for(P.Resync(file_id, chunk_index, chunk_size, chain), P.VersionReply)
        return reply.version

    async def checksum(self, file_id: int, chunk_index: int, view: int = 0) -> tuple[int, int]:
        reply = await self._call_for(P.Checksum(file_id, chunk_index, view), P.ChecksumReply)
        return reply.version, reply.crc

    async def stat(self) -> StatReply:
        reply = await self._call_for(P.Stat(), StatReply)
        return reply

    async def free(self, file_id: int, first_chunk: int) -> int:
        reply = await self._call_for(P.Free(file_id, first_chunk), P.FreeReply)
        return reply.freed

    async def punch(self, file_id: int, chunk_index: int, offset: int) -> int:
        reply = await self._call_for(P.Punch(file_id, chunk_index, offset), P.VersionReply)
        return reply.version

    async def sync(self) -> None:
        await self._call_for(P.Sync(), P.VersionReply)

    async def list_chunks(self, after_file: int = 0, after_chunk: int = 0) -> list[ChunkEntry]:
        reply = await self._call_for(P.List(after_file, after_chunk), P.ListReply)
        return reply.entries

    async def aclose(self) -> None:
        if self._broken is None:
            self._fail_all(ShardUnavailable(f"connection to shard at {self.address} was closed"))
        self._sock.close()


Macs = auth.Macs  # the frame tags of one connection (re-exported: the shard's front end uses them)


async def read_frame(sock: Any, address: str, max_body: int, macs: Macs | None, what: str) -> P.Frame:
    """Read exactly one frame (and its tag, checked, on an authenticated connection).

    Raises:
        ShardUnavailable: the peer hung up. RemoteProtocolError: a bad header.
        AuthFailed: the tag did not verify.
    """
    hdr = bytearray(P.HEADER_SIZE)
    if not await recv_exactly(sock, memoryview(hdr)):
        raise ShardUnavailable(f"{address} closed the connection during the {what}")
    frame = P.parse_header(hdr, max_body)
    body = bytearray(frame.body_len)
    await recv_exactly(sock, memoryview(body))
    if macs is not None:
        tag = bytearray(macs.trailer)
        await recv_exactly(sock, memoryview(tag))
        macs.open([hdr, body], tag)
    frame.body = memoryview(body)
    return frame


async def _read_frame(sock: Any, address: str, what: str) -> P.Reply:
    dec = P.FrameDecoder(max_body=1 << 20)
    while (frame := dec.next_frame()) is None:
        data = await sock.recv(65536)
        if not data:
            raise ShardUnavailable(f"{address} closed the connection during the {what}")
        dec.feed(data)
    return P.decode_reply(frame)


async def handshake(sock: Any, address: str, client_name: str,
                    key: auth.KeyRing | None) -> tuple[P.HelloReply, Macs | None]:
    """Open a fresh socket: HELLO, and with a cluster key the mutual challenge-response of
    :mod:`irdma.auth`. Returns the shard's HELLO reply and, when authenticated, the frame tags.

    Raises:
        AuthFailed: the shard refused our proof, did not prove the key itself, belongs to
            another cluster, or needs a key we do not have.
        ShardUnavailable: the peer is not a shard, speaks another version, or hung up.
    """
    offer = b""
    if key is not None:
        nonce = secrets.token_bytes(auth.NONCE_SIZE)
        offer = key.cluster_id + nonce
    await send_parts(sock, P.encode_request(P.Hello(client_name=client_name, auth=offer), 0))
    reply = await _read_frame(sock, address, "handshake")
    macs = None
    if isinstance(reply, P.AuthChallenge):
        if key is None:
            raise auth.AuthFailed(f"shard at {address} accepts only holders of its cluster key",
                                  f"pass the cluster's key file with --key-file or {auth.KEY_FILE_ENV}")
        t = auth.transcript(key.cluster_id, nonce, reply.nonce, key.security)
        await send_parts(sock, P.encode_request(P.Auth(auth.client_proof(key.current, t)), 0))
        reply = await _read_frame(sock, address, "authentication")
        if isinstance(reply, P.HelloReply):
            if not hmac.compare_digest(reply.proof, auth.shard_proof(key.current, t)):
                raise auth.AuthFailed(f"shard at {address} did not prove it holds the cluster key",
                                      "is this address a shard of this cluster? `irdma shard list`")
            c2s, s2c = auth.session_keys(key.current, t)
            macs = Macs(c2s, s2c, key.security)
    elif isinstance(reply, P.HelloReply) and key is not None:
        raise auth.AuthFailed(f"shard at {address} runs without authentication (--no-auth): it cannot prove it"
                              " belongs to this cluster", "start it with the cluster's --key-file")
    if isinstance(reply, P.ErrorReply):
        if reply.status == P.Status.AUTH_FAILED:
            raise auth.AuthFailed(f"shard at {address} refused us: {reply.message}",
                                  f"pass this cluster's key file with --key-file or {auth.KEY_FILE_ENV}")
        raise ShardUnavailable(f"shard at {address} refused the handshake: {reply.status.name}: {reply.message}")
    if not isinstance(reply, P.HelloReply):
        raise ShardUnavailable(f"{address} answered the handshake with {type(reply).__name__}")
    return reply, macs


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
        info = ShardInfo(hello.shard_id, hello.capacity, hello.max_payload, hello.incarnation)
        return TcpConnection(sock, address, info, nursery, macs)
