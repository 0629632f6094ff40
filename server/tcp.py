"""The shard's TCP front end: connections that only move frames; :class:`Dispatcher` applies them.

Each connection is served by two tasks, pipelined: a reader that reads a frame and has the
dispatcher apply it (so a connection's requests are applied in the order they came), and a
sender for the replies that cannot go at once, at most PIPELINE_DEPTH behind, so the next
request is read and applied while a reply is still on the wire (:class:`_Wire`). A reply the
socket takes at once goes out before the reader yields, a READ's bytes straight from the
shard's memory. A request that needs disk I/O first (:class:`~irdma.server.dispatch.ThreadWork`)
is awaited before the connection's next request is read. A connection whose framing is lost is
closed; the server keeps serving everyone else. A bug met by a connection closes that connection
only (trio's echo-server idiom). Accepting goes on through EMFILE/ENFILE with back-off
(``trio.serve_listeners``).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

import trio

from irdma._errors import RemoteProtocolError
from irdma.wire import auth
from irdma.wire import protocol as P
from irdma.wire.framing import Macs, Receiver, send_now, send_parts, tune_socket

from .dispatch import Dispatcher, ThreadWork
from .shard import Shard

log = logging.getLogger("irdma.server")

#: Largest body accepted before a connection is authenticated (a HELLO: a name and an auth
#: offer; an AUTH: a proof): nothing larger is reserved for a peer that has not proved the key.
HELLO_MAX_BODY = 4 << 10
#: Seconds a connection has to complete HELLO (and AUTH) after it is accepted.
HANDSHAKE_TIMEOUT_S = 5.0
#: Seconds the rest of a frame may take once its header arrived (a half-sent frame is dropped).
FRAME_TIMEOUT_S = 30.0
#: Staging buffers a connection keeps for reuse once their forwards are acknowledged.
SPARE_STAGING = 2
#: Replies of one connection applied and waiting for its sender (each may hold a READ's copy):
#: past this the connection's next request is not read (TCP's flow control holds the client).
PIPELINE_DEPTH = 4
#: Most connections served at once, in all and from one peer address.
MAX_CONNECTIONS = 4096
MAX_CONNECTIONS_PER_PEER = 1024
#: Seconds between two warnings about one peer address (the others are counted).
WARN_INTERVAL_S = 10.0


#: What the reader of a connection hands its sender: opcode, request id, reply, frame tags; or
#: (-1, request id, the unsent rest of a frame already begun on the wire, None).
_Outgoing = tuple[int, int, "P.Reply | bytes", "Macs | None"]


class _Wire:
    """The sending side of one pipelined connection.

    ``lock`` is held by whoever writes a frame (a Semaphore, not a Lock: the reader may take it
    and hand it to the sender along with the rest of a frame the socket did not take at once).
    ``busy`` is true from the moment the reader queues something for the sender until the
    sender has sent everything queued: the reader sends a reply itself only when the sender is
    not busy and the wire is free, so the sender never waits for a wire held for the frame
    behind it in its queue.
    """

    def __init__(self, sock: Any, replies: trio.MemorySendChannel[_Outgoing]) -> None:
        self.sock = sock
        self.replies = replies
        self.lock = trio.Semaphore(1)
        self.busy = False

    async def queue(self, item: _Outgoing) -> None:
        self.busy = True
        await self.replies.send(item)


class _PeerWarnings:
    """Warnings about misbehaving peers, at most one per address per WARN_INTERVAL_S."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def warn(self, peer: str, msg: str, *args: object) -> None:
        host = peer.rsplit(":", 1)[0]
        now = time.monotonic()
        last, quiet = self._last.get(host, (-math.inf, 0))
        if now - last < WARN_INTERVAL_S:
            self._last[host] = (last, quiet + 1)
            return
        if len(self._last) > 10000:
            self._last.clear()
        self._last[host] = (now, 0)
        extra = f" ({quiet} more from {host} not shown)" if quiet else ""
        log.warning(msg + extra, *args)


