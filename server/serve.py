"""The shard server process: answers the irdma protocol over TCP with trio.

Each connection is served by two tasks, pipelined: a reader that reads a frame and applies it
to the :class:`Shard` synchronously (so update ops are atomic per chunk, and a connection's
requests are applied in the order they came), and a sender that sends the replies in that
order, at most PIPELINE_DEPTH behind, so the next request is read and applied while a reply is
still on the wire; connections run concurrently. Disk I/O a request needs first (SYNC; a new chunk's zeroing and chunk-index
record on a shard with a data directory) runs in a worker thread, awaited by that task
(:class:`ThreadWork`): the event loop never waits for the disk, and a connection's requests
are still applied in order. A malformed or refused request gets an error reply and changes nothing; a
connection whose framing is lost is closed; the server keeps serving everyone else. A bug met
by one request (an unexpected exception) is logged with its traceback and answered INTERNAL;
one met by a connection closes that connection only (trio's echo-server idiom). Accepting
goes on through EMFILE/ENFILE with back-off (``trio.serve_listeners``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from irdma import auth
from irdma import protocol as P
from irdma._errors import (
    BadRequest,
    IrdmaError,
    RemoteProtocolError,
)
from irdma.metrics import Exporter, shard_metrics
from irdma.metrics import serve as serve_metrics
from irdma.transport.tcp import Macs, Receiver, send_parts, tune_socket

from .replicate import Replicator
from .shard import ChunksPending, Shard, split_extents

if TYPE_CHECKING:
    from .verbs import VerbsShard

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


class ThreadWork:
    """What :meth:`ShardServer.handle` gives for a request that needs disk I/O before it is
    applied (SYNC; a new chunk on a shard with a data directory): an awaitable that does the
    I/O in a worker thread, so the event loop serves the other connections meanwhile, then
    applies the request. A front end (TCP, verbs) awaits it in the connection's own task
    before it reads that connection's next request, so one connection's requests are applied
    in the order they came; it gives what :meth:`ShardServer.handle` gives (a reply, an
    awaitable of one, or another ThreadWork).
    """

    def __init__(self, work: Coroutine[Any, Any, Any], unstarted: Callable[[], None] | None = None) -> None:
        self._work = work
        self._unstarted = unstarted

    def __await__(self) -> Generator[Any, None, P.Reply | Awaitable[P.Reply] | ThreadWork]:
        self._unstarted = None
        return self._work.__await__()  # type: ignore[no-any-return]

    def close(self) -> None:
        """Drop it without awaiting: nothing is applied, and what it reserved is given back."""
        self._work.close()
        if self._unstarted is not None:
            self._unstarted()
            self._unstarted = None


class _Handshake:
    """Where one connection is in the exchange of :mod:`irdma.auth`."""

    def __init__(self) -> None:
        self.ring: auth.KeyRing | None = None
        self.client_nonce = b""
        self.shard_nonce = b""
        self.macs: Macs | None = None
        self.why = ""  # what this shard's log says of a refusal, beyond what the peer is told


class ShardServer:
    """Serves one :class:`Shard` to many clients.

    Args:
        shard: the shard's memory and chunks.
        max_payload: largest READ/WRITE payload accepted, bytes.
        keys: the cluster's key file; every connection must prove the key (:mod:`irdma.auth`).
            None: no authentication (``irdma server --no-auth``, for a trusted test bed only).
    """

    def __init__(self, shard: Shard, max_payload: int = P.DEFAULT_MAX_PAYLOAD,
                 keys: auth.KeySource | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_CONNECTIONS_PER_PEER) -> None:
        self.shard = shard
        self.max_payload = max_payload
        self.keys = keys
        self.verbs: VerbsShard | None = None  # set when the shard's region is registered for RDMA
        self.replicator = Replicator(shard, None, keys)  # its nursery is set when serving
        self.warnings = _PeerWarnings()
        self.connections = 0
        self.per_peer: dict[str, int] = {}
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.metrics = shard_metrics()
        self.metrics.watch(self)
        self.replicator.metrics = self.metrics
        #: ``HOST:PORT`` of this shard's metrics exporter, if it has one (told in STAT replies).
        self.metrics_address = ""
        #: Chunks being made (see :meth:`_make_then_apply`), each with the event set when done.
        self._making: dict[tuple[int, int], trio.Event] = {}
        # a new chunk's disk I/O goes to a worker thread (ThreadWork), not the event loop
        shard.defer_creation = shard.store is not None

    # ------------------------------------------------------------ pure request handling
    def handle(self, frame: P.Frame, staging: memoryview | None = None,
               transport: str = "tcp", zero_copy: bool = False) -> P.Reply | Awaitable[P.Reply] | ThreadWork:
        """Apply one request frame and return the reply. Never raises for bad input.

        ``staging`` is the connection's staging buffer (verbs transport), if it has one. An
        update this shard forwards along a replication chain is applied now and answered later:
        the reply is then an awaitable, and the request's buffers must stay untouched until it
        is done (the forward reads them). ``transport`` (``tcp`` or ``verbs``) labels the
        request's metrics (:mod:`irdma.metrics`).

        ``zero_copy``: a READ's reply data is a view of the shard's memory, valid only until
        this task next yields (an update applied after may change it): the caller sends it at
        once or copies it (:meth:`_reply`). Otherwise it is a copy.

        A request that needs disk I/O before it can be applied (SYNC, or a new chunk on a
        shard with a data directory) gets a :class:`ThreadWork`: the front end awaits it
        before it reads the connection's next request, and gets what this method gives.
        """
        metrics = self.metrics
        t0 = metrics.begin()
        try:
            msg = P.decode_request(frame)
        except P.UnknownOpcode as exc:
            metrics.end(t0, "unknown", transport, "unknown_opcode")
            return P.ErrorReply(P.Status.UNKNOWN_OPCODE, str(exc))
        except RemoteProtocolError as exc:
            metrics.end(t0, _opcode_name(frame.opcode), transport, "bad_request")
            return P.ErrorReply(P.Status.BAD_REQUEST, str(exc))
        if isinstance(msg, P.Sync) and self.shard.store is not None:
            return ThreadWork(self._sync(msg, t0, transport))
        return self._handle(msg, staging, t0, transport, zero_copy)

    def _handle(self, msg: P.Request, staging: memoryview | None, t0: float,
                transport: str, zero_copy: bool = False) -> P.Reply | Awaitable[P.Reply] | ThreadWork:
        try:
            reply = self._apply(msg, staging, zero_copy)
        except ChunksPending as pending:
            return self._make_then_apply(pending, msg, staging, t0, transport)
        except Exception as exc:
            reply = self._error(exc, msg)
        if inspect.isawaitable(reply):
            return self._finish(reply, msg, t0, transport)
        self._observe(t0, msg, reply, transport)
        return reply

    async def _sync(self, msg: P.Sync, t0: float, transport: str) -> P.Reply:
        """SYNC (``msync`` of the region and the version table, a checkpoint of the chunk
        index): it may take a while, so off the event loop; the other connections go on."""
        reply: P.Reply
        try:
            await trio.to_thread.run_sync(self.shard.sync)
            reply = P.VersionReply(0)
        except Exception as exc:  # OSError, sqlite3.Error: this request fails, the shard goes on
            log.error("sync failed: %s", exc)
            reply = P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: sync failed: {exc}")
        except BaseException:
            self.metrics.end(t0, "sync", transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    def _make_then_apply(self, pending: ChunksPending, msg: P.Request, staging: memoryview | None, t0: float,
                         transport: str) -> ThreadWork:
        """Make the chunks ``msg`` reserved (zeroed and recorded by the data directory, in a
        worker thread), wait for those another request is making, then apply ``msg`` again.

        A chunk is reserved by one request only; a request that needs it meanwhile waits for
        it (``self._making``) and then applies as usual, so two requests that create the same
        chunk make it once, and a retried request id is still applied once (the replicator's
        record is checked when each is applied). Requests of one connection stay in order:
        the front end awaits this before the connection's next request.
        """
        done = trio.Event()
        for key, _ in pending.new:
            self._making[key] = done  # at once: a request that finds the chunk reserved waits on it

        def release(made: bool) -> None:
            (self.shard.install if made else self.shard.abandon)(pending.new)
            for key, _ in pending.new:
                if self._making.get(key) is done:
                    del self._making[key]
            done.set()

        async def work() -> P.Reply | Awaitable[P.Reply] | ThreadWork:
            try:
                if pending.new:
                    store = self.shard.store
                    assert store is not None  # only a shard with a data directory defers creation
                    made = False
                    try:
                        await trio.to_thread.run_sync(store.add_chunks,
                                                      [(f, i, c.offset, c.size) for (f, i), c in pending.new])
                        made = True
                    finally:
                        release(made)
                for key in pending.waiting:
                    other = self._making.get(key)
                    if other is not None:
                        await other.wait()
                    else:
                        await trio.lowlevel.checkpoint()
            except Exception as exc:  # OSError, sqlite3.Error: this request fails, the shard goes on
                log.error("shard %d could not make a new chunk: %s", self.shard.shard_id, exc)
                reply = P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: cannot make a new chunk: {exc}")
                self._observe(t0, msg, reply, transport)
                return reply
            except BaseException:
                self.metrics.end(t0, _op_of(msg), transport, "cancelled")
                raise
            return self._handle(msg, staging, t0, transport)

        return ThreadWork(work(), lambda: release(False))

    async def _finish(self, version: Awaitable[int], msg: P.Request, t0: float, transport: str) -> P.Reply:
        reply: P.Reply
        try:
            reply = P.VersionReply(await version)
        except Exception as exc:
            reply = self._error(exc, msg)
        except BaseException:  # cancelled: the connection went away
            self.metrics.end(t0, _op_of(msg), transport, "cancelled")
            raise
        self._observe(t0, msg, reply, transport)
        return reply

    def _observe(self, t0: float, msg: P.Request, reply: P.Reply, transport: str) -> None:
        """Record one answered request in the shard's metrics (never raises)."""
        try:
            status = "ok" if not isinstance(reply, P.ErrorReply) else _status_name(reply.status)
            bytes_in = bytes_out = 0
            if status == "ok":
                if isinstance(msg, P.Write):
                    bytes_in = len(msg.data)
                elif isinstance(msg, P.Scatter):
                    bytes_in = msg.length
                elif isinstance(reply, P.GatherReply):
                    bytes_out = len(reply.data)
                elif isinstance(msg, P.RemoteWrite):
                    bytes_in = msg.length
                elif isinstance(reply, P.ReadReply) and not reply.hole:
                    bytes_out = len(reply.data)
            self.metrics.end(t0, _op_of(msg), transport, status, bytes_in, bytes_out)
        except Exception:  # noqa: BLE001 - metrics never fail a request
            log.debug("recording a request's metrics failed", exc_info=True)

    def _error(self, exc: Exception, msg: P.Request) -> P.ErrorReply:
        """The error reply of a request that raised ``exc`` (:data:`irdma.protocol.STATUS_ERRORS`)."""
        reply = P.error_reply(exc, self.shard.shard_id)
        if reply is not None:
            return reply
        # a bug: this request fails, the shard goes on
        log.error("request %s failed with an unexpected error", type(msg).__name__, exc_info=exc)
        return P.ErrorReply(P.Status.INTERNAL, f"shard {self.shard.shard_id}: internal error: {exc!r}")

    def _apply(self, msg: P.Request, staging: memoryview | None = None,
               zero_copy: bool = False) -> P.Reply | Awaitable[int]:
        shard = self.shard
        if isinstance(msg, P.Read):
            if msg.length > self.max_payload:
                raise BadRequest(f"read of {msg.length} bytes exceeds the payload limit {self.max_payload}")
            self.replicator.check_read(msg)
            version, view = shard.read(msg.file_id, msg.chunk_index, msg.offset, msg.length)
            if view is None:
                return P.ReadReply(version, hole=True)
            if zero_copy:  # sent before this task yields, or copied then (see handle)
                return P.ReadReply(version, view)
            # a copy: the reply may take a while to send, and an update applied meanwhile must
            # not tear it (a chunk's updates are atomic to readers; the frame tag covers it)
            return P.ReadReply(version, bytes(view))
        if isinstance(msg, P.Write):
            if msg.chain is not None:
                out = self.replicator.write(msg, msg.data)
                return P.VersionReply(out) if isinstance(out, int) else out
            if msg.replace:
                raise BadRequest("a whole-chunk copy (FLAG_REPLACE) comes only with a chain")
            version = shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, msg.data,
                                  msg.existing)
            return P.VersionReply(version)
        if isinstance(msg, P.Gather):
            chunks = msg.extents["chunk"].astype(np.int64)
            lengths = msg.extents["length"].astype(np.int64)
            total = int(lengths.sum())
            if total + 8 * len(lengths) > self.max_payload:
                raise BadRequest(f"a gather of {total} bytes in {len(lengths)} extents exceeds the payload limit"
                                 f" {self.max_payload} (8 bytes of version per extent count)")
            if msg.clean:
                self.replicator.check_gather(msg.file_id, chunks)
            into = memoryview(np.empty(total, dtype=np.uint8))  # type: ignore[arg-type]  # a copy (see READ), filled whole
            versions = shard.gather(msg.file_id, chunks, msg.extents["offset"].astype(np.int64), lengths, into)
            return P.GatherReply(versions, into)
        if isinstance(msg, P.Scatter):
            data: memoryview | bytes = msg.data
            if msg.staged:
                if staging is None:
                    raise BadRequest("this connection has no staging buffer (a staged SCATTER needs the verbs transport)")
                n = msg.length
                if msg.staging_offset + n > len(staging):
                    raise BadRequest(f"staged range leaves the {len(staging)}-byte staging buffer")
                data = bytes(staging[msg.staging_offset : msg.staging_offset + n])
            if msg.chain is not None:
                out = self.replicator.scatter(msg, data)
                return P.VersionReply(out) if isinstance(out, int) else out
            parts = split_extents(msg.extents, msg.chunk_size, msg.op, len(data))
            return P.VersionReply(max(shard.scatter(msg.file_id, msg.chunk_size, parts, msg.op, data,
                                                         msg.existing)))
        if isinstance(msg, P.Resync):
            out = self.replicator.resync(msg)
            return P.VersionReply(out) if isinstance(out, int) else out
        if isinstance(msg, P.Checksum):
            self.replicator.note_view(msg.view)
            return P.ChecksumReply(*shard.checksum(msg.file_id, msg.chunk_index))
        if isinstance(msg, P.List):
            limit = max(0, min(msg.max_entries, P.MAX_LIST_ENTRIES))
            return P.ListReply([P.ChunkEntry(*e) for e in shard.list_chunks(msg.after_file, msg.after_chunk, limit)])
        if isinstance(msg, P.Sync):
            shard.sync()
            return P.VersionReply(0)
        if isinstance(msg, P.Stat):
            return P.StatReply(shard.shard_id, shard.capacity, shard.used, shard.chunk_count, self.metrics_address)
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
                done = self.replicator.seen(msg.chain.request_id) if msg.chain is not None else None
                version = done if done is not None else shard.commit_in_place(
                    msg.file_id, msg.chunk_index, msg.region_offset, msg.offset, msg.length)
                if msg.chain is None or not msg.chain.successors:
                    return P.VersionReply(version)
                # the bytes are in the chunk already: forward a copy of them (the region changes)
                snap = shard.read(msg.file_id, msg.chunk_index, msg.offset, msg.length)[1]
                assert snap is not None
                fwd = P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, bytes(snap),
                              chain=msg.chain)
                out = self.replicator.write(fwd, fwd.data, applied=version)
                return P.VersionReply(out) if isinstance(out, int) else out
            if staging is None:
                raise BadRequest("this connection has no staging buffer (REMOTE_WRITE needs the verbs transport)")
            if msg.staging_offset + msg.length > len(staging):
                raise BadRequest(f"staged range leaves the {len(staging)}-byte staging buffer")
            data = staging[msg.staging_offset : msg.staging_offset + msg.length]
            if msg.chain is not None:
                fwd = P.Write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, bytes(data),
                              msg.existing, msg.chain)
                out = self.replicator.write(fwd, fwd.data)
                return P.VersionReply(out) if isinstance(out, int) else out
            return P.VersionReply(shard.write(msg.file_id, msg.chunk_index, msg.chunk_size, msg.offset, msg.op, data,
                                              msg.existing))
        raise BadRequest(f"{type(msg).__name__} is not valid here")

    def hello(self, frame: P.Frame, hs: _Handshake) -> P.Reply:
        """The handshake of :mod:`irdma.auth`: HELLO, then (with a key) AUTH. Returns the reply;
        a HelloReply opens the connection (``hs.macs`` then holds its frame tags), an
        AuthChallenge asks for AUTH, an ErrorReply closes it."""
        try:
            msg = P.decode_request(frame)
        except RemoteProtocolError as exc:
            return P.ErrorReply(P.Status.BAD_REQUEST, f"expected HELLO: {exc}")
        if hs.ring is not None:  # the challenge went out: only AUTH may follow
            if not isinstance(msg, P.Auth):
                return P.ErrorReply(P.Status.AUTH_FAILED, "expected AUTH after the challenge")
            t = auth.transcript(hs.ring.cluster_id, hs.client_nonce, hs.shard_nonce, hs.ring.security)
            key = auth.match_client(hs.ring, t, msg.proof)
            if key is None:
                for other in auth.SECURITY_LEVELS:  # the right key at another level: say so
                    if other != hs.ring.security and auth.match_client(
                            hs.ring, auth.transcript(hs.ring.cluster_id, hs.client_nonce, hs.shard_nonce, other),
                            msg.proof):
                        hs.why = f"it uses security level {other!r}, this shard {hs.ring.security!r}"
                        return P.ErrorReply(P.Status.AUTH_FAILED, f"security level mismatch: this shard uses"
                                            f" {hs.ring.security!r}, the client {other!r}: give both the same key"
                                            " file (`irdma key security` sets the level in it)")
                return P.ErrorReply(P.Status.AUTH_FAILED, "wrong cluster key: pass this cluster's key file")
            c2s, s2c = auth.session_keys(key, t)
            hs.macs = Macs(s2c, c2s, hs.ring.security)
            return P.HelloReply(P.PROTOCOL_VERSION, self.shard.shard_id, self.shard.capacity, self.max_payload,
                                self.shard.incarnation, proof=auth.shard_proof(key, t))
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
            return P.HelloReply(P.PROTOCOL_VERSION, self.shard.shard_id, self.shard.capacity, self.max_payload,
                                self.shard.incarnation)
        if len(msg.auth) != auth.CLUSTER_ID_SIZE + auth.NONCE_SIZE:
            return P.ErrorReply(P.Status.AUTH_FAILED, "this shard serves only holders of its cluster key")
        cluster_id = msg.auth[: auth.CLUSTER_ID_SIZE]
        if cluster_id != ring.cluster_id:
            # the peer has not proved the key: it learns nothing of this cluster (its id stays
            # in this shard's log)
            hs.why = f"it names cluster {cluster_id.hex()}, this shard belongs to {ring.cluster_hex}"
            return P.ErrorReply(P.Status.AUTH_FAILED, "this shard belongs to another cluster: pass this cluster's"
                                " key file")
        hs.ring, hs.client_nonce = ring, msg.auth[auth.CLUSTER_ID_SIZE :]
        hs.shard_nonce = secrets.token_bytes(auth.NONCE_SIZE)
        return P.AuthChallenge(hs.shard_nonce)

    # ------------------------------------------------------------ TCP
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
        hs = _Handshake()
        macs: Macs | None = None
        max_body = self.max_payload + P.BODY_SLACK
        handshake_deadline = trio.current_time() + HANDSHAKE_TIMEOUT_S
        while True:
            # before the connection is open the whole handshake has a deadline; after, a frame
            # may be awaited forever (an idle client) but must then arrive whole in time
            with trio.move_on_at(handshake_deadline if not opened else math.inf) as idle:
                try:
                    if not await rx.exactly(memoryview(hdr)):
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
            if idle.cancelled_caught:
                self.warnings.warn(peer, "closing connection from %s: no handshake within %g s", peer,
                                   HANDSHAKE_TIMEOUT_S)
                break
            if frame.body_len > len(staging):
                staging = bytearray(frame.body_len)
            body = memoryview(staging)[: frame.body_len]
            with trio.move_on_at(min(handshake_deadline if not opened else math.inf,
                                     trio.current_time() + FRAME_TIMEOUT_S)) as partial:
                try:
                    await rx.exactly(body)
                    if macs is not None:
                        await rx.exactly(memoryview(tag))
                except (RemoteProtocolError, OSError, trio.ClosedResourceError):
                    break  # truncated frame: nothing applied
            if partial.cancelled_caught:
                self.warnings.warn(peer, "closing connection from %s: a frame did not arrive whole in time", peer)
                break
            if macs is not None:
                try:
                    macs.open([hdr, body], tag)
                except auth.AuthFailed as exc:
                    self.warnings.warn(peer, "closing connection from %s: %s", peer, exc)
                    break  # nothing applied
            frame.body = body
            if not opened:
                reply = self.hello(frame, hs)
                opened = isinstance(reply, P.HelloReply)
                await wire.queue((frame.opcode, frame.request_id, reply, None))  # handshake replies: untagged
                if isinstance(reply, P.ErrorReply):
                    self.warnings.warn(peer, "refused connection from %s: %s", peer, hs.why or reply.message)
                    break
                macs = hs.macs
                tag = bytearray(macs.trailer if macs is not None else 0)
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
            try:
                parts = P.encode_reply(opcode, request_id, reply)
                if macs is not None:
                    parts.append(macs.seal(parts))
                rest = _send_now(wire.sock, parts)
            except (OSError, trio.ClosedResourceError):
                wire.lock.release()
                wire.sock.close()  # the reader's next receive fails: the connection ends
                return
            if not rest:
                wire.lock.release()
                return  # (the reader's next receive is its checkpoint)
            # the sender is parked (not busy): it takes this at once and frees the wire after
            wire.busy = True
            wire.replies.send_nowait((-1, request_id, rest, None))
            return
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


