"""Frames on a socket, both sides of the wire: what the client transport (:mod:`irdma.transport.tcp`,
the verbs transport's control connection) and the shard's front ends (:mod:`irdma.server.tcp`,
:mod:`irdma.server.verbs`) share, so neither imports the other's internals.

* Socket set-up (:func:`tune_socket`), exact reads (:func:`recv_exactly`, :class:`Receiver`),
  sends of a frame's parts as views (:func:`send_parts`, and :func:`send_now`: one ``writev``
  before the caller yields), one whole frame read with its tag checked (:func:`read_frame`).
* The handshake of :mod:`irdma.wire.auth` (HELLO, the mutual challenge-response, the frame tags):
  the client's side (:func:`handshake`) and the shard's (:class:`ServerHandshake`).

The bytes themselves are :mod:`irdma.wire.protocol`'s (pure, no I/O, in the manner of h11); the
frame tags are :mod:`irdma.wire.auth`'s.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket as _stdsocket
from collections.abc import Callable
from typing import Any

from irdma._errors import IrdmaError, RemoteProtocolError, ShardUnavailable
from irdma.wire import auth
from irdma.wire import protocol as P

log = logging.getLogger("irdma.framing")

#: Socket send and receive buffers, bytes (requests are small, payloads large).
SOCKET_BUFFER = 4 << 20
_JOIN_LIMIT = 64 << 10

Macs = auth.Macs  # the frame tags of one connection


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

    async def fill(self, n: int) -> bool:
        """Wait until at least ``n`` bytes (at most :attr:`BUFFER`) are buffered, consuming
        none: cancelled, it had no effect (what came stays buffered). Returns False on a clean
        EOF with nothing buffered.

        Raises:
            RemoteProtocolError: EOF with fewer than ``n`` bytes buffered.
        """
        if self._hi - self._lo >= n:
            return True
        if not self._buf:
            self._buf = memoryview(bytearray(self.BUFFER))
        if self._lo:  # what is left to the front, so ``n`` bytes fit behind it
            rest = self._hi - self._lo
            self._buf[:rest] = self._buf[self._lo : self._hi]
            self._lo, self._hi = 0, rest
        while self._hi < n:
            k = await self.sock.recv_into(self._buf[self._hi :], self.BUFFER - self._hi)
            if k == 0:
                if self._hi == self._lo:
                    return False
                raise RemoteProtocolError(f"connection closed after {self._hi - self._lo} of {n} bytes")
            self._hi += k
        return True

    def take(self, view: memoryview) -> None:
        """Fill ``view`` from what is buffered, without a wait: only when :attr:`buffered` is at
        least ``len(view)`` (the rest of a small frame that came with its header)."""
        n = len(view)
        if n > self._hi - self._lo:
            raise ValueError(f"take of {n} bytes with {self._hi - self._lo} buffered")
        view[:] = self._buf[self._lo : self._lo + n]
        self._lo += n

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


def send_now(sock: Any, parts: list[bytes | memoryview]) -> bytes:
    """Write ``parts`` to the non-blocking ``sock`` with ``writev`` (writev(2)) until it would
    block, without yielding; returns a copy of what it did not take (empty when all went):
    :func:`write_now`, its rest joined.

    Raises:
        OSError: the connection failed (EPIPE, ECONNRESET, a closed socket's EBADF).
    """
    rest = write_now(sock, parts)
    return b"".join(rest) if rest else b""


def write_now(sock: Any, parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Write ``parts`` to the non-blocking ``sock`` with ``writev`` (writev(2)) until it would
    block; returns what the socket did not take as views of ``parts`` (no copy: the caller sends them with :func:`send_parts` before it reuses ``parts``' buffers).
    Never yields, so a request whose frame the socket takes at once costs no pass of the
    scheduler (trio's ``send`` ends with one even when it did not block).

    Raises:
        OSError: the connection failed (EPIPE, ECONNRESET, a closed socket's EBADF).
    """
    bufs = [memoryview(p).cast("B") for p in parts]
    total = sum(len(b) for b in bufs)
    sent = 0
    fd = sock.fileno()
    while sent < total:
        try:
            sent += os.writev(fd, _skip(bufs, sent) if sent else bufs)
        except BlockingIOError:
            break
    rest: list[bytes | memoryview] = [*_skip(bufs, sent)] if sent < total else []
    return rest


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` less their first ``n`` bytes (views, no copy)."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


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
    :mod:`irdma.wire.auth`. Returns the shard's HELLO reply and, when authenticated, the frame tags.

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


class ServerHandshake:
    """The shard's side of the handshake of one connection: HELLO, then (with a key) AUTH.

    Args:
        keys: the cluster's key file (None: no authentication, ``--no-auth``).
        identity: the shard's HELLO reply for a given proof (its id, capacity, largest payload
            and incarnation).
    """

    def __init__(self, keys: auth.KeySource | None, identity: Callable[[bytes], P.HelloReply]) -> None:
        self.keys = keys
        self.identity = identity
        self.ring: auth.KeyRing | None = None
        self.client_nonce = b""
        self.shard_nonce = b""
        self.macs: Macs | None = None
        self.why = ""  # what this shard's log says of a refusal, beyond what the peer is told

    def step(self, frame: P.Frame) -> P.Reply:
        """The reply to the next handshake frame: a HelloReply opens the connection
        (:attr:`macs` then holds its frame tags, None without a key), an AuthChallenge asks for
        AUTH, an ErrorReply closes it (:attr:`why` then says more for the shard's log)."""
        try:
            msg = P.decode_request(frame)
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, f"expected HELLO: {exc}")
        if self.ring is not None:  # the challenge went out: only AUTH may follow
            if not isinstance(msg, P.Auth):
                return P.ErrorReply(P.Status.AUTH_FAILED, "expected AUTH after the challenge")
            t = auth.transcript(self.ring.cluster_id, self.client_nonce, self.shard_nonce, self.ring.security)
            key = auth.match_client(self.ring, t, msg.proof)
            if key is None:
                for other in auth.SECURITY_LEVELS:  # the right key at another level: say so
                    if other != self.ring.security and auth.match_client(
                            self.ring, auth.transcript(self.ring.cluster_id, self.client_nonce, self.shard_nonce, other),
                            msg.proof):
                        self.why = f"it uses security level {other!r}, this shard {self.ring.security!r}"
                        return P.ErrorReply(P.Status.AUTH_FAILED, f"security level mismatch: this shard uses"
                                            f" {self.ring.security!r}, the client {other!r}: give both the same key"
                                            " file (`irdma key security` sets the level in it)")
                return P.ErrorReply(P.Status.AUTH_FAILED, "wrong cluster key: pass this cluster's key file")
            c2s, s2c = auth.session_keys(key, t)
            self.macs = Macs(s2c, c2s, self.ring.security)
            return self.identity(auth.shard_proof(key, t))
        if not isinstance(msg, P.Hello):
            return P.ErrorReply(P.Status.BAD_REQUEST, "a connection must open with HELLO")
        if not msg.min_version <= P.PROTOCOL_VERSION <= msg.max_version or msg.max_version < P.MIN_PROTOCOL_VERSION:
            return P.ErrorReply(
                P.Status.UNSUPPORTED_VERSION,
                f"client speaks versions {msg.min_version}..{msg.max_version}, shard speaks"
                f" {P.MIN_PROTOCOL_VERSION}..{P.PROTOCOL_VERSION}: run the same irdma version on both sides",
            )
        try:
            ring = self.keys.ring() if self.keys is not None else None
        except IrdmaError as exc:
            log.error("cannot read the key file: %s", exc)
            return P.ErrorReply(P.Status.INTERNAL, "the shard cannot read its key file")
        if ring is None:
            return self.identity(b"")
        if len(msg.auth) != auth.CLUSTER_ID_SIZE + auth.NONCE_SIZE:
            return P.ErrorReply(P.Status.AUTH_FAILED, "this shard serves only holders of its cluster key")
        cluster_id = msg.auth[: auth.CLUSTER_ID_SIZE]
        if cluster_id != ring.cluster_id:
            # the peer has not proved the key: it learns nothing of this cluster (its id stays
            # in this shard's log)
            self.why = f"it names cluster {cluster_id.hex()}, this shard belongs to {ring.cluster_hex}"
            return P.ErrorReply(P.Status.AUTH_FAILED, "this shard belongs to another cluster: pass this cluster's"
                                " key file")
        self.ring, self.client_nonce = ring, msg.auth[auth.CLUSTER_ID_SIZE :]
        self.shard_nonce = secrets.token_bytes(auth.NONCE_SIZE)
        return P.AuthChallenge(self.shard_nonce)