class ShardServer(Dispatcher):
    """Serves one :class:`Shard` to many clients over TCP (and, with :attr:`verbs` set, its
    queue pairs).

    Args:
        shard, max_payload, keys: see :class:`Dispatcher`.
        max_connections, max_per_peer: most connections served at once, in all and from one
            peer address; more are closed at once (with a warning at most every WARN_INTERVAL_S).
    """

    def __init__(self, shard: Shard, max_payload: int = P.DEFAULT_MAX_PAYLOAD,
                 keys: auth.KeySource | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_CONNECTIONS_PER_PEER) -> None:
        super().__init__(shard, max_payload, keys)
        self.warnings = _PeerWarnings()
        self.connections = 0
        self.per_peer: dict[str, int] = {}
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer

    async def serve_tcp_connection(self, sock: Any, peer: str) -> None:
        """Serve one client until it goes away. Never raises: a bug closes this connection only."""
        host = peer.rsplit(":", 1)[0]
        if self.connections >= self.max_connections or self.per_peer.get(host, 0) >= self.max_per_peer:
            self.warnings.warn(peer, "refusing a connection from %s: %d connections open (%d from that address)",
                               peer, self.connections, self.per_peer.get(host, 0))
            sock.close()
            return
        self.connections += 1
        self.per_peer[host] = self.per_peer.get(host, 0) + 1
        try:
            tune_socket(sock)
            async with trio.open_nursery() as verbs_nursery:  # queue pairs live as long as this socket
                with sock:
                    await self._serve_frames(sock, peer, verbs_nursery)
                verbs_nursery.cancel_scope.cancel()
        except Exception:
            log.exception("connection from %s failed with an unexpected error; closed", peer)
            sock.close()
        finally:
            self.connections -= 1
            self.per_peer[host] -= 1
            if not self.per_peer[host]:
                del self.per_peer[host]

    async def _verbs_connect(self, frame: P.Frame, nursery: trio.Nursery) -> P.Reply:
        try:
            msg = P.decode_request(frame)
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        if not isinstance(msg, P.VerbsConnect):  # its opcode says it is one: checked all the same
            return P.ErrorReply(P.Status.BAD_REQUEST, f"expected VERBS_CONNECT, got {type(msg).__name__}")
        if self.verbs is None:
            return P.ErrorReply(P.Status.BAD_REQUEST, "this shard serves TCP only (start it with --transport verbs)")
        box: list[P.Reply] = []
        ready = trio.Event()
        nursery.start_soon(self.verbs.serve_connection, msg, self, box, ready)
        await ready.wait()
        return box[0]

    async def _serve_frames(self, sock: Any, peer: str, verbs_nursery: trio.Nursery) -> None:
        """Serve one connection, pipelined: this task reads and applies requests in the order
        they came, while a sender task sends the replies that could not go at once (at most
        PIPELINE_DEPTH waiting), so the next request is read and applied while a reply is
        still on the wire (see :class:`_Wire`)."""
        replies, queued = trio.open_memory_channel[_Outgoing](PIPELINE_DEPTH)
        wire = _Wire(sock, replies)
        async with trio.open_nursery() as pipe:
            pipe.start_soon(self._send_replies, wire, queued)
            async with replies:
                await self._read_frames(sock, peer, verbs_nursery, wire)

    async def _send_replies(self, wire: _Wire, queued: trio.MemoryReceiveChannel[_Outgoing]) -> None:
        """The sender of one connection: the replies the reader queued, in order. Once a send
        fails the socket is closed (the reader's next receive fails) and what is left is dropped."""
        alive = True
        async with queued:
            async for opcode, request_id, reply, macs in queued:
                if not isinstance(reply, bytes):  # else the rest of a frame begun on the wire, held for us
                    await wire.lock.acquire()
                try:
                    if alive:
                        if isinstance(reply, bytes):
                            alive = await self._send_quietly(wire.sock, [reply], None)
                        else:
                            alive = await self._send_quietly(wire.sock, P.encode_reply(opcode, request_id, reply), macs)
                finally:
                    wire.lock.release()
                    if not queued.statistics().current_buffer_used:
                        wire.busy = False
                if not alive:
                    wire.sock.close()

    async def _read_frames(self, sock: Any, peer: str, verbs_nursery: trio.Nursery, wire: _Wire) -> None:
        rx = Receiver(sock)
        hdr = bytearray(P.HEADER_SIZE)
        tag = bytearray(0)  # the trailer after each frame, once the handshake set the tags
        staging = bytearray(0)  # grows to the largest body seen, at most max_payload + slack
        # staging buffers lent to forwards of chained updates, back once the chain acknowledged
        # them (a fresh 4 MiB buffer per forward costs its page faults every time)
        spare: list[bytearray] = []
        opened = False
        hs = self.handshake()
        macs: Macs | None = None
        max_body = self.max_payload + P.BODY_SLACK
        handshake_deadline = trio.current_time() + HANDSHAKE_TIMEOUT_S
        hview = memoryview(hdr)
        tview = memoryview(tag)
        while True:
            # before the connection is open the whole handshake has a deadline; after, a frame
            # may be awaited forever (an idle client: no cancel scope, which costs two passes of
            # trio's deadline bookkeeping a request) but must then arrive whole in time
            try:
                if opened:
                    got: bool | None = await rx.exactly(hview)
                else:
                    got = None
                    with trio.move_on_at(handshake_deadline):
                        got = await rx.exactly(hview)
                    if got is None:
                        self.warnings.warn(peer, "closing connection from %s: no handshake within %g s", peer,
                                           HANDSHAKE_TIMEOUT_S)
                        break
                if not got:
                    break
                # before HELLO only a HELLO-sized body is accepted, in any header version
                frame = P.parse_header(hdr, max_body if opened else HELLO_MAX_BODY, any_version=not opened)
            except RemoteProtocolError as exc:
                self.warnings.warn(peer, "closing connection from %s: %s", peer, exc)
                status = P.Status.TOO_LARGE if isinstance(exc, P.FrameTooLarge) else P.Status.BAD_FRAME
                await wire.queue((0, 0, P.ErrorReply(status, str(exc)), macs))
                break
            except (OSError, trio.ClosedResourceError):
                break
            if frame.body_len > len(staging):
                staging = bytearray(frame.body_len)
            body = memoryview(staging)[: frame.body_len]
            try:
                if opened and rx.buffered >= frame.body_len + len(tag):
                    # the whole frame came with its header (a small request): taken without a wait
                    rx.take(body)
                    rx.take(tview)
                else:
                    whole = False
                    with trio.move_on_at(min(handshake_deadline if not opened else math.inf,
                                             trio.current_time() + FRAME_TIMEOUT_S)):
                        await rx.exactly(body)
                        await rx.exactly(tview)
                        whole = True
                    if not whole:
                        self.warnings.warn(peer, "closing connection from %s: a frame did not arrive whole in time",
                                           peer)
                        break
            except (RemoteProtocolError, OSError, trio.ClosedResourceError):
                break  # truncated frame: nothing applied
            if macs is not None:
                try:
                    macs.open([hdr, body], tag)
                except auth.AuthFailed as exc:
                    self.warnings.warn(peer, "closing connection from %s: %s", peer, exc)
                    break  # nothing applied
            frame.body = body
            if not opened:
                reply = hs.step(frame)
                opened = isinstance(reply, P.HelloReply)
                await wire.queue((frame.opcode, frame.request_id, reply, None))  # handshake replies: untagged
                if isinstance(reply, P.ErrorReply):
                    self.warnings.warn(peer, "refused connection from %s: %s", peer, hs.why or reply.message)
                    break
                macs = hs.macs
                tag = bytearray(macs.trailer if macs is not None else 0)
                tview = memoryview(tag)
                continue
            elif frame.opcode == P.Opcode.VERBS_CONNECT:
                reply = await self._verbs_connect(frame, verbs_nursery)
            else:
                handled = self.handle(frame, zero_copy=True)
                while isinstance(handled, ThreadWork):  # disk I/O first; the next request waits for it
                    handled = await handled
                if not inspect.isawaitable(handled):
                    reply = handled
                else:
                    # answered once the chain has it; meanwhile its forward reads the body buffer
                    lent, staging = staging, spare.pop() if spare else bytearray(0)
                    verbs_nursery.start_soon(self._reply_later, sock, wire.lock, frame.opcode, frame.request_id,
                                             handled, macs, lent, spare)
                    continue
            # the reply holds nothing of the body buffer, so the next frame may be read into it
            await self._reply(wire, frame.opcode, frame.request_id, reply, macs)

    async def _reply(self, wire: _Wire, opcode: int, request_id: int, reply: P.Reply, macs: Macs | None) -> None:
        """Send a reply now if the connection's sender is idle and the wire free, else queue it
        for the sender.

        Sent now, it is tagged and written with ``writev`` before this task yields: a READ's
        bytes go from the shard's memory to the socket with no copy, and no update can be
        applied between the read and the send. What the socket did not take at once is copied
        and handed to the sender, the wire still held for it, and this task goes on reading.
        Queued, a READ's bytes are copied first. Replies may so leave in another order than
        their requests (the client matches them by request id); tags are made with the wire
        held, in the order frames go on it.
        """
        if not wire.busy and wire.lock.value:
            wire.lock.acquire_nowait()
            handed = False
            try:
                parts = P.encode_reply(opcode, request_id, reply)
                if macs is not None:
                    parts.append(macs.seal(parts))
                rest = send_now(wire.sock, parts)
                if rest:
                    # the sender is parked (not busy): it takes this at once and frees the wire after
                    wire.busy = True
                    wire.replies.send_nowait((-1, request_id, rest, None))
                    handed = True
            except (OSError, trio.ClosedResourceError):
                wire.sock.close()  # the reader's next receive fails: the connection ends
            finally:
                if not handed:  # (on any error too: the wire is never left held)
                    wire.lock.release()
            return  # (the reader's next receive is its checkpoint)
        if isinstance(reply, P.ReadReply) and isinstance(reply.data, memoryview):
            reply = P.ReadReply(reply.version, bytes(reply.data), reply.hole)
        await wire.queue((opcode, request_id, reply, macs))

    async def _reply_later(self, sock: Any, send_lock: trio.Semaphore, opcode: int, request_id: int,
                           reply: Awaitable[P.Reply], macs: Macs | None, lent: bytearray | None = None,
                           spare: list[bytearray] | None = None) -> None:
        """Send the reply of a forwarded update once the chain has it. ``lent``: the staging
        buffer its forward read, given back to ``spare`` only when the successor acknowledged
        the update (its frame was sent whole); after an error the forward may still be queued
        on the link, so the buffer is left to it."""
        out = await reply
        if lent is not None and spare is not None and isinstance(out, P.VersionReply) and len(spare) < SPARE_STAGING:
            spare.append(lent)
        async with send_lock:
            if not await self._send_quietly(sock, P.encode_reply(opcode, request_id, out), macs):
                sock.close()

    @staticmethod
    async def _send_quietly(sock: Any, parts: list[bytes | memoryview], macs: Macs | None) -> bool:
        """Send one frame (with its tag on an authenticated connection); call under the send
        lock, so tags are made in the order frames go on the wire."""
        if macs is not None:
            parts.append(macs.seal(parts))
        try:
            await send_parts(sock, parts)
            return True
        except OSError:
            return False

    async def serve_tcp(self, host: str, port: int, *, sock: Any = None,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (port 0 picks one) and serve until cancelled.

        ``sock``: a stdlib socket already bound and listening (``host``/``port`` are then
        ignored): a shard that registers itself listens before its address is in the shard
        map, so a client that reads it early waits in the backlog instead of being refused.
        ``task_status.started`` receives the bound ``(host, port)``.
        """
        if sock is not None:
            listener = trio.socket.from_stdlib_socket(sock)
        else:
            listener = trio.socket.socket(trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET)
            listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            try:
                await listener.bind((host, port))
            except OSError:
                listener.close()
                raise  # the CLI names the address and what to do
            listener.listen(128)
        bound = listener.getsockname()[:2]

        async def handler(stream: trio.SocketStream) -> None:
            try:
                peer = "{}:{}".format(*stream.socket.getpeername()[:2])
            except OSError:
                peer = "?"
            await self.serve_tcp_connection(stream.socket, peer)

        async with trio.open_nursery() as links:  # the replication links to successor shards
            self.replicator.nursery = links
            # serve_listeners backs off on EMFILE/ENFILE instead of dying
            await trio.serve_listeners(handler, [trio.SocketListener(listener)], task_status=_Started(task_status, bound))


class _Started:
    """Report the bound address (not the listeners) to ``nursery.start``."""

    def __init__(self, task_status: Any, bound: Any) -> None:
        self._task_status = task_status
        self._bound = bound

    def started(self, value: Any = None) -> None:
        self._task_status.started(self._bound)