async def run_server(
    shard: Shard,
    host: str,
    port: int,
    *,
    port_file: str | None = None,
    keys: auth.KeySource | None = None,
    max_payload: int = P.DEFAULT_MAX_PAYLOAD,
    verbs: VerbsShard | None = None,
    max_connections: int = MAX_CONNECTIONS,
    max_per_peer: int = MAX_CONNECTIONS_PER_PEER,
    metrics: str | None = None,
    sock: Any = None,
) -> None:
    """The ``irdma server`` main: serve until SIGTERM or SIGINT, then exit cleanly.

    ``sock``: a stdlib socket already bound and listening on ``host:port`` (see
    :meth:`ShardServer.serve_tcp`).

    ``metrics``: ``HOST:PORT`` to serve Prometheus metrics on (:mod:`irdma.metrics`; port 0
    picks one); the bound address is told in STAT replies, where ``irdma stats --meta`` finds it.

    Raises:
        IrdmaError: the metrics address cannot be served (bad address, port in use), before
            the shard listens; OSError: ``host:port`` cannot be bound.
    """
    server = ShardServer(shard, max_payload=max_payload, keys=keys, max_connections=max_connections,
                         max_per_peer=max_per_peer)
    server.verbs = verbs
    exporter: Exporter | None = None
    if metrics:
        exporter = await trio.to_thread.run_sync(serve_metrics, metrics)
        server.metrics_address = exporter.address
    try:
        await _serve_until_signal(server, shard, host, port, port_file, keys, verbs, sock)
    finally:
        if exporter is not None:
            exporter.close()


