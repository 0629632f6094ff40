"""The shard server process: answers the irdma protocol over TCP with trio.

Each connection is served by one task that reads a frame, applies it to the :class:`Shard`
synchronously (so update ops are atomic per chunk), and sends the reply; connections run
concurrently. A malformed or refused request gets an error reply and changes nothing; a
connection whose framing is lost is closed; the server keeps serving everyone else. A bug met
by one request (an unexpected exception) is logged with its traceback and answered INTERNAL;
one met by a connection closes that connection only (trio's echo-server idiom). Accepting
goes on through EMFILE/ENFILE with back-off (``trio.serve_listeners``).
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import trio

from irdma import protocol as P
from irdma._errors import BadRequest, DataLost, IrdmaError, NoSpace, RemoteProtocolError
from irdma.transport.tcp import recv_exactly, send_parts, tune_socket

from .shard import Shard

if TYPE_CHECKING:
    from .verbs import VerbsShard

log = logging.getLogger("irdma.server")

#: Largest body accepted before a connection's HELLO (a HELLO is a name and credentials).
HELLO_MAX_BODY = 64 << 10


class ShardServer:
    """Serves one :class:`Shard` to many clients.

    Args:
        shard: the shard's memory and chunks.
        max_payload: largest READ/WRITE payload accepted, bytes.
        credentials: if not empty, a HELLO must carry exactly these bytes.
    """

    def __init__(self, shard: Shard, max_payload: int = P.DEFAULT_MAX_PAYLOAD, credentials: bytes = b"") -> None:
        self.shard = shard
        self.max_payload = max_payload
        self.credentials = credentials
        self.verbs: VerbsShard | None = None  # set when the shard's region is registered for RDMA

    # ------------------------------------------------------------ pure request handling
    def handle(self, frame: P.Frame, staging: memoryview | None = None) -> P.Reply:
        """Apply one request frame and return the reply. Never raises for bad input.

        ``staging`` is the connection's staging buffer (verbs transport), if it has one.
        """
        try:
            msg = P.decode_request(frame)
        except P.UnknownOpcode as exc:
            return P.ErrorReply(P.Status.UNKNOWN_OPCODE, str(exc))
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        try:
            return self._apply(msg, staging)
        except NoSpace as exc:
            return P.ErrorReply(P.Status.NO_SPACE, str(exc))
        except BadRequest as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        except DataLost as exc:
            return P.ErrorReply(P.Status.CHUNK_LOST, str(exc))
        except Exception as exc:  # a bug: this request fails, the shard goes on
            log.exception("request %s failed with an unexpected error", type(msg).__name__)
            return P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: internal error: {exc!r}")

    def _apply(self, msg: P.Request, staging: memoryview | None = None) -> P.Reply:
        shard = self.shard
        if isinstance(msg, P.Read):
            if msg.length > self.max_payload:
                raise BadRequest(f"read of {msg.length} bytes exceeds the payload limit {self.max_payload}")
            version, view = shard.read(msg.file_id, msg.chunk_index, msg.offset, msg.length)
            if view is None:
                return P.ReadReply(version, hole=True)
            return P.ReadReply(version, view)
        if isinstance(msg, P.Write):
            version = shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, msg.data,
                                  msg.existing)
            return P.VersionReply(version)
        if isinstance(msg, P.List):
            limit = max(0, min(msg.max_entries, P.MAX_LIST_ENTRIES))
            return P.ListReply([P.ChunkEntry(*e) for e in shard.list_chunks(msg.after_file, msg.after_chunk, limit)])
        if isinstance(msg, P.Sync):
            shard.sync()
            return P.VersionReply(0)
        if isinstance(msg, P.Stat):
            return P.StatReply(shard.shard_id, shard.capacity, shard.used, shard.chunk_count)
        if isinstance(msg, P.Free):
            return P.FreeReply(shard.free(msg.file_id, msg.first_chunk))
        if isinstance(msg, P.Punch):
            return P.VersionReply(shard.punch(msg.file_id, msg.chunk_index, msg.offset))
        if isinstance(msg, P.Locate):
            chunk = shard.locate(msg.file_id, msg.chunk_index, msg.create_size)
            if chunk is None:
                return P.LocateReply(False)
            return P.LocateReply(True, chunk.offset, chunk.size, chunk.slot)
        if isinstance(msg, P.RemoteWrite):
            if msg.in_place:
                if msg.op != P.UpdateOp.ASSIGN:
                    raise BadRequest("only assign may be written in place; stage other update ops")
                return P.VersionReply(
                    shard.commit_in_place(msg.file_id, msg.chunk_index, msg.region_offset, msg.offset, msg.length)
                )
            if staging is None:
                raise BadRequest("this connection has no staging buffer (REMOTE_WRITE needs the verbs transport)")
            if msg.staging_offset + msg.length > len(staging):
                raise BadRequest(f"staged range leaves the {len(staging)}-byte staging buffer")
            data = staging[msg.staging_offset : msg.staging_offset + msg.length]
            return P.VersionReply(shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data,
                                              msg.existing))
        raise BadRequest(f"{type(msg).__name__} is not valid here")

    def hello(self, frame: P.Frame) -> P.Reply:
        try:
            msg = P.decode_request(frame)
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, f"expected HELLO: {exc}")
        if not isinstance(msg, P.Hello):
            return P.ErrorReply(P.Status.BAD_REQUEST, "a connection must open with HELLO")
        if not msg.min_version <= P.PROTOCOL_VERSION <= msg.max_version or msg.max_version < P.MIN_PROTOCOL_VERSION:
            return P.ErrorReply(
                P.Status.UNSUPPORTED_VERSION,
                f"client speaks versions {msg.min_version}..{msg.max_version}, shard speaks"
                f" {P.MIN_PROTOCOL_VERSION}..{P.PROTOCOL_VERSION}: run the same irdma version on both sides",
            )
        if self.credentials and not hmac.compare_digest(msg.credentials, self.credentials):
            return P.ErrorReply(P.Status.AUTH_FAILED, "bad credentials: pass the cluster's --auth-token")
        return P.HelloReply(
            P.PROTOCOL_VERSION, self.shard.shard_id, self.shard.capacity, self.max_payload, self.shard.incarnation
        )

    # ------------------------------------------------------------ TCP
    async def serve_tcp_connection(self, sock: Any, peer: str) -> None:
        """Serve one client until it goes away. Never raises: a bug closes this connection only."""
        try:
            tune_socket(sock)
            async with trio.open_nursery() as verbs_nursery:  # queue pairs live as long as this socket
                with sock:
                    await self._serve_frames(sock, peer, verbs_nursery)
                verbs_nursery.cancel_scope.cancel()
        except Exception:
            log.exception("connection from %s failed with an unexpected error; closed", peer)
            sock.close()

    async def _verbs_connect(self, frame: P.Frame, nursery: trio.Nursery) -> P.Reply:
        try:
            msg = P.decode_request(frame)
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        assert isinstance(msg, P.VerbsConnect)
        if self.verbs is None:
            return P.ErrorReply(P.Status.BAD_REQUEST, "this shard serves TCP only (start it with --transport verbs)")
        box: list[P.Reply] = []
        ready = trio.Event()
        nursery.start_soon(self.verbs.serve_connection, msg, self, box, ready)
        await ready.wait()
        return box[0]

    async def _serve_frames(self, sock: Any, peer: str, verbs_nursery: trio.Nursery) -> None:
        hdr = bytearray(P.HEADER_SIZE)
        staging = bytearray(0)  # grows to the largest body seen, at most max_payload + slack
        opened = False
        max_body = self.max_payload + P.BODY_SLACK
        while True:
            try:
                if not await recv_exactly(sock, memoryview(hdr)):
                    break
                # before HELLO only a HELLO-sized body is accepted, in any header version
                frame = P.parse_header(hdr, max_body if opened else HELLO_MAX_BODY, any_version=not opened)
            except RemoteProtocolError as exc:
                log.warning("closing connection from %s: %s", peer, exc)
                status = P.Status.TOO_LARGE if isinstance(exc, P.FrameTooLarge) else P.Status.BAD_FRAME
                await self._send_quietly(sock, P.encode_reply(0, 0, P.ErrorReply(status, str(exc))))
                break
            except OSError:
                break
            if frame.body_len > len(staging):
                staging = bytearray(frame.body_len)
            body = memoryview(staging)[: frame.body_len]
            try:
                await recv_exactly(sock, body)
            except (RemoteProtocolError, OSError):
                break  # truncated frame: nothing applied
            frame.body = body
            if not opened:
                reply = self.hello(frame)
                opened = isinstance(reply, P.HelloReply)
            elif frame.opcode == P.Opcode.VERBS_CONNECT:
                reply = await self._verbs_connect(frame, verbs_nursery)
            elif frame.opcode == P.Opcode.SYNC and not frame.body_len:
                # msync may take a while: off the event loop, the other connections go on
                try:
                    await trio.to_thread.run_sync(self.shard.sync)
                    reply = P.VersionReply(0)
                except OSError as exc:
                    log.error("sync failed: %s", exc)
                    reply = P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: sync failed: {exc}")
            else:
                reply = self.handle(frame)
            if not await self._send_quietly(sock, P.encode_reply(frame.opcode, frame.request_id, reply)):
                break
            if not opened:
                break

    @staticmethod
    async def _send_quietly(sock: Any, parts: list[bytes | memoryview]) -> bool:
        try:
            await send_parts(sock, parts)
            return True
        except OSError:
            return False

    async def serve_tcp(self, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (port 0 picks one) and serve until cancelled.

        ``task_status.started`` receives the bound ``(host, port)``.
        """
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

        # serve_listeners backs off on EMFILE/ENFILE instead of dying
        await trio.serve_listeners(handler, [trio.SocketListener(listener)], task_status=_Started(task_status, bound))


async def run_server(
    shard: Shard,
    host: str,
    port: int,
    *,
    port_file: str | None = None,
    credentials: bytes = b"",
    max_payload: int = P.DEFAULT_MAX_PAYLOAD,
    verbs: VerbsShard | None = None,
) -> None:
    """The ``irdma server`` main: serve until SIGTERM or SIGINT, then exit cleanly."""
    server = ShardServer(shard, max_payload=max_payload, credentials=credentials)
    server.verbs = verbs
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve_tcp, host, port)
        address = f"{bound[0]}:{bound[1]}"
        log.info("shard %d serving %d bytes on %s (%s)", shard.shard_id, shard.capacity, address,
                 "tcp and verbs" if verbs is not None else "tcp")
        if port_file:
            tmp = port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, port_file)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("shard %d stopping on signal %d", shard.shard_id, signum)
                nursery.cancel_scope.cancel()
                break


class _Started:
    """Report the bound address (not the listeners) to ``nursery.start``."""

    def __init__(self, task_status: Any, bound: Any) -> None:
        self._task_status = task_status
        self._bound = bound

    def started(self, value: Any = None) -> None:
        self._task_status.started(self._bound)


__all__ = ["ShardServer", "run_server", "IrdmaError"]