async def _serve_until_signal(server: ShardServer, shard: Shard, host: str, port: int, port_file: str | None,
                              keys: auth.KeySource | None, verbs: VerbsShard | None, sock: Any = None) -> None:
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(functools.partial(server.serve_tcp, host, port, sock=sock))
        address = f"{bound[0]}:{bound[1]}"
        log.info("shard %d serving %d bytes on %s (%s)%s", shard.shard_id, shard.capacity, address,
                 "tcp and verbs" if verbs is not None else "tcp",
                 f"; metrics on http://{server.metrics_address}/metrics" if server.metrics_address else "")
        if keys is None:
            log.warning("serving WITHOUT authentication (--no-auth): anyone who reaches %s can read and write"
                        " every chunk", address)
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


def _send_now(sock: Any, parts: list[bytes | memoryview]) -> bytes:
    """Write ``parts`` to the non-blocking ``sock`` with ``writev`` (writev(2)) until it would
    block; returns a copy of what it did not take (empty when all went).

    Raises:
        OSError: the connection failed (EPIPE, ECONNRESET, a closed socket's EBADF).
    """
    bufs = [memoryview(p).cast("B") for p in parts]
    total = sum(len(b) for b in bufs)
    sent = 0
    fd = sock.fileno()
    while sent < total:
        try:
            sent += os.writev(fd, _skip(bufs, sent))
        except BlockingIOError:
            break
    return b"".join(_skip(bufs, sent)) if sent < total else b""


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


def _opcode_name(opcode: int) -> str:
    try:
        return P.Opcode(opcode).name.lower()
    except ValueError:
        return "unknown"


_OP_NAMES = {P.Read: "read", P.Write: "write", P.RemoteWrite: "remote_write", P.Resync: "resync",
             P.Checksum: "checksum", P.List: "list", P.Sync: "sync", P.Stat: "stat", P.Free: "free",
             P.Punch: "punch", P.Locate: "locate", P.Gather: "gather", P.Scatter: "scatter"}


def _op_of(msg: P.Request) -> str:
    """The ``op`` label of a request: ``forward`` for an update another shard forwarded."""
    if isinstance(msg, (P.Write, P.Scatter)) and msg.chain is not None and (msg.chain.expect or getattr(msg, "replace", False)):
        return "forward"
    return _OP_NAMES.get(type(msg), type(msg).__name__.lower())


def _status_name(status: int) -> str:
    try:
        return P.Status(status).name.lower()
    except ValueError:
        return "unknown_status"


class _Started:
    """Report the bound address (not the listeners) to ``nursery.start``."""

    def __init__(self, task_status: Any, bound: Any) -> None:
        self._task_status = task_status
        self._bound = bound

    def started(self, value: Any = None) -> None:
        self._task_status.started(self._bound)


__all__ = ["ShardServer", "ThreadWork", "run_server", "IrdmaError"]
